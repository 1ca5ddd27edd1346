// libtorch calls tch 0.24 does not bind: a CPU tensor over memory Rust owns (freed through
// a callback when libtorch lets go of it), FlashAttention's variable-length forward (packed
// rows without a dense mask), oneDNN's linear against a weight packed once (operators of
// the `mkldnn` namespace, reached through the dispatcher), the TF32 switch, the SDPA
// kernel switches and the CUDA caching allocator's statistics (reached through libc10's allocator registry, which
// libc10_cuda fills at load, so nothing here links CUDA). Compiled by
// torch/build.rs against the libtorch headers; everything it calls lives in libtorch_cpu
// (the CUDA kernel behind _flash_attention_forward is registered by libtorch_cuda at load).
// Tensors cross as tch's handles (heap at::Tensor pointers); C++ exceptions become an error
// text, never an unwind into Rust.
#include <ATen/Context.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <ATen/ops/from_blob.h>

#include "errors.h"
#include <atomic>
#include <cstdio>
#include <memory>
#include <exception>
#include <optional>

using regatta_shim::write_error;

extern "C" {

// A CPU tensor of `like`'s dtype and shape `sizes[0..dims]`, contiguous, over `data`
// without a copy: `release(context)` is called once, when the
// tensor's storage is freed (or here, when making it fails). The caller checked that
// `data` holds the shape's bytes and is aligned for the dtype. Returns 0, or 1 with the
// reason in `error`.
int regatta_tensor_over(void* data, const int64_t* sizes, size_t dims, const at::Tensor* like, void* context,
                        void (*release)(void*), at::Tensor** out, char* error, size_t error_len) {
    // Exactly once, whether libtorch frees the storage or making it throws half-way (a
    // storage already made frees its deleter on the way out).
    auto done = std::make_shared<std::atomic<bool>>(false);
    auto release_once = [context, release, done](void*) {
        if (!done->exchange(true)) {
            release(context);
        }
    };
    try {
        auto options = at::TensorOptions().dtype(like->scalar_type()).device(at::kCPU);
        auto tensor = at::from_blob(data, at::IntArrayRef(sizes, dims), release_once, options);
        *out = new at::Tensor(std::move(tensor));
        return 0;
    } catch (const std::exception& e) {
        release_once(nullptr);
        write_error(e.what(), error, error_len);
        return 1;
    }
}

// Causal attention of packed documents: query [total, heads, dim], key and value [total,
// kv_heads, dim] (GQA when kv_heads < heads), documents given by cumulative lengths
// `cu_seqlens` (int32, [documents + 1]), the longest `max_len`. A window >= 0 lets a query
// see only the `window_left` keys before it. Returns 0 and the output [total, heads, dim]
// in `*out`, or 1 with the reason in `error`.
int regatta_flash_varlen(const at::Tensor* query, const at::Tensor* key, const at::Tensor* value,
                         const at::Tensor* cu_seqlens, int64_t max_len, double scale,
                         int64_t window_left, at::Tensor** out, char* error, size_t error_len) {
    try {
        std::optional<int64_t> left, right;
        if (window_left >= 0) {
            left = window_left;
            right = 0;
        }
        auto result = at::_flash_attention_forward(*query, *key, *value, *cu_seqlens, *cu_seqlens, max_len,
                                                   max_len, 0.0, true, false, scale, left, right);
        *out = new at::Tensor(std::get<0>(result));
        return 0;
    } catch (const std::exception& e) {
        write_error(e.what(), error, error_len);
        return 1;
    }
}

// `weight` ([out, in], float32, CPU) reordered once into oneDNN's blocked layout for a
// linear of about `batch_hint` rows (`mkldnn::_reorder_linear_weight`, what TorchInductor's
// CPU freezing pass does). Returns 0 and the packed (opaque mkldnn) tensor in `*out`, or 1
// with the reason (a libtorch built without oneDNN has no such operator).
int regatta_onednn_pack_linear(const at::Tensor* weight, int64_t batch_hint, at::Tensor** out, char* error,
                               size_t error_len) {
    try {
        static auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
                             .typed<at::Tensor(const at::Tensor&, std::optional<int64_t>)>();
        *out = new at::Tensor(op.call(weight->contiguous(), batch_hint));
        return 0;
    } catch (const std::exception& e) {
        write_error(e.what(), error, error_len);
        return 1;
    }
}

// `input [..., in] @ packed^T (+ bias)` by oneDNN's inner product against a weight from
// regatta_onednn_pack_linear (`mkldnn::_linear_pointwise`, no fused activation); `bias`
// may be null. Returns 0 and the dense float32 output in `*out`, or 1 with the reason.
int regatta_onednn_linear(const at::Tensor* input, const at::Tensor* packed, const at::Tensor* bias, at::Tensor** out,
                          char* error, size_t error_len) {
    try {
        static auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                               c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                               std::optional<c10::string_view>)>();
        std::optional<at::Tensor> b;
        if (bias != nullptr) {
            b = *bias;
        }
        *out = new at::Tensor(
            op.call(*input, *packed, b, "none", c10::List<std::optional<c10::Scalar>>(), std::nullopt));
        return 0;
    } catch (const std::exception& e) {
        write_error(e.what(), error, error_len);
        return 1;
    }
}

// TF32 for float32 matmuls on CUDA ("high" precision), or full float32 ("highest").
void regatta_allow_tf32(int allow) {
    at::globalContext().setFloat32MatmulPrecision(allow ? "high" : "highest");
}

// Whether each SDPA kernel is enabled: flash, memory-efficient, math, cuDNN.
void regatta_sdp_enabled(int* flash, int* efficient, int* math, int* cudnn) {
    auto& context = at::globalContext();
    *flash = context.userEnabledFlashSDP();
    *efficient = context.userEnabledMemEfficientSDP();
    *math = context.userEnabledMathSDP();
    *cudnn = context.userEnabledCuDNNSDP();
}

// The CUDA caching allocator's bytes on `device`: allocated and reserved now, and their
// peaks since the last reset (reset after reading when `reset_peak`). Returns 0, or 1 with
// the reason (a CPU-only libtorch, no such device).
int regatta_cuda_memory(int device, int64_t* allocated, int64_t* peak_allocated, int64_t* reserved,
                        int64_t* peak_reserved, int reset_peak, char* error, size_t error_len) {
    try {
        auto* allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
        auto index = static_cast<c10::DeviceIndex>(device);
        auto stats = allocator->getDeviceStats(index);
        constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
        *allocated = stats.allocated_bytes[all].current;
        *peak_allocated = stats.allocated_bytes[all].peak;
        *reserved = stats.reserved_bytes[all].current;
        *peak_reserved = stats.reserved_bytes[all].peak;
        if (reset_peak) {
            allocator->resetPeakStats(index);
        }
        return 0;
    } catch (const std::exception& e) {
        write_error(e.what(), error, error_len);
        return 1;
    }
}
}
