// `x Wᵀ + bias` on the CPU (float32) against a weight packed once into column panels:
// `packed` [panels, in, 32] holds output columns 32p..32p+31 of every input position
// contiguously (zeros past the last column), so a product streams each weight byte once
// and, for every input position, multiplies one row of 32 weights into up to 12 rows of
// the batch at once (24 AVX-512 accumulators). Decode steps multiply few rows (1-64)
// through many weights: libtorch's MKL and oneDNN kernels reach 40-50% of the machine's
// GEMM peak at 16 rows there (docs/NOTES.md, "Generation speed on the CPU"). Each output
// sums its products in input order, one fused multiply-add at a time. Parallel over panels
// on libtorch's thread pool. CPUs with AVX2 and FMA but no AVX-512F (AMD Zen 3, older
// Intel) take the same panels as two halves of 16 columns, 6 rows at a time (12 of the 16
// AVX2 registers accumulating): every output is the same FMA chain in input order, so the
// two give the same bits. CPUs with neither get an error; the caller then packs for
// oneDNN. Compiled by torch/build.rs into the same library as shim.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "errors.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

using regatta_shim::expect;
using regatta_shim::write_error;

namespace {

constexpr int64_t kPanel = 32;  // output columns per panel: two AVX-512 vectors
constexpr int64_t kMaxRows = 12;  // batch rows per tile: 24 accumulators of 32 registers
constexpr int64_t kMaxRowsAvx2 = 6;  // with AVX2: 12 accumulators of 16 registers

struct Tile {
    const float* x;      // the tile's first batch row
    int64_t in;          // input width (also x's row stride)
    const float* panel;  // [in, 32]
    float* y;            // the tile's first output row, at the panel's first column
    int64_t out;         // y's row stride
    int64_t cols;        // valid columns of this panel (1..32)
    const float* bias;   // the panel's 32 bias values, or null
};

#if defined(__x86_64__)
bool has_avx512() {
    static const bool yes = __builtin_cpu_supports("avx512f");
    return yes;
}

bool has_avx2() {
    static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return yes;
}

template <int Rows>
__attribute__((target("avx512f"))) void tile(const Tile& t) {
    __m512 lo[Rows], hi[Rows];
#pragma GCC unroll 12
    for (int r = 0; r < Rows; ++r) {
        lo[r] = _mm512_setzero_ps();
        hi[r] = _mm512_setzero_ps();
    }
    const float* w = t.panel;
    for (int64_t k = 0; k < t.in; ++k, w += kPanel) {
        const __m512 w0 = _mm512_loadu_ps(w);
        const __m512 w1 = _mm512_loadu_ps(w + 16);
#pragma GCC unroll 12
        for (int r = 0; r < Rows; ++r) {
            const __m512 xv = _mm512_set1_ps(t.x[r * t.in + k]);
            lo[r] = _mm512_fmadd_ps(xv, w0, lo[r]);
            hi[r] = _mm512_fmadd_ps(xv, w1, hi[r]);
        }
    }
    const __mmask16 m0 = t.cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << t.cols) - 1);
    const __mmask16 m1 = t.cols >= 32 ? 0xFFFF : t.cols <= 16 ? 0 : static_cast<__mmask16>((1u << (t.cols - 16)) - 1);
    if (t.bias != nullptr) {
        const __m512 b0 = _mm512_maskz_loadu_ps(m0, t.bias);
        const __m512 b1 = _mm512_maskz_loadu_ps(m1, t.bias + 16);
#pragma GCC unroll 12
        for (int r = 0; r < Rows; ++r) {
            lo[r] = _mm512_add_ps(lo[r], b0);
            hi[r] = _mm512_add_ps(hi[r], b1);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < Rows; ++r) {
        _mm512_mask_storeu_ps(t.y + r * t.out, m0, lo[r]);
        _mm512_mask_storeu_ps(t.y + r * t.out + 16, m1, hi[r]);
    }
}

// The lanes of a 16-column half below `cols` as AVX2 store masks (all bits set: kept).
__attribute__((target("avx2"))) inline void half_masks(int64_t cols, __m256i* m0, __m256i* m1) {
    const __m256i lanes0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i lanes1 = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i limit = _mm256_set1_epi32(static_cast<int>(std::min<int64_t>(cols, 16)));
    *m0 = _mm256_cmpgt_epi32(limit, lanes0);
    *m1 = _mm256_cmpgt_epi32(limit, lanes1);
}

// The AVX2 tile: each 16-column half of the panel in turn (the panel's rows are 32 floats
// apart), Rows batch rows against it, two 8-float accumulators a row.
template <int Rows>
__attribute__((target("avx2,fma"))) void tile_avx2(const Tile& t) {
    for (int64_t half = 0; half * 16 < t.cols; ++half) {
        __m256 lo[Rows], hi[Rows];
#pragma GCC unroll 6
        for (int r = 0; r < Rows; ++r) {
            lo[r] = _mm256_setzero_ps();
            hi[r] = _mm256_setzero_ps();
        }
        const float* w = t.panel + half * 16;
        for (int64_t k = 0; k < t.in; ++k, w += kPanel) {
            const __m256 w0 = _mm256_loadu_ps(w);
            const __m256 w1 = _mm256_loadu_ps(w + 8);
#pragma GCC unroll 6
            for (int r = 0; r < Rows; ++r) {
                const __m256 xv = _mm256_broadcast_ss(t.x + r * t.in + k);
                lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
                hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
            }
        }
        __m256i m0, m1;
        half_masks(t.cols - half * 16, &m0, &m1);
        if (t.bias != nullptr) {
            const __m256 b0 = _mm256_maskload_ps(t.bias + half * 16, m0);
            const __m256 b1 = _mm256_maskload_ps(t.bias + half * 16 + 8, m1);
#pragma GCC unroll 6
            for (int r = 0; r < Rows; ++r) {
                lo[r] = _mm256_add_ps(lo[r], b0);
                hi[r] = _mm256_add_ps(hi[r], b1);
            }
        }
#pragma GCC unroll 6
        for (int r = 0; r < Rows; ++r) {
            _mm256_maskstore_ps(t.y + r * t.out + half * 16, m0, lo[r]);
            _mm256_maskstore_ps(t.y + r * t.out + half * 16 + 8, m1, hi[r]);
        }
    }
}

using TileFn = void (*)(const Tile&);
const TileFn kTiles[kMaxRows + 1] = {nullptr,  tile<1>, tile<2>, tile<3>,  tile<4>,  tile<5>, tile<6>,
                                     tile<7>,  tile<8>, tile<9>, tile<10>, tile<11>, tile<12>};
const TileFn kTilesAvx2[kMaxRowsAvx2 + 1] = {nullptr,      tile_avx2<1>, tile_avx2<2>, tile_avx2<3>,
                                             tile_avx2<4>, tile_avx2<5>, tile_avx2<6>};

// Tests switch the AVX2 tiles on where AVX-512 would be taken, to compare the two.
bool force_avx2 = false;
#else
bool has_avx512() { return false; }
bool has_avx2() { return false; }
#endif

}  // namespace

extern "C" {

// Which tiles regatta_panel_linear runs on this CPU: 2 AVX-512F, 1 AVX2 with FMA, 0 none
// (it then refuses every product).
int regatta_panel_kernel_level() { return has_avx512() ? 2 : has_avx2() ? 1 : 0; }

// Whether the panel kernel takes its AVX2 tiles even where AVX-512F is there (tests).
void regatta_panel_force_avx2(int force) {
#if defined(__x86_64__)
    force_avx2 = force != 0;
#else
    (void)force;
#endif
}

// `input [..., in] · Wᵀ (+ bias)` for the weight W [out, in] packed as `packed` [panels,
// in, 32] (panels = ceil(out / 32), column 32p + j of W's product in packed[p, :, j]),
// float32 on the CPU; `bias` [out] may be null. Returns 0 and the output [..., out] in
// `*out`, or 1 with the reason (neither AVX-512F nor AVX2 with FMA, shapes that do not fit).
int regatta_panel_linear(const at::Tensor* input, const at::Tensor* packed, int64_t out_width, const at::Tensor* bias,
                         at::Tensor** out, char* error, size_t error_len) {
    try {
        expect(has_avx512() || has_avx2(), "the panel kernel needs AVX-512F or AVX2 with FMA, which this CPU lacks");
        const auto& p = *packed;
        const auto& x = *input;
        expect(p.dim() == 3 && p.size(2) == kPanel && p.scalar_type() == at::kFloat && p.device().is_cpu() &&
                   p.is_contiguous(),
               "packed must be contiguous float32 [panels, in, 32] on the CPU");
        const int64_t panels = p.size(0), in = p.size(1);
        expect(out_width > 0 && (out_width + kPanel - 1) / kPanel == panels, "the output width does not match the panels");
        expect(x.dim() >= 1 && x.size(-1) == in && x.scalar_type() == at::kFloat && x.device().is_cpu(),
               "input must be float32 [..., in] on the CPU");
        at::Tensor b;
        if (bias != nullptr) {
            b = bias->contiguous();
            expect(b.dim() == 1 && b.size(0) == out_width && b.scalar_type() == at::kFloat && b.device().is_cpu(),
                   "bias must be float32 [out] on the CPU");
        }
        const auto xc = x.contiguous();
        const int64_t rows = in > 0 ? xc.numel() / in : 0;
        auto sizes = x.sizes().vec();
        sizes.back() = out_width;
        auto result = at::empty(sizes, x.options().memory_format(at::MemoryFormat::Contiguous));
#if defined(__x86_64__)
        const float* xs = xc.data_ptr<float>();
        const float* ws = p.data_ptr<float>();
        const float* bs = bias != nullptr ? b.data_ptr<float>() : nullptr;
        float* ys = result.data_ptr<float>();
        const bool wide = has_avx512() && !force_avx2;
        const int64_t max_rows = wide ? kMaxRows : kMaxRowsAvx2;
        const TileFn* tiles = wide ? kTiles : kTilesAvx2;
        const int64_t chunks = (rows + max_rows - 1) / max_rows;
        at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
            for (int64_t panel = begin; panel < end; ++panel) {
                Tile t{nullptr, in, ws + panel * in * kPanel, nullptr, out_width,
                       std::min(kPanel, out_width - panel * kPanel), bs != nullptr ? bs + panel * kPanel : nullptr};
                // The batch in near-equal tiles of at most 12 (AVX2: 6) rows, the panel hot
                // in cache.
                int64_t row = 0;
                for (int64_t c = 0; c < chunks; ++c) {
                    const int64_t take = (rows - row + (chunks - c) - 1) / (chunks - c);
                    t.x = xs + row * in;
                    t.y = ys + row * out_width + panel * kPanel;
                    tiles[take](t);
                    row += take;
                }
            }
        });
#endif
        *out = new at::Tensor(result);
        return 0;
    } catch (const std::exception& e) {
        write_error(e.what(), error, error_len);
        return 1;
    }
}
}
