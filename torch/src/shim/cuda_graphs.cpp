// CUDA graphs for the generation engine's decode step: libtorch's at::cuda::CUDAGraph and
// the CUDA stream switch around a capture, behind a C API that `torch/src/graphs.rs` loads
// with dlopen. These symbols live in libtorch_cuda and libc10_cuda, which the CPU-staged
// libtorch the binaries link against does not have, so this is a shared library of its
// own, built by scripts/build-cuda-graphs.sh against a CUDA PyTorch wheel's headers and
// libraries, and loaded only once CUDA is found. C++ exceptions become an error text, never
// an unwind into Rust.
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <cstdio>
#include <exception>

namespace {
void write_error(const char* text, char* error, size_t error_len) {
    if (error != nullptr && error_len > 0) {
        std::snprintf(error, error_len, "%s", text);
    }
}

// Runs `work`; returns 0, or 1 with the reason in `error` for any C++ exception.
template <typename Work>
int guarded(char* error, size_t error_len, Work work) {
    try {
        work();
        return 0;
    } catch (const std::exception& e) {
        write_error(e.what(), error, error_len);
    } catch (...) {
        write_error("an exception that is not a std::exception", error, error_len);
    }
    return 1;
}

at::cuda::CUDAGraph* as_graph(void* graph) {
    return static_cast<at::cuda::CUDAGraph*>(graph);
}
}  // namespace

extern "C" {

// The version of this C API; `graphs.rs` refuses a library of another.
int regatta_graphs_api_version() {
    return 1;
}

// A new, empty graph in `*out`. Returns 0, or 1 with the reason in `error`.
int regatta_graph_new(void** out, char* error, size_t error_len) {
    return guarded(error, error_len, [&] { *out = new at::cuda::CUDAGraph(); });
}

// Frees a graph (and, with the last graph using it, its memory pool).
void regatta_graph_free(void* graph) {
    guarded(nullptr, 0, [&] { delete as_graph(graph); });
}

// Waits for all work on `device`, then makes a side stream (`side` != 0) or the default
// stream libtorch's current one there: captures must run on a side stream, and the eager
// code around them on the default one.
int regatta_graph_stream(int device, int side, char* error, size_t error_len) {
    return guarded(error, error_len, [&] {
        auto index = static_cast<c10::DeviceIndex>(device);
        c10::cuda::CUDAGuard guard(index);
        c10::cuda::device_synchronize();
        if (side) {
            c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromPool(false, index));
        } else {
            c10::cuda::setCurrentCUDAStream(c10::cuda::getDefaultCUDAStream(index));
        }
    });
}

// Starts capturing the current stream's work into `graph`; its allocations come from the
// memory pool (pool_a, pool_b), or a new pool when both are 0.
int regatta_graph_capture_begin(void* graph, uint64_t pool_a, uint64_t pool_b, char* error, size_t error_len) {
    return guarded(error, error_len, [&] {
        at::cuda::MempoolId_t pool{static_cast<at::cuda::CaptureId_t>(pool_a),
                                   static_cast<at::cuda::CaptureId_t>(pool_b)};
        as_graph(graph)->capture_begin(pool);
    });
}

// Ends the capture (instantiating the graph) and says which memory pool it used.
int regatta_graph_capture_end(void* graph, uint64_t* pool_a, uint64_t* pool_b, char* error, size_t error_len) {
    return guarded(error, error_len, [&] {
        auto* g = as_graph(graph);
        g->capture_end();
        auto pool = g->pool();
        *pool_a = static_cast<uint64_t>(pool.first);
        *pool_b = static_cast<uint64_t>(pool.second);
    });
}

// Replays the captured work on the current stream.
int regatta_graph_replay(void* graph, char* error, size_t error_len) {
    return guarded(error, error_len, [&] { as_graph(graph)->replay(); });
}
}
