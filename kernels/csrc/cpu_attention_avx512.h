// Part of cpu_decode_attention.cpp, included there after its shared helpers (row
// pointers, prefetch) and before the entry points: the AVX-512 tiled kernel.
// Not a standalone header: it is compiled only as that file's part, once per build part
// (WEIR_ATTN_PART).
#pragma once

// ---- The AVX-512 tiled kernel ------------------------------------------------------------
// A work item is a tile of up to kTile consecutive rows of one sequence (a prefill chunk's
// neighbouring positions; a decode row alone) against all its kv heads, so each key and
// value row — all heads, contiguous — is read from memory once for kTile x H queries.
// Scores: 16 keys at a time, each q.k a vector of partial sums (bf16 pairs by vdpbf16ps
// where the CPU has it), then one transpose-reduce turns the 16 vectors into the 16 scores
// instead of a horizontal sum per dot product.
#if defined(__AVX512F__)

namespace {

constexpr int kChunk = 16;     // keys per pass step

// out lane j = sum of the lanes of v[j]
inline __m512 hsum16(const __m512* v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                    _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                    _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// Partial sums (16 lanes) of the dot product of q and k, D elements.
template <int D> inline __m512 dot_partial(const float* q, const float* k) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
    for (int d = 16; d < D; d += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
    return acc;
}
using weir::load16;
template <int D> inline __m512 dot_partial(const uint16_t* q, const uint16_t* k) {
#if defined(__AVX512BF16__)
    __m512 acc = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d),
                               (__m512bh)_mm512_loadu_si512(k + d));
    return acc;
#else
    __m512 acc = _mm512_mul_ps(load16(q), load16(k));
    for (int d = 16; d < D; d += 16) acc = _mm512_fmadd_ps(load16(q + d), load16(k + d), acc);
    return acc;
#endif
}
// A value row as D / 16 float vectors. bf16: each 32-element load split into its even and
// odd elements (a shift and a mask, where widening 16 at a time costs a load, a widen and
// a shift each), so the accumulators hold elements in the order 0, 2, .., 30, 1, 3, .., 31
// of each 32; store_row puts them back in order.
template <int D> inline void value_row(const float* p, __m512* v) {
    for (int c = 0; c < D / 16; ++c) v[c] = _mm512_loadu_ps(p + c * 16);
}
template <int D> inline void value_row(const uint16_t* p, __m512* v) {
    for (int c = 0; c < D / 32; ++c) {
        const __m512i x = _mm512_loadu_si512(p + c * 32);
        v[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        v[2 * c + 1] = _mm512_castsi512_ps(
            _mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    }
}
template <int D> inline void store_row(float* o, const float* acc, float inv) {
    const __m512 s = _mm512_set1_ps(inv);
    for (int c = 0; c < D / 16; ++c)
        _mm512_storeu_ps(o + c * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16), s));
}
template <int D> inline void store_row(uint16_t* o, const float* acc, float inv) {
    const __m512 s = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                         15, 31);
    for (int c = 0; c < D / 32; ++c) {
        const __m512 even = _mm512_mul_ps(_mm512_loadu_ps(acc + c * 32), s);
        const __m512 odd = _mm512_mul_ps(_mm512_loadu_ps(acc + c * 32 + 16), s);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c * 32),
                            weir::bf16_16(_mm512_permutex2var_ps(even, lo, odd)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c * 32 + 16),
                            weir::bf16_16(_mm512_permutex2var_ps(even, hi, odd)));
    }
}

// A chunk's key or value rows as the kernel's element type: fp32 and bf16 rows are read in
// place; fp8 rows (kv.dtype fp8_*) are widened into `stage` (rows `width` elements apart)
// once per chunk, then every head and query of the tile reads them as bf16 (or fp32) rows.
template <typename T>
inline void as_rows(const T* const* raw, int nk, int64_t, T*, const T** rows) {
    for (int j = 0; j < nk; ++j) rows[j] = raw[j];
}
template <typename F> inline void widen_row(const F* src, int64_t n, uint16_t* dst) {
    for (int64_t d = 0; d < n; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), weir::fp8_bf16_16(src + d));
}
template <typename F> inline void widen_row(const F* src, int64_t n, float* dst) {
    for (int64_t d = 0; d < n; d += 16) _mm512_storeu_ps(dst + d, weir::load16(src + d));
}
#if defined(__AVX512BF16__)
// for the bf16 dot products: weir::fp8_scaled_bf16_32 (the kernel rescales)
template <typename F> inline void widen_row_scaled(const F* src, int64_t n, uint16_t* dst) {
    for (int64_t d = 0; d < n; d += 32)
        _mm512_storeu_si512(dst + d, weir::fp8_scaled_bf16_32(src + d));
}
#endif
template <bool Scaled, typename T, typename F, std::enable_if_t<weir::is_fp8<F>, int> = 0>
inline void as_rows(const F* const* raw, int nk, int64_t width, T* stage, const T** rows) {
    for (int j = 0; j < nk; ++j) {
#if defined(__AVX512BF16__)
        if constexpr (Scaled) widen_row_scaled(raw[j], width, stage + j * width);
        else
#endif
        widen_row(raw[j], width, stage + j * width);
        rows[j] = stage + j * width;
    }
}
template <bool Scaled, typename T>
inline void as_rows(const T* const* raw, int nk, int64_t width, T* stage, const T** rows) {
    as_rows(raw, nk, width, stage, rows);
}

// P.V by vdpbf16ps (CPUs with AVX512-BF16, bf16 caches): the probabilities rounded to bf16
// (as Hugging Face's eager attention rounds its softmax to the model's dtype before P.V) and
// taken two keys at a time, so one vdpbf16ps adds p0 v0 + p1 v1 for 16 elements: the value
// rows of keys j and j + 1 interleaved by vpunpck{l,h}wd, (p0, p1) broadcast as one dword.
// The accumulators hold elements in unpack order: of each 32, `lo` holds 0-3, 8-11, 16-19,
// 24-27 and `hi` 4-7, 12-15, 20-23, 28-31; store_pairs puts them back in order.
#if defined(__AVX512BF16__)
constexpr bool kPairedPV = true;
template <int D> inline void value_pair(const uint16_t* p0, const uint16_t* p1, __m512i* v) {
    for (int c = 0; c < D / 32; ++c) {
        const __m512i x0 = _mm512_loadu_si512(p0 + c * 32), x1 = _mm512_loadu_si512(p1 + c * 32);
        v[2 * c] = _mm512_unpacklo_epi16(x0, x1);
        v[2 * c + 1] = _mm512_unpackhi_epi16(x0, x1);
    }
}
template <int D> inline void store_pairs(uint16_t* o, const float* acc) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                             30, 31);
    for (int c = 0; c < D / 32; ++c) {
        const __m512 lo = _mm512_loadu_ps(acc + c * 32), hi = _mm512_loadu_ps(acc + c * 32 + 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c * 32),
                            weir::bf16_16(_mm512_permutex2var_ps(lo, first, hi)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c * 32 + 16),
                            weir::bf16_16(_mm512_permutex2var_ps(lo, second, hi)));
    }
}
#else
constexpr bool kPairedPV = false;
#endif

// One tile of nrows rows (positions consecutive, lens[r] keys each, increasing) against
// every kv head of its sequence: query (h, r, g) is qi = (h * nrows + r) * G + g.
// scores: [kv_heads * kTile * G][lpad]; acc: [kv_heads * kTile * G][D].
template <typename T, typename KT, int D, int G>
void attend_tile(const T* q, const KT* k_cache, const KT* v_cache, T* out, int64_t row0,
                 int nrows, const int32_t* lens, int64_t kv_heads, const int32_t* table,
                 int64_t heads, int64_t q_row, int64_t block_size, float scale,
                 float* scores, int64_t lpad, float* acc, uint16_t* probs, T* stage) {
    // probs: [kv_heads * kTile * G][lpad] bf16, used by the paired P.V (bf16 caches);
    // stage: [16][kv_heads * D], an fp8 cache's chunk widened (as_rows)
    constexpr bool paired = kPairedPV && sizeof(T) == 2;
    // an fp8 cache on the bf16 dot products: its rows staged scaled by 2^-S, which the
    // scores' scale and the probabilities undo (weir::fp8_scaled_bf16_32)
    constexpr bool scaled = paired && weir::is_fp8<KT>;
    constexpr float rescale = scaled ? weir::fp8_rescale<KT> : 1.0f;
    const float score_scale = scale * rescale;
    const int64_t L = lens[nrows - 1];
    const int64_t row_stride = kv_heads * D;
    const int nq = static_cast<int>(kv_heads) * nrows * G;
    auto qp = [&](int64_t h, int r, int g) { return q + (row0 + r) * q_row + (h * G + g) * D; };
    const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const T* kp[16];
    const KT* raw[16];
    int64_t blk = 0, off = 0;
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int nk = L - t0 < 16 ? static_cast<int>(L - t0) : 16;
        chunk_rows(k_cache, table, block_size, row_stride, blk, off, nk, raw);
        as_rows<scaled>(raw, nk, row_stride, stage, kp);
        // into L2 while this chunk computes: the next chunk's keys, this chunk's values (for
        // the second pass). Measured (batch 64 x 160 keys, 30 layers, bf16): 0.65 ms/layer
        // without, 0.63 with keys to L1, 0.49 with both to L2
        prefetch_rows<_MM_HINT_T1>(k_cache, table, block_size, row_stride, t0 + 16, 16, L);
        prefetch_rows<_MM_HINT_T1>(v_cache, table, block_size, row_stride, t0, 16, L);
        for (int r = 0; r < nrows; ++r) {
            if (t0 >= lens[r]) continue;
            const __mmask16 live = _mm512_cmp_ps_mask(
                lane, _mm512_set1_ps(static_cast<float>(lens[r] - t0)), _CMP_LT_OQ);
            for (int64_t h = 0; h < kv_heads; ++h)
                for (int g = 0; g < G; ++g) {
                    const T* qq = qp(h, r, g);
                    __m512 v[16];
                    for (int j = 0; j < 16; ++j)
                        v[j] = j < nk ? dot_partial<D>(qq, kp[j] + h * D) : _mm512_setzero_ps();
                    const __m512 s = _mm512_mul_ps(hsum16(v), _mm512_set1_ps(score_scale));
                    _mm512_storeu_ps(scores + ((h * nrows + r) * G + g) * lpad + t0,
                                     _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), s));
                }
        }
    }
    // softmax per query over its own keys, 16 at a time: pass 1 wrote every lane of each
    // 16-key chunk up to the query's length (-inf past it), so a chunk is read whole and
    // only the last one's tail is masked out of the sum
    float inv[64 * kTile];                 // kv_heads * G <= 64 (heads <= 64)
    for (int qi = 0; qi < nq; ++qi) {
        float* s = scores + qi * lpad;
        const int64_t len = lens[(qi / G) % nrows];
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < len; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t += 16) {
            const __mmask16 live = len - t >= 16 ? 0xffff : (1u << (len - t)) - 1;
            const __m512 e = _mm512_maskz_mov_ps(live, weir::exp16(
                _mm512_sub_ps(_mm512_loadu_ps(s + t), m)));
            _mm512_storeu_ps(s + t, e);
            sum = _mm512_add_ps(sum, e);
        }
        inv[qi] = 1.0f / _mm512_reduce_add_ps(sum);
        for (int d = 0; d < D; ++d) acc[qi * D + d] = 0.0f;
#if defined(__AVX512BF16__)
        if constexpr (paired) {           // normalized, then rounded (the tail lanes are 0)
            const __m512 scale_by = _mm512_set1_ps(inv[qi] * rescale);
            for (int64_t t = 0; t < len; t += 16)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + qi * lpad + t),
                                    weir::bf16_16(_mm512_mul_ps(_mm512_loadu_ps(s + t), scale_by)));
            inv[qi] = 1.0f;
        }
#endif
    }
    // values, 16 keys at a time: each head's value row widened in registers and added
    // into register accumulators for SG queries (same head and row) at a time
    constexpr int C = D / 16;
    constexpr int SG = G * C <= 24 ? G : (G % 2 == 0 && (G / 2) * C <= 24 ? G / 2 : 1);
    blk = 0, off = 0;
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int nk = L - t0 < 16 ? static_cast<int>(L - t0) : 16;
        chunk_rows(v_cache, table, block_size, row_stride, blk, off, nk, raw);
        as_rows<scaled>(raw, nk, row_stride, stage, kp);
        for (int64_t h = 0; h < kv_heads; ++h)
            for (int r = 0; r < nrows; ++r) {
                if (t0 >= lens[r]) continue;
                const int kn = lens[r] - t0 < nk ? static_cast<int>(lens[r] - t0) : nk;
                for (int g0 = 0; g0 < G; g0 += SG) {
                    const int q0 = static_cast<int>((h * nrows + r) * G + g0);
                    __m512 a[SG][C];
                    for (int g = 0; g < SG; ++g)
                        for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + (q0 + g) * D + c * 16);
#if defined(__AVX512BF16__)
                    if constexpr (paired) {
                        // pairs of keys; an odd last key pairs with itself at probability 0
                        // (its neighbour's lane of probs is a masked 0, or past the chunk)
                        for (int j = 0; j < kn; j += 2) {
                            __m512i vv[C];
                            const T* v0 = kp[j] + h * D;
                            value_pair<D>(reinterpret_cast<const uint16_t*>(v0),
                                          reinterpret_cast<const uint16_t*>(
                                              j + 1 < nk ? kp[j + 1] + h * D : v0), vv);
                            for (int g = 0; g < SG; ++g) {
                                int32_t pair;
                                __builtin_memcpy(&pair, probs + (q0 + g) * lpad + t0 + j, 4);
                                const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
                                for (int c = 0; c < C; ++c)
                                    a[g][c] = _mm512_dpbf16_ps(a[g][c], p, (__m512bh)vv[c]);
                            }
                        }
                    } else
#endif
                    for (int j = 0; j < kn; ++j) {
                        __m512 vv[C];
                        value_row<D>(kp[j] + h * D, vv);
                        for (int g = 0; g < SG; ++g) {
                            const __m512 p = _mm512_set1_ps(scores[(q0 + g) * lpad + t0 + j]);
                            for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(p, vv[c], a[g][c]);
                        }
                    }
                    for (int g = 0; g < SG; ++g)
                        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (q0 + g) * D + c * 16, a[g][c]);
                }
            }
    }
    for (int qi = 0; qi < nq; ++qi) {
        const int64_t h = qi / G / nrows, r = (qi / G) % nrows, g = qi % G;
        T* o = out + ((row0 + r) * heads + h * G + g) * D;
#if defined(__AVX512BF16__)
        if constexpr (paired) {
            store_pairs<D>(reinterpret_cast<uint16_t*>(o), acc + qi * D);
            continue;
        }
#endif
        store_row<D>(o, acc + qi * D, inv[qi]);
    }
}


#if defined(__AVX512BF16__)
#define WEIR_FLASH 1
// ---- The prompt kernels' shared parts (this vector kernel and the AMX one) -------------
// 16 x 16 dwords: dst[j][i] = src[i][j] (dst's rows 64 bytes apart, src's ``stride`` dwords;
// in place where they are the same)
inline void transpose16(const uint32_t* src, uint32_t* dst, int64_t stride = 16) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * stride);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // r[4b + k] holds, in each 128-bit lane l, column 4l + k of rows 4b .. 4b + 3
    for (int b = 0; b < 4; ++b)
        for (int k = 0; k < 4; ++k) t[4 * b + k] = r[4 * b + k];
    for (int k = 0; k < 4; ++k) {
        // lanes: rows 0-3, 4-7, 8-11, 12-15 of columns 4l + k
        const __m512i a = _mm512_shuffle_i32x4(t[k], t[4 + k], 0x44);       // b0 l0 l1, b1 l0 l1
        const __m512i b = _mm512_shuffle_i32x4(t[k], t[4 + k], 0xEE);       // b0 l2 l3, b1 l2 l3
        const __m512i c = _mm512_shuffle_i32x4(t[8 + k], t[12 + k], 0x44);
        const __m512i d = _mm512_shuffle_i32x4(t[8 + k], t[12 + k], 0xEE);
        _mm512_storeu_si512(dst + (0 + k) * 16, _mm512_shuffle_i32x4(a, c, 0x88));   // lane 0
        _mm512_storeu_si512(dst + (4 + k) * 16, _mm512_shuffle_i32x4(a, c, 0xDD));   // lane 1
        _mm512_storeu_si512(dst + (8 + k) * 16, _mm512_shuffle_i32x4(b, d, 0x88));   // lane 2
        _mm512_storeu_si512(dst + (12 + k) * 16, _mm512_shuffle_i32x4(b, d, 0xDD));  // lane 3
    }
}

#ifndef WEIR_FLASH_KEYS
#define WEIR_FLASH_KEYS 32
#endif
constexpr int kFlashKeys = WEIR_FLASH_KEYS;  // keys a block: 32, 64 and 128 measured
// 6.1, 6.9 and 7.7 ms for a 2,048-token prompt's layer (2 AMX Xeon cores), 18.8, 18.4, 20.8 for
// 2,048 after 2,048

// a run's values for kv head h as P.V's pairs (the AMX kernel's B tiles): for each 32 keys, D / 16 tiles of 16 key
// pairs x 16 dims (dword j: key 2j's element low, 2j + 1's high; keys past len zeros). With
// kHalves (the vector kernel, whose probabilities come a key a lane) pair j is keys j and
// j + 16 of the 32 instead.
template <int D, bool kHalves = false>
void pack_values(const uint16_t* v_cache, const int32_t* table, int64_t block_size,
                 int64_t row_stride, int64_t h, int64_t len, uint32_t* dst) {
    constexpr int64_t kNext = kHalves ? 16 : 1;     // the pair's second key, after its first
    for (int64_t t0 = 0; t0 < len; t0 += 32)
        for (int dt = 0; dt < D / 16; ++dt) {
            uint32_t* tile = dst + ((t0 / 32) * (D / 16) + dt) * 256;
            for (int j = 0; j < 16; ++j) {
                const int64_t t = t0 + (kHalves ? j : 2 * j);
                __m512i x0 = _mm512_setzero_si512(), x1 = _mm512_setzero_si512();
                if (t < len) {
                    const uint16_t* v0 = v_cache + weir::slot_of(table, block_size, t) * row_stride
                                         + h * D + dt * 16;
                    x0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0)));
                }
                if (t + kNext < len)
                    x1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                        v_cache + weir::slot_of(table, block_size, t + kNext) * row_stride + h * D
                        + dt * 16)));
                _mm512_store_si512(tile + j * 16, _mm512_or_si512(x0, _mm512_slli_epi32(x1, 16)));
            }
        }
}


// a run's keys for kv head h as q.k's pairs, transposed: for each 16 keys, [D / 2 d pairs]
// [16 keys] dwords (keys past len zeros), so one vdpbf16ps with a query's d pair broadcast
// adds that pair to 16 keys' scores
template <int D>
void pack_keys_t(const uint16_t* k_cache, const int32_t* table, int64_t block_size,
                 int64_t row_stride, int64_t h, int64_t len, uint32_t* dst) {
    alignas(64) uint32_t rows[16 * (D / 2)];
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        for (int j = 0; j < 16; ++j) {
            if (t0 + j < len)
                std::memcpy(rows + j * (D / 2), k_cache + weir::slot_of(table, block_size, t0 + j)
                            * row_stride + h * D, D * 2);
            else
                std::memset(rows + j * (D / 2), 0, D * 2);
        }
        for (int c = 0; c < D / 32; ++c) transpose16(rows + c * 16, dst + (t0 / 16) * (D / 2) * 16 + c * 256, D / 2);
    }
}

// 2^x for the prompt kernels' probabilities (AMX and vector), which go to bf16 next: f = x - floor(x) by one
// vreduceps, 2^f by a degree-3 fit on [0, 1) (7.5e-5 relative, against bf16's 2^-8 step),
// times 2^floor(x) by vscalefps (which floors x itself): 6 vector ops, 7 with the argument's
// fmsub, against 17 for exp16 (the degree-6 fit before it, 8.4e-8 and 9 ops, spent an fp32
// exp's precision on values kept to 8 bits). The fit is scaled by 1 + 2^-9 because the caller
// truncates to bf16 (keeps the high half of the bits: one shift and one vpternlogd make a pair
// row of two keys, where vcvtne2ps2bf16 and a vpermw took three uops), so the kept value is
// within -0.75 .. +0.5 of a bf16 step of 2^x, as rounding's +-0.5; the row sums add those same
// bf16 values, so P.V / sum has no bias from it. Below -149 it is 0; +inf or NaN (a column's
// max still -inf) give NaN, which the caller checks.
inline __m512 exp2_bf16(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, 0x09);    // x - floor(x): round down, no precision
    constexpr float up = 1.0f + 1.0f / 512;      // truncated to bf16 next: see above
    __m512 p = _mm512_set1_ps(0.07802382856607437f * up);      // exception
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.22606651484966278f * up));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6958346366882324f * up));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999250173568726f * up));
    return _mm512_scalef_ps(p, x);
}

// lo and hi truncated to bf16 (exp2_bf16's values) and paired by lane: dword c is hi[c]'s
// fp32 bits' high half over lo[c]'s high half shifted down (vpternlogd: bits of the first
// operand where the mask is set, else the third's)
inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
    return _mm512_ternarylogic_epi32(_mm512_castps_si512(hi),
                                     _mm512_set1_epi32(static_cast<int>(0xffff0000u)),
                                     _mm512_srli_epi32(_mm512_castps_si512(lo), 16), 0xE2);
}

// The prompt kernel for CPUs with AVX512-BF16 and no AMX (Zen 4): flash attention by
// vdpbf16ps. The decode tiles (kTile rows against every key, the scores reduced by a
// transpose per 16 keys) ran a 2,048-token prompt at 0.05 TFLOP/s on one Xeon core, 7x
// slower than the tiles. Here a run's keys (transposed, ``pack_keys_t``) and values (in
// pairs of keys j and j + 16 of each 32, ``pack_values<D, true>``) are packed once per kv
// head; 4 query rows of one head go together over 32 keys a block: their scores are 8
// accumulators (a key per lane: 32 vdpbf16ps each, one key vector and one broadcast query
// pair), their outputs 16 (4 x 64 dims), and P.V broadcasts each row's probability pair
// against a value pair row. The softmax is the AMX kernel's: 2^x by exp2_bf16 (7 ops a score
// vector with its scale, against exp16's 17 and a multiply), the pairs cut by a shift and a
// vpternlogd (bf16_pairs), the sums by one vdpbf16ps of those same pairs, and a lazy max
// (kLazyRescale) looked at only where a lane's sum passes e^kLazyRescale; the output is
// normalized at the end. On 2
// Zen 4 cores, one layer, medians of 15 in 3 alternating rounds (scripts/run
// bench/prompt_attention): 2,048 fresh 16.8-18.1 -> 14.3-15.2 ms, 2,048 after 2,048
// 49.3-53.5 -> 41.8-43.1, 512 after 2,048 9.3-11.0 -> 8.2-8.9 (0.27-0.29 -> 0.32-0.35
// TFLOP/s; the bf16 GEMM's is 0.45).
template <int D>
void flash_rows_vec(const uint16_t* q, int64_t q_row, int64_t head, int64_t row0, int nq,
                    const int32_t* row_lens, const uint32_t* kt, const uint32_t* vp,
                    float scale, uint16_t* out, int64_t heads) {
    static_assert(D == 64, "the vector prompt kernel's output is four 16-dim vectors a row");
    constexpr int QG = 4;
    const uint32_t* qd[QG];
    float lenf[QG];
    for (int i = 0; i < QG; ++i) {
        const int r = std::min(i, nq - 1);              // a missing row repeats the last
        qd[i] = reinterpret_cast<const uint32_t*>(q + (row0 + r) * q_row + head * D);
        lenf[i] = static_cast<float>(row_lens[row0 + r]);
    }
    const int64_t L = row_lens[row0 + nq - 1];
    const int64_t full = row_lens[row0];
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 sc2 = _mm512_set1_ps(scale * weir::kLog2e);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512 lazy_sum = _mm512_set1_ps(std::exp(kLazyRescale));
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);    // bf16 1.0 pairs
    __m512 o[QG][4], l[QG];
    float m[QG];
    for (int i = 0; i < QG; ++i) {
        for (int c = 0; c < 4; ++c) o[i][c] = _mm512_setzero_ps();
        l[i] = _mm512_setzero_ps();
        m[i] = -INFINITY;
    }
    alignas(64) uint32_t pb[QG][16];
    for (int64_t t0 = 0; t0 < L; t0 += 32) {
        __m512 s[QG][2];
        for (int i = 0; i < QG; ++i) s[i][0] = s[i][1] = _mm512_setzero_ps();
        const uint32_t* k0 = kt + (t0 / 16) * (D / 2) * 16;
        const uint32_t* k1 = k0 + (D / 2) * 16;          // zeros past len (packed so)
        for (int p = 0; p < D / 2; ++p) {
            const __m512bh a0 = (__m512bh)_mm512_load_si512(k0 + p * 16);
            const __m512bh a1 = (__m512bh)_mm512_load_si512(k1 + p * 16);
            for (int i = 0; i < QG; ++i) {
                const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(qd[i][p]));
                s[i][0] = _mm512_dpbf16_ps(s[i][0], a0, b);
                s[i][1] = _mm512_dpbf16_ps(s[i][1], a1, b);
            }
        }
        const bool edge = t0 + 32 > full;
        for (int i = 0; i < QG; ++i) {
            __mmask16 live0 = 0xFFFF, live1 = 0xFFFF;
            if (edge) {                              // keys at or past the row's length
                const __m512 len = _mm512_set1_ps(lenf[i]);
                const __m512 t = _mm512_add_ps(iota, _mm512_set1_ps(static_cast<float>(t0)));
                live0 = _mm512_cmp_ps_mask(t, len, _CMP_LT_OQ);
                live1 = _mm512_cmp_ps_mask(_mm512_add_ps(t, _mm512_set1_ps(16.0f)), len,
                                           _CMP_LT_OQ);
            }
            // P at the max so far, as bf16 pairs (lane j: key j + 16's high half over key j's,
            // as pack_values' halves pair them) and their sum per lane from those same values
            __m512i pp;
            __m512 bs;
            auto probabilities = [&] {
                const __m512 m2 = _mm512_set1_ps(m[i] * weir::kLog2e);
                const __m512 e0 = _mm512_maskz_mov_ps(live0, exp2_bf16(_mm512_fmsub_ps(s[i][0], sc2, m2)));
                const __m512 e1 = _mm512_maskz_mov_ps(live1, exp2_bf16(_mm512_fmsub_ps(s[i][1], sc2, m2)));
                pp = bf16_pairs(e0, e1);
                bs = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)pp, ones);
            };
            probabilities();
            // the max is looked at only where a lane's sum passes e^kLazyRescale or is not a
            // number (m is -inf before the row's first block): no probability passes it
            // unnoticed, since each is at most its lane's sum
            if (_mm512_cmp_ps_mask(bs, lazy_sum, _CMP_NLE_UQ)) {
                const __m512 x = _mm512_max_ps(_mm512_mask_mov_ps(ninf, live0, s[i][0]),
                                               _mm512_mask_mov_ps(ninf, live1, s[i][1]));
                const float bm = _mm512_reduce_max_ps(x) * scale;
                if (bm > m[i] + kLazyRescale) {      // the row's max moves: rescale its sums
                    const __m512 alpha = m[i] == -INFINITY ? _mm512_setzero_ps()
                        : weir::exp16(_mm512_set1_ps(m[i] - bm));
                    for (int c = 0; c < 4; ++c) o[i][c] = _mm512_mul_ps(o[i][c], alpha);
                    l[i] = _mm512_mul_ps(l[i], alpha);
                    m[i] = bm;
                    probabilities();
                }
            }
            l[i] = _mm512_add_ps(l[i], bs);
            _mm512_store_si512(pb[i], pp);
        }
        const uint32_t* vt = vp + (t0 / 32) * (D / 16) * 256;
        // each value vector loaded once for the 4 rows (the 4 rows' probability pairs held
        // in registers): with all 4 value vectors held instead, 16 + 4 + 4 registers beside
        // the constants, the compiler loaded each value vector again for every row
        for (int j = 0; j < 16; ++j) {
            __m512bh b[QG];
            for (int i = 0; i < QG; ++i)
                b[i] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[i][j]));
            for (int c = 0; c < 4; ++c) {
                const __m512bh v = (__m512bh)_mm512_load_si512(vt + c * 256 + j * 16);
                for (int i = 0; i < QG; ++i) o[i][c] = _mm512_dpbf16_ps(o[i][c], v, b[i]);
            }
        }
    }
    for (int i = 0; i < nq; ++i) {
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[i]));
        uint16_t* dst = out + ((row0 + i) * heads + head) * D;
        for (int c = 0; c < 4; ++c)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 16),
                                weir::bf16_16(_mm512_mul_ps(o[i][c], inv)));
    }
}

// Where a run's packed keys and values lie in the call's buffer: values, then keys, per kv
// head (each kernel in its own layout, the same size)
template <int D> inline int64_t flash_span(int64_t len) { return (len + 31) / 32 * (D / 16) * 256; }

// The prompt kernels here: bf16 q and caches, D = 64; their buffer's words (dwords) for a
// run of len keys (both kernels pack keys and values)
template <typename T, typename KT, int D>
constexpr bool kFlashFits = D == 64 && sizeof(T) == 2 && std::is_same_v<KT, uint16_t>;
using FlashWord = uint32_t;
template <int D> inline int64_t flash_words(int64_t len, int64_t kv_heads, bool) {
    return 2 * kv_heads * flash_span<D>(len);
}

// the runs on the vector units: pack every run's keys and values per kv head, then the
// blocks (16 rows, one kv head, each 4 rows at a time), longest first
template <int D, int G>
void flash_runs_vec(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                    uint16_t* out, const std::vector<FlashRun>& runs, const int32_t* row_lens,
                    const int32_t* block_tables, int64_t table_width, int64_t heads,
                    int64_t q_row, int64_t kv_heads, int64_t block_size, float scale,
                    int num_threads, uint32_t* buf) {
    auto at = [&](const FlashRun& run, int64_t h, int which) {   // 0 values, 1 keys
        return buf + run.vpk + (2 * h + which) * flash_span<D>(run.len);
    };
    auto pack = [&](const FlashRun& run, int64_t h) {
        const int32_t* table = block_tables + run.seq * table_width;
        pack_values<D, true>(v_cache, table, block_size, kv_heads * D, h, run.len, at(run, h, 0));
        pack_keys_t<D>(k_cache, table, block_size, kv_heads * D, h, run.len, at(run, h, 1));
        // the keys past len up to a whole 32 are zeros: pack_keys_t wrote the last 16
        if ((run.len + 15) / 16 % 2 == 1)
            std::memset(at(run, h, 1) + (run.len + 15) / 16 * (D / 2) * 16, 0, D / 2 * 16 * 4);
    };
    auto block = [&](const FlashRun& run, const FlashItem& it) {
        const int64_t rows = std::min<int64_t>(16, run.n - it.b0);
        for (int g = 0; g < G; ++g)
            for (int64_t r = 0; r < rows; r += 4)
                flash_rows_vec<D>(q, q_row, it.h * G + g, run.i0 + it.b0 + r,
                                  static_cast<int>(std::min<int64_t>(4, rows - r)), row_lens,
                                  at(run, it.h, 1), at(run, it.h, 0), scale, out, heads);
    };
    flash_schedule(runs, row_lens, kv_heads, num_threads, pack, block);
}
#endif  // __AVX512BF16__

}  // namespace
#endif
