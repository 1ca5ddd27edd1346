// RMSNorm on the CPU (float32), optionally after a residual add, as one pass per row:
// `sum = x + residual; normed = sum * rsqrt(mean(sum²) + eps) * weight`. libtorch composes
// `rms_norm` from six ops (pow, mean, add, rsqrt, mul, mul), each a dispatch, an allocation
// and, at a decode step's 64 rows, a fork and join of the thread pool; a Llama layer runs
// two norms and a residual add before the second, so a step of SmolLM2 made ~400 such ops
// more than this. Each row's mean of squares is summed in double (libtorch sums floats in
// its own order: the results agree to a few units in the last place, not bit for bit).
// Compiled by torch/build.rs into the same library as shim.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "errors.h"

#include <cmath>
#include <exception>
#include <string>

using regatta_shim::expect;
using regatta_shim::write_error;

namespace {

bool cpu_float_rows(const at::Tensor& t) {
    return t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() >= 1 && t.is_contiguous();
}

}  // namespace

extern "C" {

// `x` [..., width] (plus `residual` of the same shape, or null), float32, contiguous, on
// the CPU; `weight` [width]. Writes the normed rows to `*normed` and, with a residual, the
// sum to `*sum` (else `*sum` stays null). Returns 0, or 1 with the reason in `error`.
int regatta_rms_norm(const at::Tensor* x, const at::Tensor* residual, const at::Tensor* weight, double eps,
                     at::Tensor** sum, at::Tensor** normed, char* error, size_t error_len) {
    try {
        expect(cpu_float_rows(*x), "rms_norm takes a contiguous float32 CPU input");
        const int64_t width = x->size(-1);
        expect(width > 0, "rms_norm needs a non-empty last dimension");
        expect(cpu_float_rows(*weight) && weight->dim() == 1 && weight->size(0) == width,
               "the norm's weight must be float32 [width] on the CPU");
        if (residual != nullptr) {
            expect(cpu_float_rows(*residual) && residual->sizes() == x->sizes(),
                   "the residual must be a contiguous float32 CPU tensor shaped as the input");
        }
        const int64_t rows = x->numel() / width;
        auto out = at::empty(x->sizes(), x->options());
        at::Tensor added;
        if (residual != nullptr) {
            added = at::empty(x->sizes(), x->options());
        }
        const float* xs = x->data_ptr<float>();
        const float* rs = residual != nullptr ? residual->data_ptr<float>() : nullptr;
        const float* ws = weight->data_ptr<float>();
        float* os = out.data_ptr<float>();
        float* as = residual != nullptr ? added.data_ptr<float>() : nullptr;
        const float epsilon = static_cast<float>(eps);
        // Rows in chunks of 16: a decode step's 64 rows on both threads, one row alone.
        at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                const float* in = xs + r * width;
                const float* row = in;
                if (as != nullptr) {
                    float* a = as + r * width;
                    const float* res = rs + r * width;
                    for (int64_t j = 0; j < width; ++j) {
                        a[j] = in[j] + res[j];
                    }
                    row = a;
                }
                // Eight running sums (vectorizable) of the squares rounded to float, as
                // libtorch's pow gives them.
                double parts[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                int64_t j = 0;
                for (; j + 8 <= width; j += 8) {
                    for (int k = 0; k < 8; ++k) {
                        const float square = row[j + k] * row[j + k];
                        parts[k] += square;
                    }
                }
                for (; j < width; ++j) {
                    const float square = row[j] * row[j];
                    parts[0] += square;
                }
                double squares = 0.0;
                for (double part : parts) {
                    squares += part;
                }
                const float mean = static_cast<float>(squares / static_cast<double>(width));
                const float scale = 1.0f / std::sqrt(mean + epsilon);
                float* o = os + r * width;
                for (int64_t j = 0; j < width; ++j) {
                    o[j] = ws[j] * (row[j] * scale);
                }
            }
        });
        *normed = new at::Tensor(out);
        *sum = residual != nullptr ? new at::Tensor(added) : nullptr;
        return 0;
    } catch (const std::exception& e) {
        write_error(e.what(), error, error_len);
        return 1;
    }
}
}
