// Fused elementwise ops for the CPU forward: each replaces a chain of 4-10 torch ops (and
// as many passes over memory and Python dispatches) with one pass per row, float32 inside.
//   weir_add_rms_norm: h += delta (optional), x = rmsnorm(h) * weight
//   weir_rope:         rotate-half RoPE in place on the q and k heads of the fused qkv rows
//   weir_silu_mul:     out = silu(gate) * up from the fused gate_up rows
//   weir_rope_write_kv: weir_rope, then each row's k and v to its KV cache slot, in one pass
#include <cmath>
#include <cstdint>
#include <cstring>

#include <type_traits>

#include "cpu_common.h"     // and <immintrin.h> where the CPU has AVX2 or AVX-512
#include "cpu_fp8.h"

namespace {

using weir::exp_neg;
using weir::load;
using weir::store;

// Round a float to the precision of T (bf16: nearest even, branch-free so loops vectorize;
// NaN stays NaN).
template <typename T> inline float rnd(float v);
template <> inline float rnd<float>(float v) { return v; }
template <> inline float rnd<uint16_t>(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    uint32_t r = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    float out;
    std::memcpy(&out, &r, sizeof out);
    return v != v ? v : out;
}

#if defined(__AVX512F__)
// Vector helpers for the loops written out below (SiLU x up, RMSNorm's scaling): GCC's
// cost model for some targets (-march=native on an Intel Xeon with GCC 12) judges the plain
// loops "not profitable" and leaves them scalar (SiLU x up: 8x slower than this, and
// slower than torch's three passes at 2048 rows).
using weir::bf16_16;
using weir::load16;
inline __m512 rnd16(__m512 v, const float*) { return v; }
inline __m512 rnd16(__m512 v, const uint16_t*) { return weir::round_bf16(v); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_16(v));
}
#elif defined(__AVX2__) && defined(__FMA__)
// 8 lanes at a time on AVX2: the same GCC left the plain loop scalar on an AVX2-only EPYC
// ("control flow in loop"), so the cpu plan chose torch's three passes over it.
using weir::bf16_8;
using weir::exp8;
using weir::load8;
inline __m256 rnd8(__m256 v, const float*) { return v; }
inline __m256 rnd8(__m256 v, const uint16_t*) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_8(v)), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_8(v));
}
#endif

template <typename T>
void add_rms_norm(T* __restrict__ h, const T* __restrict__ delta, const T* __restrict__ weight,
                  T* __restrict__ x, int64_t rows, int64_t dim, float eps, int threads) {
    // two straight loops per row (no branch or reload inside), so both vectorize
#pragma omp parallel for num_threads(threads) if (rows > 8)
    for (int64_t r = 0; r < rows; ++r) {
        T* __restrict__ hr = h + r * dim;
        double ss = 0.0;                     // the sum of squares in double: order-proof
        int64_t d1 = 0;
#if defined(__AVX512F__)
        // written out: GCC 12 left this loop scalar too (23 us for 64 rows of 576 on one
        // AMX Xeon core; 60 calls a step); each product of two floats is exact in double
        {
            __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
            const T* __restrict__ dr = delta ? delta + r * dim : nullptr;
            for (; d1 + 16 <= dim; d1 += 16) {
                __m512 v = load16(hr + d1);
                if (dr) {
                    v = rnd16(_mm512_add_ps(v, load16(dr + d1)), hr);   // the stream keeps T
                    store16(hr + d1, v);
                }
                const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
                const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(
                    _mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
                s0 = _mm512_fmadd_pd(lo, lo, s0);
                s1 = _mm512_fmadd_pd(hi, hi, s1);
            }
            ss = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
        }
#endif
        if (delta) {
            const T* __restrict__ dr = delta + r * dim;
#pragma omp simd reduction(+ : ss)
            for (int64_t d = d1; d < dim; ++d) {
                const float v = rnd<T>(load(hr, d) + load(dr, d));   // the stream keeps T
                store(hr, d, v);
                ss += static_cast<double>(v) * v;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t d = d1; d < dim; ++d) {
                const float v = load(hr, d);
                ss += static_cast<double>(v) * v;
            }
        }
        const float inv = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
        T* __restrict__ xr = x + r * dim;
        int64_t d0 = 0;
#if defined(__AVX512F__)
        // written out: GCC 12 left this loop scalar (-march=native, AMX Xeon and Zen 4)
        const __m512 sv = _mm512_set1_ps(inv);
        for (; d0 + 16 <= dim; d0 += 16)
            store16(xr + d0, _mm512_mul_ps(rnd16(_mm512_mul_ps(load16(hr + d0), sv), xr),
                                           load16(weight + d0)));
#endif
        for (int64_t d = d0; d < dim; ++d)  // as torch: normalise in float32, round, scale
            store(xr, d, rnd<T>(load(hr, d) * inv) * load(weight, d));
    }
}

// Rotate-half RoPE in place on the first `heads` heads of one qkv row, from its
// position's float32 cos and sin rows.
template <typename T>
inline void rope_row(T* row, int64_t heads, int64_t dim, const float* c, const float* s) {
    const int64_t half = dim / 2;
    int64_t hd = 0;
#if defined(__AVX512F__)
    // 16 lanes at a time where a half-head is whole vectors (head_dim 64, 128): the row's
    // cos and sin rounded once, not per head and element (the scalar loop below was 0.4 ms
    // for 2048 rows of 12 heads, every layer)
    if (half % 16 == 0 && half <= 128) {
        __m512 cv[16], sv[16];
        for (int64_t d = 0; d < dim; d += 16) {
            cv[d / 16] = rnd16(_mm512_loadu_ps(c + d), row);
            sv[d / 16] = rnd16(_mm512_loadu_ps(s + d), row);
        }
        const int64_t hv = half / 16;
        for (; hd < heads; ++hd) {
            T* x = row + hd * dim;
            for (int64_t v = 0; v < hv; ++v) {
                const __m512 lo = load16(x + v * 16), hi = load16(x + half + v * 16);
                const __m512 nhi = _mm512_sub_ps(_mm512_setzero_ps(), hi);
                store16(x + v * 16,
                        _mm512_add_ps(rnd16(_mm512_mul_ps(lo, cv[v]), row),
                                      rnd16(_mm512_mul_ps(nhi, sv[v]), row)));
                store16(x + half + v * 16,
                        _mm512_add_ps(rnd16(_mm512_mul_ps(hi, cv[hv + v]), row),
                                      rnd16(_mm512_mul_ps(lo, sv[hv + v]), row)));
            }
        }
    }
#endif
    for (; hd < heads; ++hd) {
        T* x = row + hd * dim;
        float tmp[256];
        for (int64_t d = 0; d < dim; ++d) tmp[d] = load(x, d);
        // as the torch path: cos/sin rounded to the model dtype, products in it too
        for (int64_t d = 0; d < half; ++d)
            store(x, d, rnd<T>(tmp[d] * rnd<T>(c[d])) + rnd<T>(-tmp[d + half] * rnd<T>(s[d])));
        for (int64_t d = half; d < dim; ++d)
            store(x, d, rnd<T>(tmp[d] * rnd<T>(c[d])) + rnd<T>(tmp[d - half] * rnd<T>(s[d])));
    }
}

template <typename T>
void rope(T* qkv, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim,
          const int64_t* positions, const float* cos, const float* sin, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 8)
    for (int64_t r = 0; r < rows; ++r)
        rope_row(qkv + r * row_stride, heads, dim, cos + positions[r] * dim,
                 sin + positions[r] * dim);
}

// One row of `n` elements to its cache slot: the same bytes (streaming stores where whole
// aligned cache lines: they do not read the destination lines first), or fp8 codes
// (cpu_fp8.h's rounding: what weir_write_kv_fp8 stores).
template <typename T>
inline void store_kv_row(const T* src, T* dst, int64_t n, bool stream) {
#if defined(__AVX512F__)
    if (stream) {
        const char* a = reinterpret_cast<const char*>(src);
        char* b = reinterpret_cast<char*>(dst);
        for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64)
            _mm512_stream_si512(reinterpret_cast<__m512i*>(b + i),
                                _mm512_loadu_si512(a + i));
        return;
    }
#endif
    (void)stream;
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
}
template <typename T, typename F>
inline void store_kv_row(const T* src, F* dst, int64_t n, bool) {
    weir::fp8_encode_row(src, dst, n);
}

// RoPE and the KV write in one pass over the rows: each row's q and k heads rotated in
// place, then (the row still in L1) its k and v heads stored at its cache slot (-1: none).
// The same results, bit for bit, as rope() then weir_write_kv / weir_write_kv_fp8, in one
// parallel region instead of a parallel one and a serial one.
template <typename T, typename C>
void rope_write_kv(T* qkv, int64_t rows, int64_t row_stride, int64_t heads, int64_t kv_heads,
                   int64_t dim, const int64_t* positions, const float* cos, const float* sin,
                   C* k_cache, C* v_cache, const int64_t* slots, int threads) {
    const int64_t n_kv = kv_heads * dim;
    const bool stream = std::is_same_v<T, C>
        && (n_kv * static_cast<int64_t>(sizeof(C))) % 64 == 0
        && reinterpret_cast<uintptr_t>(k_cache) % 64 == 0
        && reinterpret_cast<uintptr_t>(v_cache) % 64 == 0;
#pragma omp parallel num_threads(threads) if (rows > 8)
    {
#pragma omp for
        for (int64_t r = 0; r < rows; ++r) {
            T* row = qkv + r * row_stride;
            rope_row(row, heads + kv_heads, dim, cos + positions[r] * dim,
                     sin + positions[r] * dim);
            if (slots[r] < 0) continue;
            store_kv_row(row + heads * dim, k_cache + slots[r] * n_kv, n_kv, stream);
            store_kv_row(row + (heads + kv_heads) * dim, v_cache + slots[r] * n_kv, n_kv,
                         stream);
        }
#if defined(__AVX512F__)
        _mm_sfence();      // this thread's streaming stores, before the attention reads them
#endif
    }
}

// silu(g) * u for elements [d0, n) of one row, scalar.
template <typename T>
inline void silu_mul_tail(const T* g, const T* u, T* o, int64_t d0, int64_t n) {
    for (int64_t d = d0; d < n; ++d) {
        const float gv = load(g, d);
        const float e = exp_neg(-std::fabs(gv));           // exp(-|g|) <= 1
        const float s = 1.0f / (1.0f + e);                 // one division, not two
        const float sig = gv >= 0.0f ? s : e * s;
        store(o, d, rnd<T>(gv * sig) * load(u, d));        // silu rounded to T, as torch
    }
}

template <typename T>
void silu_mul(const T* __restrict__ gate_up, T* __restrict__ out, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 2)
    for (int64_t r = 0; r < rows; ++r) {
        const T* g = gate_up + r * 2 * inter;
        const T* u = g + inter;
        T* __restrict__ o = out + r * inter;
        int64_t d = 0;
#if defined(__AVX512F__)
        for (; d + 16 <= inter; d += 16)
            store16(o + d, weir::silu_mul16(load16(g + d), load16(u + d),
                                            sizeof(T) == 2));
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; d + 8 <= inter; d += 8) {
            const __m256 gv = load8(g + d);
            // as above; rcpps is 12 bits, one Newton step makes it ~22
            const __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            const __m256 r0 = _mm256_rcp_ps(den);
            const __m256 sig = _mm256_mul_ps(r0, _mm256_fnmadd_ps(den, r0, _mm256_set1_ps(2.0f)));
            store8(o + d, _mm256_mul_ps(rnd8(_mm256_mul_ps(gv, sig), o), load8(u + d)));
        }
#endif
        silu_mul_tail(g, u, o, d, inter);
    }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16. delta may be null (no residual add).
void weir_add_rms_norm(int dtype, void* h, const void* delta, const void* weight, void* x,
                       int64_t rows, int64_t dim, float eps, int threads) {
    if (dtype == 0)
        add_rms_norm(static_cast<float*>(h), static_cast<const float*>(delta),
                     static_cast<const float*>(weight), static_cast<float*>(x), rows, dim, eps,
                     threads);
    else
        add_rms_norm(static_cast<uint16_t*>(h), static_cast<const uint16_t*>(delta),
                     static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(x), rows, dim,
                     eps, threads);
}

// The first `heads` heads (q then k) of each qkv row; head_dim <= 256; cos/sin float32
// tables [max_position, dim].
void weir_rope(int dtype, void* qkv, int64_t rows, int64_t row_stride, int64_t heads,
               int64_t dim, const int64_t* positions, const float* cos, const float* sin,
               int threads) {
    if (dtype == 0)
        rope(static_cast<float*>(qkv), rows, row_stride, heads, dim, positions, cos, sin,
             threads);
    else
        rope(static_cast<uint16_t*>(qkv), rows, row_stride, heads, dim, positions, cos, sin,
             threads);
}

// weir_rope on q and k, then weir_write_kv (or weir_write_kv_fp8) of k and v, in one
// pass: heads q heads then kv_heads k and kv_heads v heads of head_dim `dim` per qkv row
// (row_stride elements apart); the caches [slots, kv_heads, dim] of dtype's type or
// kv_dtype 2 fp8 E4M3, 3 fp8 E5M2; slot -1 writes nothing. Returns 0, or -1 for a pair
// of types it does not convert.
int weir_rope_write_kv(int dtype, int kv_dtype, void* qkv, int64_t rows, int64_t row_stride,
                       int64_t heads, int64_t kv_heads, int64_t dim, const int64_t* positions,
                       const float* cos, const float* sin, void* k_cache, void* v_cache,
                       const int64_t* slots, int threads) {
    auto run = [&](auto tp, auto cp) {
        using T = std::remove_pointer_t<decltype(tp)>;
        using C = std::remove_pointer_t<decltype(cp)>;
        rope_write_kv(static_cast<T*>(qkv), rows, row_stride, heads, kv_heads, dim, positions,
                      cos, sin, static_cast<C*>(k_cache), static_cast<C*>(v_cache), slots,
                      threads);
        return 0;
    };
    using E4 = weir::fp8_e4m3*;
    using E5 = weir::fp8_e5m2*;
    if (dtype == 0) {
        if (kv_dtype == 0) return run(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
        if (kv_dtype == 2) return run(static_cast<float*>(nullptr), E4{});
        if (kv_dtype == 3) return run(static_cast<float*>(nullptr), E5{});
    } else if (dtype == 1) {
        if (kv_dtype == 1)
            return run(static_cast<uint16_t*>(nullptr), static_cast<uint16_t*>(nullptr));
        if (kv_dtype == 2) return run(static_cast<uint16_t*>(nullptr), E4{});
        if (kv_dtype == 3) return run(static_cast<uint16_t*>(nullptr), E5{});
    }
    return -1;
}

void weir_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter,
                   int threads) {
    if (dtype == 0)
        silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter,
                 threads);
    else
        silu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows,
                 inter, threads);
}

}
