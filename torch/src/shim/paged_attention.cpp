// Attention of a few new tokens per row against the paged KV cache, reading each cached key
// and value where it lies: no gather of every row's keys into a padded batch, no mask
// tensor. What a decode step needs on the CPU (float32): per row, `time` query tokens (one
// when decoding) against the slots `read` names. Parallel over (row, key/value head) on
// libtorch's own thread pool (at::parallel_for), so it shares libgomp's workers with the
// products instead of fighting them. Compiled by torch/build.rs into the same library as
// shim.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "errors.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

using regatta_shim::expect;
using regatta_shim::write_error;

namespace {

// The two inner loops: a dot product of two `dim`-vectors, and `acc += p * v`.
float dot_plain(const float* a, const float* b, int64_t dim) {
    float s = 0.f;
    for (int64_t i = 0; i < dim; ++i) {
        s += a[i] * b[i];
    }
    return s;
}

void axpy_plain(float* acc, float p, const float* v, int64_t dim) {
    for (int64_t i = 0; i < dim; ++i) {
        acc[i] += p * v[i];
    }
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t dim) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= dim; i += 8) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    }
    __m256 s = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    float out = _mm_cvtss_f32(h);
    for (; i < dim; ++i) {
        out += a[i] * b[i];
    }
    return out;
}

__attribute__((target("avx2,fma"))) void axpy_avx2(float* acc, float p, const float* v, int64_t dim) {
    const __m256 pp = _mm256_set1_ps(p);
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
    }
    for (; i < dim; ++i) {
        acc[i] += p * v[i];
    }
}

__attribute__((target("avx512f"))) float dot_avx512(const float* a, const float* b, int64_t dim) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= dim; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    for (; i + 16 <= dim; i += 16) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    }
    float out = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    for (; i < dim; ++i) {
        out += a[i] * b[i];
    }
    return out;
}

__attribute__((target("avx512f"))) void axpy_avx512(float* acc, float p, const float* v, int64_t dim) {
    const __m512 pp = _mm512_set1_ps(p);
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) {
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pp, _mm512_loadu_ps(v + i), _mm512_loadu_ps(acc + i)));
    }
    for (; i < dim; ++i) {
        acc[i] += p * v[i];
    }
}

bool has_avx2() {
    static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return yes;
}

bool has_avx512() {
    static const bool yes = __builtin_cpu_supports("avx512f");
    return yes;
}
#else
bool has_avx2() { return false; }
bool has_avx512() { return false; }
float dot_avx512(const float* a, const float* b, int64_t dim) { return dot_plain(a, b, dim); }
void axpy_avx512(float* acc, float p, const float* v, int64_t dim) { axpy_plain(acc, p, v, dim); }
float dot_avx2(const float* a, const float* b, int64_t dim) { return dot_plain(a, b, dim); }
void axpy_avx2(float* acc, float p, const float* v, int64_t dim) { axpy_plain(acc, p, v, dim); }
#endif

// The widest instructions the kernel may use: 3 AVX-512 with the register kernel for the
// head shapes it has, 2 AVX-512 through attend_one, 1 AVX2, 0 plain C++ (tests lower it to
// check every path on one machine).
std::atomic<int> widest{3};

struct Shape {
    int64_t rows, heads, time, dim, kv_heads, slots, keys, window;
    float scale;
};

// The keys a query at `position` sees of a row holding `length`: indices lo..=hi, keys
// 0..=position below the length, the last `window` of them. hi < lo: none (a padding query).
std::pair<int64_t, int64_t> visible(const Shape& s, int64_t length, int64_t position) {
    const int64_t hi = std::min(position, length - 1);
    const int64_t lo = s.window > 0 ? std::max<int64_t>(0, position - s.window + 1) : 0;
    return {lo, hi};
}

// softmax over each of `rows` rows of `n` scores, in place.
void softmax_rows(float* scores, int64_t rows, int64_t n) {
    for (int64_t g = 0; g < rows; ++g) {
        float* row_scores = scores + g * n;
        const float top = *std::max_element(row_scores, row_scores + n);
        float total = 0.f;
        for (int64_t j = 0; j < n; ++j) {
            row_scores[j] = std::exp(row_scores[j] - top);
            total += row_scores[j];
        }
        const float inv = 1.f / total;
        for (int64_t j = 0; j < n; ++j) {
            row_scores[j] *= inv;
        }
    }
}

// One (row, key/value head): its `group * time` queries against the row's visible keys.
// Each key and value is read once for all the group's query heads.
template <float (*Dot)(const float*, const float*, int64_t), void (*Axpy)(float*, float, const float*, int64_t)>
void attend_one(const Shape& s, int64_t row, int64_t kv_head, const float* q, const float* k_cache,
                const float* v_cache, const int64_t* read, const int64_t* lengths, const int64_t* positions,
                float* out, std::vector<float>& scores) {
    const int64_t group = s.heads / s.kv_heads;
    const int64_t length = std::min(lengths[row], s.keys);
    const int64_t* slots = read + row * s.keys;
    for (int64_t t = 0; t < s.time; ++t) {
        const auto [lo, hi] = visible(s, length, positions[row * s.time + t]);
        auto at = [&](int64_t g) { return ((row * s.heads + kv_head * group + g) * s.time + t) * s.dim; };
        for (int64_t g = 0; g < group; ++g) {
            std::fill(out + at(g), out + at(g) + s.dim, 0.f);
        }
        if (hi < lo) {
            continue;  // sees no key: zeros (only a padding query can)
        }
        const int64_t n = hi - lo + 1;
        scores.resize(static_cast<size_t>(n * group));
        for (int64_t j = 0; j < n; ++j) {
            const float* kv = k_cache + (slots[lo + j] * s.kv_heads + kv_head) * s.dim;
            for (int64_t g = 0; g < group; ++g) {
                scores[g * n + j] = Dot(q + at(g), kv, s.dim) * s.scale;
            }
        }
        softmax_rows(scores.data(), group, n);
        for (int64_t j = 0; j < n; ++j) {
            const float* vv = v_cache + (slots[lo + j] * s.kv_heads + kv_head) * s.dim;
            for (int64_t g = 0; g < group; ++g) {
                Axpy(out + at(g), scores[g * n + j], vv, s.dim);
            }
        }
    }
}

#if defined(__x86_64__)
// attend_one for head sizes of V * 16 and G query heads a key/value head, with G * V <= 16:
// the group's queries and outputs stay in AVX-512 registers for the whole key loop, and the
// loops are compiled for AVX-512 as a whole (attend_one's Dot and Axpy are calls: a
// function built for AVX-512 is not inlined into one that is not). The same sums in a
// different order than attend_one's, so the two agree to float rounding, not bit for bit.
template <int G, int V>
__attribute__((target("avx512f"))) void attend_registers(const Shape& s, int64_t row, int64_t kv_head, const float* q,
                                                         const float* k_cache, const float* v_cache,
                                                         const int64_t* read, const int64_t* lengths,
                                                         const int64_t* positions, float* out,
                                                         std::vector<float>& scores) {
    const int64_t length = std::min(lengths[row], s.keys);
    const int64_t* slots = read + row * s.keys;
    const int64_t stride = s.kv_heads * s.dim;  // floats from one slot to the next
    for (int64_t t = 0; t < s.time; ++t) {
        const auto [lo, hi] = visible(s, length, positions[row * s.time + t]);
        auto at = [&](int64_t g) { return ((row * s.heads + kv_head * G + g) * s.time + t) * s.dim; };
        if (hi < lo) {
            for (int g = 0; g < G; ++g) {
                std::fill(out + at(g), out + at(g) + s.dim, 0.f);
            }
            continue;  // sees no key: zeros (only a padding query can)
        }
        const int64_t n = hi - lo + 1;
        scores.resize(static_cast<size_t>(n * G));
        __m512 qv[G][V];
        for (int g = 0; g < G; ++g) {
            for (int v = 0; v < V; ++v) {
                qv[g][v] = _mm512_loadu_ps(q + at(g) + 16 * v);
            }
        }
        const float* k_base = k_cache + kv_head * s.dim;
        for (int64_t j = 0; j < n; ++j) {
            const float* kv = k_base + slots[lo + j] * stride;
            if (j + 2 < n) {
                _mm_prefetch(reinterpret_cast<const char*>(k_base + slots[lo + j + 2] * stride), _MM_HINT_T0);
            }
            __m512 kk[V];
            for (int v = 0; v < V; ++v) {
                kk[v] = _mm512_loadu_ps(kv + 16 * v);
            }
            for (int g = 0; g < G; ++g) {
                __m512 acc = _mm512_mul_ps(qv[g][0], kk[0]);
                for (int v = 1; v < V; ++v) {
                    acc = _mm512_fmadd_ps(qv[g][v], kk[v], acc);
                }
                scores[g * n + j] = _mm512_reduce_add_ps(acc) * s.scale;
            }
        }
        softmax_rows(scores.data(), G, n);
        __m512 acc[G][V];
        for (int g = 0; g < G; ++g) {
            for (int v = 0; v < V; ++v) {
                acc[g][v] = _mm512_setzero_ps();
            }
        }
        const float* v_base = v_cache + kv_head * s.dim;
        for (int64_t j = 0; j < n; ++j) {
            const float* vv = v_base + slots[lo + j] * stride;
            if (j + 2 < n) {
                _mm_prefetch(reinterpret_cast<const char*>(v_base + slots[lo + j + 2] * stride), _MM_HINT_T0);
            }
            __m512 vals[V];
            for (int v = 0; v < V; ++v) {
                vals[v] = _mm512_loadu_ps(vv + 16 * v);
            }
            for (int g = 0; g < G; ++g) {
                const __m512 p = _mm512_set1_ps(scores[g * n + j]);
                for (int v = 0; v < V; ++v) {
                    acc[g][v] = _mm512_fmadd_ps(p, vals[v], acc[g][v]);
                }
            }
        }
        for (int g = 0; g < G; ++g) {
            for (int v = 0; v < V; ++v) {
                _mm512_storeu_ps(out + at(g) + 16 * v, acc[g][v]);
            }
        }
    }
}

using AttendFn = void (*)(const Shape&, int64_t, int64_t, const float*, const float*, const float*, const int64_t*,
                          const int64_t*, const int64_t*, float*, std::vector<float>&);

// The register kernel for this shape, or null where it has none (head sizes off 64 and 128,
// or more than 16 query vectors a group).
AttendFn registers_for(const Shape& s) {
    const int64_t group = s.heads / s.kv_heads;
    if (s.dim == 64) {
        switch (group) {
            case 1: return attend_registers<1, 4>;
            case 2: return attend_registers<2, 4>;
            case 3: return attend_registers<3, 4>;
            case 4: return attend_registers<4, 4>;
            default: return nullptr;
        }
    }
    if (s.dim == 128) {
        switch (group) {
            case 1: return attend_registers<1, 8>;
            case 2: return attend_registers<2, 8>;
            default: return nullptr;
        }
    }
    return nullptr;
}
#else
using AttendFn = void (*)(const Shape&, int64_t, int64_t, const float*, const float*, const float*, const int64_t*,
                          const int64_t*, const int64_t*, float*, std::vector<float>&);
AttendFn registers_for(const Shape&) { return nullptr; }
#endif

// Every (row, key/value head) through `one`.
void attend_each(AttendFn one, const Shape& s, const float* q, const float* k_cache, const float* v_cache,
                 const int64_t* read, const int64_t* lengths, const int64_t* positions, float* out) {
    at::parallel_for(0, s.rows * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        for (int64_t i = begin; i < end; ++i) {
            one(s, i / s.kv_heads, i % s.kv_heads, q, k_cache, v_cache, read, lengths, positions, out, scores);
        }
    });
}

template <float (*Dot)(const float*, const float*, int64_t), void (*Axpy)(float*, float, const float*, int64_t)>
void attend_all(const Shape& s, const float* q, const float* k_cache, const float* v_cache, const int64_t* read,
                const int64_t* lengths, const int64_t* positions, float* out) {
    attend_each(attend_one<Dot, Axpy>, s, q, k_cache, v_cache, read, lengths, positions, out);
}

// Checks `read`, `lengths` and `positions` against the shape and runs the attention of
// `q` (contiguous [rows, heads, time, dim]) into a new [rows, heads, time, dim] tensor with
// the widest kernel allowed.
// Checks the slots `read` ([rows, keys]) and `lengths` ([rows]) against a cache of `slots`
// slots, and that `positions` holds `tokens` int64 positions: all before anything is written.
void check_reads(int64_t rows, int64_t slots, int64_t tokens, const at::Tensor& read, const at::Tensor& lengths,
                 const at::Tensor& positions) {
    expect(read.dim() == 2 && read.size(0) == rows && read.scalar_type() == at::kLong && read.device().is_cpu(),
           "read must be int64 [rows, keys] on the CPU");
    expect(lengths.numel() == rows && lengths.scalar_type() == at::kLong && lengths.device().is_cpu(),
           "lengths must be int64 [rows] on the CPU");
    expect(positions.numel() == tokens && positions.scalar_type() == at::kLong && positions.device().is_cpu(),
           "positions must be int64 [rows, time] on the CPU");
    const auto rc = read.contiguous();
    const auto lc = lengths.contiguous();
    const int64_t keys = read.size(1);
    const int64_t* at_slot = rc.data_ptr<int64_t>();
    const int64_t* lens = lc.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t length = std::min(lens[r], keys);
        for (int64_t j = 0; j < length; ++j) {
            const int64_t slot = at_slot[r * keys + j];
            expect(slot >= 0 && slot < slots, "a read slot lies outside the cache");
        }
    }
}

at::Tensor attend_checked(const Shape& s, const float* q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& read, const at::Tensor& lengths, const at::Tensor& positions,
                          const at::TensorOptions& options) {
    check_reads(s.rows, s.slots, s.rows * s.time, read, lengths, positions);
    auto rc = read.contiguous();
    auto lc = lengths.contiguous();
    auto pc = positions.contiguous();
    const int64_t* slots = rc.data_ptr<int64_t>();
    const int64_t* lens = lc.data_ptr<int64_t>();
    auto result = at::empty({s.rows, s.heads, s.time, s.dim}, options.memory_format(at::MemoryFormat::Contiguous));
    const int limit = widest.load();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    const int64_t* pos = pc.data_ptr<int64_t>();
    float* o = result.data_ptr<float>();
    const AttendFn registers = limit >= 3 && has_avx512() ? registers_for(s) : nullptr;
    if (registers != nullptr) {
        attend_each(registers, s, q, kp, vp, slots, lens, pos, o);
    } else if (limit >= 2 && has_avx512()) {
        attend_all<dot_avx512, axpy_avx512>(s, q, kp, vp, slots, lens, pos, o);
    } else if (limit >= 1 && has_avx2()) {
        attend_all<dot_avx2, axpy_avx2>(s, q, kp, vp, slots, lens, pos, o);
    } else {
        attend_all<dot_plain, axpy_plain>(s, q, kp, vp, slots, lens, pos, o);
    }
    return result;
}

void expect_caches(const at::Tensor& k, const at::Tensor& v) {
    expect(k.dim() == 3 && v.dim() == 3, "the caches must be [slots, kv_heads, dim]");
    expect(k.device().is_cpu() && v.device().is_cpu(), "paged attention runs on the CPU");
    expect(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "paged attention takes float32");
    expect(k.sizes() == v.sizes(), "the key and value caches differ in shape");
    expect(k.is_contiguous() && v.is_contiguous(), "the caches must be contiguous");
}

// `out = x * cos + rotate_half(x) * sin` for one head (`transformers`' apply_rotary_pos_emb,
// rotate_half(x) = cat(-x[half:], x[:half])): each product rounded, then the sum, as
// libtorch's three ops give it (the shim is compiled with -ffp-contract=off, so no product is
// fused into the add).
void rope_head(const float* x, const float* cos, const float* sin, int64_t dim, float* out) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
    }
    for (int64_t i = half; i < dim; ++i) {
        out[i] = x[i] * cos[i] + x[i - half] * sin[i];
    }
}

}  // namespace

extern "C" {

// Limits the kernel to plain C++ (0), AVX2 (1), AVX-512 (2) or AVX-512 with the register
// kernel (3, the default) where the CPU has them; for tests.
void regatta_paged_attention_widest(int level) { widest.store(level); }

// Queries `query` [rows, heads, time, dim] against the cache `key_cache`/`value_cache`
// [slots, kv_heads, dim] (heads a multiple of kv_heads; head h reads key/value head
// h / (heads / kv_heads), as transformers' repeat_kv), all float32 on the CPU. Row r's key
// j lies in slot read[r, j] ([rows, keys], int64); the query at positions[r, t] ([rows,
// time]) sees keys 0..=position below lengths[r] ([rows]), and with window > 0 only the last
// `window` of them. softmax(q·k · scale) · v per query; a query that sees no key gets
// zeros. Returns 0 and the output [rows, heads, time, dim] in `*out`, or 1 with the reason.
int regatta_paged_attention(const at::Tensor* query, const at::Tensor* key_cache, const at::Tensor* value_cache,
                            const at::Tensor* read, const at::Tensor* lengths, const at::Tensor* positions,
                            int64_t window, double scale, at::Tensor** out, char* error, size_t error_len) {
    try {
        const auto& q = *query;
        const auto& k = *key_cache;
        const auto& v = *value_cache;
        expect_caches(k, v);
        expect(q.dim() == 4, "query must be [rows, heads, time, dim]");
        expect(q.device().is_cpu() && q.scalar_type() == at::kFloat, "paged attention takes float32 on the CPU");
        Shape s{q.size(0), q.size(1), q.size(2), q.size(3), k.size(1), k.size(0), read->size(-1), window,
                static_cast<float>(scale)};
        expect(k.size(2) == s.dim, "the caches' head size differs from the queries'");
        expect(s.kv_heads > 0 && s.heads % s.kv_heads == 0, "heads must be a multiple of key/value heads");
        auto qc = q.contiguous();
        *out = new at::Tensor(attend_checked(s, qc.data_ptr<float>(), k, v, *read, *lengths, *positions, q.options()));
        return 0;
    } catch (const std::exception& e) {
        write_error(e.what(), error, error_len);
        return 1;
    }
}

// One decoder layer's attention from its projections: rotates the queries `q` [rows, time,
// heads * dim] and keys `k` [rows, time, kv_heads * dim] by `cos`/`sin` (contiguous, [rows,
// 1, time, dim]), stores the rotated keys and the values `v` (as `k`) in the caches at slots
// `write` ([rows * time], row-major), then attends as regatta_paged_attention does. One call
// instead of a dozen libtorch ops a layer (rotation, head transposes, the stores).
//
// With `offsets` (int64 [rows + 1], else null) the tokens are packed instead of padded:
// the projections are [1, tokens, width], `cos`/`sin` [1, 1, tokens, dim], `write` and
// `positions` [tokens], and row r's tokens are offsets[r]..offsets[r + 1] (at least one
// each); `read` and `lengths` stay per row. The output is then [1, heads, tokens, dim] (a
// view of a contiguous [1, tokens, heads, dim]).
//
// Returns 0 and the output ([rows, heads, time, dim] padded) in `*out`, or 1 with the reason
// (nothing stored).
int regatta_rope_paged_attention(const at::Tensor* query, const at::Tensor* key, const at::Tensor* value,
                                 const at::Tensor* cos, const at::Tensor* sin, const at::Tensor* key_cache,
                                 const at::Tensor* value_cache, const at::Tensor* write, const at::Tensor* read,
                                 const at::Tensor* lengths, const at::Tensor* positions, const at::Tensor* offsets,
                                 int64_t window, double scale, at::Tensor** out, char* error, size_t error_len) {
    try {
        // Written through: the caches' storage is shared with the engine's cache tensors.
        const auto& kc = *key_cache;
        const auto& vc = *value_cache;
        expect_caches(kc, vc);
        const int64_t slots = kc.size(0), kv_heads = kc.size(1), dim = kc.size(2);
        for (const at::Tensor* t : {query, key, value}) {
            expect(t->dim() == 3 && t->device().is_cpu() && t->scalar_type() == at::kFloat,
                   "the projections must be float32 [rows, time, width] on the CPU");
        }
        expect(dim > 0 && dim % 2 == 0 && query->size(2) % dim == 0, "the queries' width is not whole heads");
        const int64_t heads = query->size(2) / dim;
        expect(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of key/value heads");
        for (const at::Tensor* t : {key, value}) {
            expect(t->size(0) == query->size(0) && t->size(1) == query->size(1) && t->size(2) == kv_heads * dim,
                   "keys and values must be [rows, time, kv_heads * dim] as the cache holds them");
        }
        expect(read->dim() == 2, "read must be [rows, keys]");
        // Each token's row and place in it, padded or packed.
        const bool packed = offsets != nullptr;
        const int64_t rows = packed ? read->size(0) : query->size(0);
        const int64_t tokens = query->size(0) * query->size(1);
        std::vector<int64_t> token_row(static_cast<size_t>(tokens)), token_at(static_cast<size_t>(tokens));
        int64_t time = query->size(1);
        if (packed) {
            expect(query->size(0) == 1, "packed projections must be [1, tokens, width]");
            expect(offsets->numel() == rows + 1 && offsets->scalar_type() == at::kLong && offsets->device().is_cpu(),
                   "offsets must be int64 [rows + 1] on the CPU");
            const auto oc = offsets->contiguous();
            const int64_t* off = oc.data_ptr<int64_t>();
            expect(off[0] == 0 && off[rows] == tokens, "offsets must run from 0 to the number of tokens");
            for (int64_t r = 0; r < rows; ++r) {
                expect(off[r + 1] > off[r], "offsets must rise: every packed row needs at least one token");
            }
            time = 0;
            for (int64_t r = 0; r < rows; ++r) {
                time = std::max(time, off[r + 1] - off[r]);
                for (int64_t i = off[r]; i < off[r + 1]; ++i) {
                    token_row[i] = r;
                    token_at[i] = i - off[r];
                }
            }
        } else {
            for (int64_t i = 0; i < tokens; ++i) {
                token_row[i] = i / time;
                token_at[i] = i % time;
            }
        }
        for (const at::Tensor* t : {cos, sin}) {
            expect(t->numel() == tokens * dim && t->is_contiguous() && t->scalar_type() == at::kFloat &&
                       t->device().is_cpu(),
                   "cos and sin must be contiguous float32 [rows, 1, time, dim]");
        }
        expect(write->numel() == tokens && write->scalar_type() == at::kLong && write->device().is_cpu(),
               "write must be int64 [rows * time] on the CPU");
        expect(positions->numel() == tokens && positions->scalar_type() == at::kLong && positions->device().is_cpu(),
               "positions must be int64 [rows, time] on the CPU");
        auto wc = write->contiguous();
        const int64_t* to = wc.data_ptr<int64_t>();
        for (int64_t i = 0; i < tokens; ++i) {
            expect(to[i] >= 0 && to[i] < slots, "a write slot lies outside the cache");
        }
        check_reads(rows, slots, tokens, *read, *lengths, *positions);
        // Each projection's last dimension contiguous (a group's outputs are views of one
        // product: rows apart by the whole group's width).
        auto last_contiguous = [](const at::Tensor& t) { return t.stride(2) == 1 ? t : t.contiguous(); };
        const auto qt = last_contiguous(*query), kt = last_contiguous(*key), vt = last_contiguous(*value);
        const float* qp = qt.data_ptr<float>();
        const float* kp = kt.data_ptr<float>();
        const float* vp = vt.data_ptr<float>();
        const float* cp = cos->data_ptr<float>();
        const float* sp = sin->data_ptr<float>();
        float* kcp = kc.data_ptr<float>();
        float* vcp = vc.data_ptr<float>();
        const int64_t time_stride = query->size(1);  // tokens of one projection row
        auto token_of = [&](const at::Tensor& t, int64_t i) {
            return (i / time_stride) * t.stride(0) + (i % time_stride) * t.stride(1);
        };
        auto rotated = at::empty({rows, heads, time, dim}, query->options().memory_format(at::MemoryFormat::Contiguous));
        float* rq = rotated.data_ptr<float>();
        // Distinct tokens write distinct slots, but for padding (the scratch block, never
        // read): a token at a time on one thread each.
        at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) {
                const int64_t r = token_row[i], t = token_at[i];
                const float* c = cp + i * dim;
                const float* sn = sp + i * dim;
                const int64_t slot = to[i];
                for (int64_t h = 0; h < kv_heads; ++h) {
                    rope_head(kp + token_of(kt, i) + h * dim, c, sn, dim, kcp + (slot * kv_heads + h) * dim);
                    const float* src = vp + token_of(vt, i) + h * dim;
                    std::copy(src, src + dim, vcp + (slot * kv_heads + h) * dim);
                }
                for (int64_t h = 0; h < heads; ++h) {
                    rope_head(qp + token_of(qt, i) + h * dim, c, sn, dim, rq + ((r * heads + h) * time + t) * dim);
                }
            }
        });
        Shape s{rows, heads, time, dim, kv_heads, slots, read->size(-1), window, static_cast<float>(scale)};
        if (!packed) {
            *out = new at::Tensor(attend_checked(s, rq, kc, vc, *read, *lengths, *positions, query->options()));
            return 0;
        }
        // Padded to the longest row for the attention; a padding query at position -1 sees
        // no key (zeros, nothing computed) and is dropped again below.
        auto padded_positions = at::empty({rows, time}, positions->options().dtype(at::kLong));
        const auto pc = positions->contiguous();
        const int64_t* pos = pc.data_ptr<int64_t>();
        int64_t* pp = padded_positions.data_ptr<int64_t>();
        std::fill(pp, pp + rows * time, int64_t{-1});
        for (int64_t i = 0; i < tokens; ++i) {
            pp[token_row[i] * time + token_at[i]] = pos[i];
        }
        const auto attended =
            attend_checked(s, rq, kc, vc, *read, *lengths, padded_positions, query->options());
        const float* ap = attended.data_ptr<float>();
        auto result = at::empty({1, tokens, heads, dim}, query->options().memory_format(at::MemoryFormat::Contiguous));
        float* res = result.data_ptr<float>();
        at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) {
                for (int64_t h = 0; h < heads; ++h) {
                    const float* src = ap + ((token_row[i] * heads + h) * time + token_at[i]) * dim;
                    std::copy(src, src + dim, res + (i * heads + h) * dim);
                }
            }
        });
        *out = new at::Tensor(result.permute({0, 2, 1, 3}));
        return 0;
    } catch (const std::exception& e) {
        write_error(e.what(), error, error_len);
        return 1;
    }
}
}
