// Paged attention for the CPU, decode and prefill rows alike, read straight from the block
// table — no gather, no padded copy. Built at first use by kernels/cpu_native.py
// (g++ -O3 -march=native -fopenmp) and called through ctypes.
//
// Layout: q and out [T, H, D]; each layer's cache [num_blocks, block_size, KVH, D];
// block_tables [B, W] int32; row i attends the first row_lens[i] keys of its sequence
// (already written). Scores are kept for the whole context (two passes: scores + softmax,
// then values), in float32. exp is a branch-free polynomial that vectorizes. D and G = H/KVH
// are template constants (D 64/128, G 1..8) so the loops unroll into registers.
//
// Three kernels, one compiled in per CPU: the AVX-512 tiled one, the same tiles on AVX2
// (8 lanes), and a portable one per (row, kv head) for the rest. Measured with bf16,
// SmolLM2 shapes, 30 layers' caches (so the keys come from memory, not cache), ms/layer:
//                                  2 Zen 4 cores          2 AVX2-only EPYC cores
//   decode, batch 64 x 160 keys:   portable 1.17, tiled 0.48   portable 1.99, AVX2 1.09
//   prefill, 4 x 128 new tokens:   portable 1.48, tiled 0.65   portable 3.34, AVX2 1.62
//   prefill, 2 x 256 after 1000:   portable 24.1, tiled 9.2    portable 37.9, AVX2 22.3
// With P.V by vdpbf16ps (bf16 probabilities, below), the same 2 Zen 4 cores, 30 layers, A/B in
// one process: decode 64 x 160 cold 0.97-0.99x, hot (one layer's cache) 0.85-0.94x; prefill
// 4 x 128 0.89x, 2 x 256 after 1000 0.90x.
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_fp8.h"

// The build compiles this file three times, in parallel (kernels/cpu_native.py), each part
// instantiating one family of caches: 1 the model's own dtype (and everything that is not
// a kernel instantiation: the KV writes, the entry point, the AMX probe), 2 fp8 E4M3, 3 fp8
// E5M2. Unset: all of them in one object.
#ifndef WEIR_ATTN_PART
#define WEIR_ATTN_PART 0
#endif
#define WEIR_PART(n) (WEIR_ATTN_PART == 0 || WEIR_ATTN_PART == (n))

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define WEIR_TILED 1

namespace {

constexpr int kTile = 8;       // rows per work item

// Row pointers of keys t0 .. t0 + nk - 1 (all kv heads: one contiguous row each), walking
// the block table with (blk, off).
template <typename T>
inline void chunk_rows(const T* cache, const int32_t* table, int64_t block_size,
                       int64_t row_stride, int64_t& blk, int64_t& off, int nk, const T** rows) {
    for (int j = 0; j < nk; ++j) {
        rows[j] = cache + (static_cast<int64_t>(table[blk]) * block_size + off) * row_stride;
        if (++off == block_size) { off = 0; ++blk; }
    }
}

// Prefetch rows [t, t + n) (clipped to len) of a cache into cache level Hint.
template <int Hint, typename T>
inline void prefetch_rows(const T* cache, const int32_t* table, int64_t block_size,
                          int64_t row_stride, int64_t t, int64_t n, int64_t len) {
    const int64_t bytes = row_stride * static_cast<int64_t>(sizeof(T));
    for (int64_t u = t; u < t + n && u < len; ++u) {
        const char* p = reinterpret_cast<const char*>(
            cache + (static_cast<int64_t>(table[u / block_size]) * block_size + u % block_size)
                    * row_stride);
        for (int64_t x = 0; x < bytes; x += 64) _mm_prefetch(p + x, static_cast<_mm_hint>(Hint));
    }
}

}  // namespace
#endif

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

}  // namespace
#endif

// ---- The AMX kernel (bf16 caches, CPUs with AMX tiles) -----------------------------------
// q.k on the tile unit: a chunk of 16 keys is an A tile read straight from the cache (16
// rows, 32 bf16 each: a kv head's slice of each key row, the rows a key row apart), and
// the tile's queries are B tiles packed once per tile: 16 columns, each a query (row r,
// kv head h, group member g) holding its d pairs, zero outside its own head. So one
// tdpbf16ps gives 16 keys x 16 queries; the queries of several kv heads share the columns
// when they fit (SmolLM2 decode: 3 heads x 3 = 9 columns, 6 A tiles per chunk). The scores
// land as [key][query] (a key per vector), where the softmax is one vector op per key for
// all the tile's queries; the probabilities, normalized and rounded to bf16 as the AVX-512
// kernel rounds them, are stored as pairs of neighbouring keys per query (one dword), which
// transposed are P.V's A tile (below). A tile holds at most 16 / G rows (16 columns).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define WEIR_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

namespace {

using weir::amx_configure;
// Tiles (weir::amx_configure: each 16 rows x 64 bytes). q.k: tmm0 the scores (16 keys x 16
// queries, fp32), tmm1 the keys (16 x 32 bf16), tmm2 .. tmm7 the queries. P.V: tmm1 the
// probabilities (16 queries x 32 keys), tmm2 the values (16 key pairs x 16 dims), tmm3-6
// the outputs (16 queries x 64 dims)

// 16 x 16 dwords: dst[j][i] = src[i][j] (rows 64 bytes apart)
inline void transpose16(const uint32_t* src, uint32_t* dst) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * 16);
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

// Prefetch the 16 rows [t, t + 16) (clipped to len) of a cache into cache level Hint, t a
// multiple of 16 and block_size of 16 (the AMX kernel's chunks): one block, one run of bytes.
// With weir::slot_of for the kernel's row addresses, in place of a 64-bit divide per row:
// 30 layers, 2 Xeon (AMX) cores, A/B alternating: prefill 4 x 128 6.7-7.1 -> 6.1-6.2 ms,
// 2 x 256 after 1000 87 -> 76-80 ms; decode 64 x 160 unchanged at ~15.4 (its keys come from
// memory: see NextTile).
template <int Hint, typename T>
inline void prefetch_block_rows(const T* cache, const int32_t* table, int64_t block_size,
                                int64_t row_stride, int64_t t, int64_t len) {
    if (t >= len) return;
    const char* p = reinterpret_cast<const char*>(cache + weir::slot_of(table, block_size, t)
                                                  * row_stride);
    const int64_t bytes = std::min<int64_t>(16, len - t) * row_stride * static_cast<int64_t>(sizeof(T));
    for (int64_t x = 0; x < bytes; x += 64) _mm_prefetch(p + x, static_cast<_mm_hint>(Hint));
}

// The next tile's keys and values, prefetched to L2 a few lines at a time while this tile
// computes (spread over its key chunks and value pairs), so one tile's reads overlap the
// tile unit's work on the one before; a decode tile's own chunk-ahead prefetch is too
// short a distance to hide DRAM latency. Blocks alternate keys and values; lines() issues
// up to n more prefetches. 2 AMX Xeon cores, decode 64 x 160, 30 layers' caches, the two
// builds A/B in one process: 13.8 -> 11.7 ms (scattered blocks: 13.8 -> 11.9); with every
// sequence on the same blocks (all in L2) 3.5 -> 5.1 ms, the prefetches' own cost. A
// sparser stream (every 2nd-16th line, for the L2 streamer to fill in) was slower than
// none (14.6 ms): the hardware prefetcher does not follow blocks this size.
struct NextTile {
    const char* k = nullptr;
    const char* v = nullptr;
    const int32_t* table = nullptr;
    int64_t block_size = 16, row_bytes = 0, len = 0;
    int64_t block = 0, off = 0;       // cursor: block index (2j keys, 2j + 1 values), byte
    void lines(int n) {
        while (n > 0 && block / 2 * block_size < len) {
            const int64_t j = block / 2;
            const int64_t bytes = std::min<int64_t>(block_size, len - j * block_size) * row_bytes;
            const char* base = (block % 2 == 0 ? k : v)
                               + static_cast<int64_t>(table[j]) * block_size * row_bytes;
            for (; off < bytes && n > 0; off += 64, --n) _mm_prefetch(base + off, _MM_HINT_T1);
            if (off >= bytes) { off = 0; ++block; }
        }
    }
    int64_t total_lines() const {
        return len <= 0 ? 0 : 2 * ((len * row_bytes + 63) / 64 + (len + block_size - 1) / block_size);
    }
};

// The query tiles held in tmm2 .. tmm7 (tile numbers are immediates: one case each).
inline void load_query_tile(int i, const uint32_t* p) {
    switch (i) {
        case 0: _tile_loadd(2, p, 64); break;
        case 1: _tile_loadd(3, p, 64); break;
        case 2: _tile_loadd(4, p, 64); break;
        case 3: _tile_loadd(5, p, 64); break;
        case 4: _tile_loadd(6, p, 64); break;
        default: _tile_loadd(7, p, 64); break;
    }
}
// tmm0 += the keys in tmm1 . query tile i
inline void dot_query_tile(int i) {
    switch (i) {
        case 0: _tile_dpbf16ps(0, 1, 2); break;
        case 1: _tile_dpbf16ps(0, 1, 3); break;
        case 2: _tile_dpbf16ps(0, 1, 4); break;
        case 3: _tile_dpbf16ps(0, 1, 5); break;
        case 4: _tile_dpbf16ps(0, 1, 6); break;
        default: _tile_dpbf16ps(0, 1, 7); break;
    }
}

// 32 value elements as bf16: in place, or an fp8 cache's widened in registers
inline __m512i bf16_32(const uint16_t* p) { return _mm512_loadu_si512(p); }
template <typename F, std::enable_if_t<weir::is_fp8<F>, int> = 0>
inline __m512i bf16_32(const F* p) { return weir::fp8_scaled_bf16_32(p); }

// P.V of a decode tile (one row: G queries per kv head) by vdpbf16ps from the value rows
// in registers: two keys' rows interleaved (vpunpck{l,h}wd, as value_pair), each query's
// probability pair broadcast. The tile unit's form (in attend_tile_amx) writes the
// interleaved rows out and loads them back as B tiles, and multiplies 16 query rows where
// a decode tile has G. 2 AMX Xeon cores, decode 64 x 160, 30 layers' caches, A/B in one
// process, medians of 20: 13.41 -> 12.99 ms (scattered blocks 14.31 -> 13.93; every
// sequence on one L2-resident block set 5.82 -> 5.42). pairs: [L2 / 2][16], not
// transposed; out: the row's output, heads h0 .. h0 + nh - 1.
template <int D, int G, typename KT>
inline void decode_pv(const KT* v_cache, const int32_t* table, int64_t block_size,
                      int64_t row_stride, int64_t h0, int nh, int64_t L, const uint32_t* pairs,
                      uint16_t* out, NextTile& next, int per_spot) {
    for (int hl = 0; hl < nh; ++hl) {
        __m512 acc[G][D / 16];
        for (int g = 0; g < G; ++g)
            for (int i = 0; i < D / 16; ++i) acc[g][i] = _mm512_setzero_ps();
        for (int64_t t = 0; t < L; t += 2) {
            next.lines(per_spot);
            const KT* v0 = v_cache + weir::slot_of(table, block_size, t) * row_stride + (h0 + hl) * D;
            const bool two = t + 1 < L;
            __m512i p[G];
            for (int g = 0; g < G; ++g) p[g] = _mm512_set1_epi32(static_cast<int>(pairs[t / 2 * 16 + hl * G + g]));
            for (int c = 0; c < D / 32; ++c) {
                const __m512i x0 = bf16_32(v0 + c * 32);
                const __m512i x1 = two ? bf16_32(v0 + row_stride + c * 32) : _mm512_setzero_si512();
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
                const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
                for (int g = 0; g < G; ++g) {
                    acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], lo, (__m512bh)p[g]);
                    acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], hi, (__m512bh)p[g]);
                }
            }
        }
        alignas(64) float buf[D];
        for (int g = 0; g < G; ++g) {
            for (int i = 0; i < D / 16; ++i) _mm512_store_ps(buf + i * 16, acc[g][i]);
            store_pairs<D>(out + ((h0 + hl) * G + g) * D, buf);
        }
    }
}

template <int D, int G, typename KT>
void attend_tile_amx(const uint16_t* q, const KT* k_cache, const KT* v_cache,
                     uint16_t* out, int64_t row0, int nrows, const int32_t* lens,
                     int64_t kv_heads, const int32_t* table, int64_t heads, int64_t q_row,
                     int64_t block_size, float scale, float* scores, int64_t lpad,
                     uint32_t* pairs, uint32_t* qb, NextTile& next, uint16_t* stage) {
    // scores: [lpad][16] fp32; pairs: [lpad / 2][16] bf16 pairs; qb: [hg * D / 32][16][16];
    // stage: [16][kv_heads * D] bf16, an fp8 cache's 16 key rows widened for the A tiles
    const int64_t L = lens[nrows - 1];
    const int64_t row_stride = kv_heads * D;               // elements between key rows
    const int cph = nrows * G;                             // columns per kv head
    const int64_t hg = std::min<int64_t>(kv_heads, 16 / cph);   // kv heads per pass
    constexpr int DT = D / 32;                             // A tiles per head slice
    const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t h0 = 0; h0 < kv_heads; h0 += hg) {
        const int nh = static_cast<int>(std::min(hg, kv_heads - h0));
        const int ncols = nh * cph;
        // column c = hl * cph + r * G + g; lenv: its row's key count (0: an unused column)
        alignas(64) float lenf[16];
        for (int c = 0; c < 16; ++c) lenf[c] = c < ncols ? static_cast<float>(lens[(c % cph) / G]) : 0.0f;
        const __m512 lenv = _mm512_load_ps(lenf);
        std::memset(qb, 0, static_cast<size_t>(nh) * DT * 1024);
        for (int hl = 0; hl < nh; ++hl)
            for (int r = 0; r < nrows; ++r)
                for (int g = 0; g < G; ++g) {
                    const int c = hl * cph + r * G + g;
                    const uint16_t* qq = q + (row0 + r) * q_row + ((h0 + hl) * G + g) * D;
                    for (int i = 0; i < DT; ++i)
                        for (int p = 0; p < 16; ++p)
                            std::memcpy(qb + ((hl * DT + i) * 16 + p) * 16 + c, qq + i * 32 + 2 * p, 4);
                }
        // the next tile's prefetches, spread over this group's key chunks, its softmax (every
        // 4th key of both passes: without them the line fill buffers drain there; decode
        // 64 x 160, 30 layers' caches, 2 AMX Xeon cores, A/B in one process, medians of
        // 25: 14.15 -> 13.61 ms) and its value pairs
        const int64_t L32 = (L + 31) / 32 * 32;
        const int64_t spots = (L + 15) / 16 + 2 * ((L + 3) / 4) + nh * (L32 / 2);
        const int per_spot = static_cast<int>((next.total_lines() + spots - 1) / spots);
        // scores, 16 keys (one block's rows: block_size is a multiple of 16) at a time; the
        // query tiles stay in tmm2.. when they fit (SmolLM2: 6), loaded once, not per chunk
        const int nqt = nh * DT;
        const bool resident = nqt <= 6;
        if (resident)
            for (int x = 0; x < nqt; ++x) load_query_tile(x, qb + x * 256);
        for (int64_t t0 = 0; t0 < L; t0 += 16) {
            const KT* kc = k_cache + weir::slot_of(table, block_size, t0) * row_stride + h0 * D;
            const uint16_t* kb;
            if constexpr (weir::is_fp8<KT>) {
                // the chunk's 16 rows (one block) widened once, this group's heads only
                for (int j = 0; j < 16; ++j)
                    for (int64_t d = 0; d < nh * D; d += 32)
                        _mm512_storeu_si512(stage + j * row_stride + d,
                                            bf16_32(kc + j * row_stride + d));
                kb = stage;
            } else {
                kb = kc;
            }
            if (h0 == 0) {          // the next chunk's keys to L1, this chunk's values to L2
                prefetch_block_rows<_MM_HINT_T0>(k_cache, table, block_size, row_stride, t0 + 16, L);
                prefetch_block_rows<_MM_HINT_T1>(v_cache, table, block_size, row_stride, t0, L);
            }
            next.lines(per_spot);
            _tile_zero(0);
            for (int hl = 0; hl < nh; ++hl)
                for (int i = 0; i < DT; ++i) {
                    _tile_loadd(1, kb + hl * D + i * 32, row_stride * 2);
                    if (resident) {
                        dot_query_tile(hl * DT + i);
                    } else {
                        _tile_loadd(2, qb + (hl * DT + i) * 256, 64);
                        _tile_dpbf16ps(0, 1, 2);
                    }
                }
            _tile_stored(0, scores + t0 * 16, 64);
        }
        // softmax per column over the keys (a key per vector); keys past a column's row
        // (and the chunk's tail past L) are masked out
        // (an fp8 cache's keys and values are read scaled by 2^-S: bf16_32)
        constexpr float rescale = weir::fp8_rescale<KT>;
        const __m512 sc = _mm512_set1_ps(scale * rescale);
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < L; ++t) {
            const __mmask16 live = _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(t)), lenv, _CMP_LT_OQ);
            m = _mm512_mask_max_ps(m, live, m, _mm512_mul_ps(_mm512_loadu_ps(scores + t * 16), sc));
            if ((t & 3) == 0) next.lines(per_spot);
        }
        __m512 sum = _mm512_setzero_ps();
        const int64_t L2 = (L + 1) / 2 * 2;
        for (int64_t t = 0; t < L2; ++t) {
            const __mmask16 live = _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(t)), lenv, _CMP_LT_OQ);
            const __m512 e = _mm512_maskz_mov_ps(live, weir::exp16(_mm512_fmsub_ps(
                _mm512_loadu_ps(scores + t * 16), sc, m)));
            _mm512_storeu_ps(scores + t * 16, e);
            if ((t & 3) == 0) next.lines(per_spot);
            sum = _mm512_add_ps(sum, e);
        }
        const __mmask16 any = _mm512_cmp_ps_mask(sum, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __m512 inv = _mm512_maskz_div_ps(any, _mm512_set1_ps(rescale), sum);
        for (int64_t t = 0; t < L2; t += 2) {
            const __m512i p0 = _mm512_cvtepu16_epi32(weir::bf16_16(
                _mm512_mul_ps(_mm512_loadu_ps(scores + t * 16), inv)));
            const __m512i p1 = _mm512_cvtepu16_epi32(weir::bf16_16(
                _mm512_mul_ps(_mm512_loadu_ps(scores + (t + 1) * 16), inv)));
            _mm512_storeu_si512(pairs + t / 2 * 16, _mm512_or_si512(p0, _mm512_slli_epi32(p1, 16)));
        }
        // P.V on the tiles: per 32 keys, the probabilities as an A tile (16 queries x 16 key
        // pairs: the pairs transposed, in place, once for every head) and each head's values
        // as B tiles, its rows key pairs interleaved (vpunpck{l,h}wd, as value_pair: the
        // output dims come out in that order, which store_pairs undoes); keys past L are
        // zeros, not read.
        if constexpr (G * D / 16 <= 24) {
            if (nrows == 1) {          // a decode tile
                decode_pv<D, G>(v_cache, table, block_size, row_stride, h0, nh, L, pairs,
                                out + row0 * heads * D, next, per_spot);
                continue;
            }
        }
        for (int64_t t = L2; t < L32; t += 2)
            _mm512_storeu_si512(pairs + t / 2 * 16, _mm512_setzero_si512());
        for (int64_t t0 = 0; t0 < L32; t0 += 32) transpose16(pairs + t0 / 2 * 16, pairs + t0 / 2 * 16);
        uint32_t* vb = qb;                       // [4][16 pairs][16 dims] (q is packed: free)
        float* ob = reinterpret_cast<float*>(qb + 1024);         // [16 queries][D]
        for (int hl = 0; hl < nh; ++hl) {
            for (int dh = 0; dh < D / 64; ++dh) {
                _tile_zero(3); _tile_zero(4); _tile_zero(5); _tile_zero(6);
                for (int64_t t0 = 0; t0 < L32; t0 += 32) {
                    for (int j = 0; j < 16; ++j) {
                        const int64_t t = t0 + 2 * j;
                        next.lines(per_spot);
                        __m512i x0a, x0b, x1a, x1b;
                        if (t < L) {
                            const KT* v0 = v_cache + weir::slot_of(table, block_size, t) * row_stride
                                           + (h0 + hl) * D + dh * 64;
                            x0a = bf16_32(v0);
                            x0b = bf16_32(v0 + 32);
                            if (t + 1 < L) {
                                x1a = bf16_32(v0 + row_stride);
                                x1b = bf16_32(v0 + row_stride + 32);
                            } else {
                                x1a = x1b = _mm512_setzero_si512();
                            }
                        } else {
                            x0a = x0b = x1a = x1b = _mm512_setzero_si512();
                        }
                        _mm512_store_si512(vb + (0 * 16 + j) * 16, _mm512_unpacklo_epi16(x0a, x1a));
                        _mm512_store_si512(vb + (1 * 16 + j) * 16, _mm512_unpackhi_epi16(x0a, x1a));
                        _mm512_store_si512(vb + (2 * 16 + j) * 16, _mm512_unpacklo_epi16(x0b, x1b));
                        _mm512_store_si512(vb + (3 * 16 + j) * 16, _mm512_unpackhi_epi16(x0b, x1b));
                    }
                    _tile_loadd(1, pairs + t0 / 2 * 16, 64);
                    _tile_loadd(2, vb + 0 * 256, 64);
                    _tile_dpbf16ps(3, 1, 2);
                    _tile_loadd(2, vb + 1 * 256, 64);
                    _tile_dpbf16ps(4, 1, 2);
                    _tile_loadd(2, vb + 2 * 256, 64);
                    _tile_dpbf16ps(5, 1, 2);
                    _tile_loadd(2, vb + 3 * 256, 64);
                    _tile_dpbf16ps(6, 1, 2);
                }
                _tile_stored(3, ob + dh * 64 + 0, D * 4);
                _tile_stored(4, ob + dh * 64 + 16, D * 4);
                _tile_stored(5, ob + dh * 64 + 32, D * 4);
                _tile_stored(6, ob + dh * 64 + 48, D * 4);
            }
            for (int r = 0; r < nrows; ++r)
                for (int g = 0; g < G; ++g)
                    store_pairs<D>(out + ((row0 + r) * heads + (h0 + hl) * G + g) * D,
                                   ob + (hl * cph + r * G + g) * D);
        }
    }
}

}  // namespace

#if WEIR_PART(1)
extern "C" int weir_amx_supported() {
    // Linux hands out the tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA)
    static const int ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : 0;
    return ok;
}
#endif
#elif WEIR_PART(1)
extern "C" int weir_amx_supported() { return 0; }
#endif

// ---- The AVX2 tiled kernel ---------------------------------------------------------------
// The AVX-512 kernel's tiles and passes, 8 lanes wide, for CPUs with AVX2 and FMA but no
// AVX-512 (Zen 2/3, Intel client cores and older Xeons). 8 keys at a time; each chunk's key
// and value rows are widened to float32 once per kv head and shared by the tile's rows and
// its G query heads, and the tile's queries are widened and scaled once. Measured on 2
// AVX2-only EPYC cores, bf16, SmolLM2 shapes, 30 layers' caches: see docs/ARCHITECTURE.md.
#if !defined(__AVX512F__) && defined(WEIR_TILED)

namespace {

constexpr int kChunk = 8;      // keys per pass step

using weir::exp8;
using weir::hadd8;
using weir::load8;

// out lane j = sum of the lanes of v[j]
inline __m256 hsum8(const __m256* v) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}


// Rows of head h of the chunk's keys (or values) as float32: fp32 rows are used in place,
// bf16 rows are widened once into buf (8 x D).
template <int D>
inline void widen_rows(const float* const* rows, int64_t h, int nk, float*, const float** out) {
    for (int j = 0; j < nk; ++j) out[j] = rows[j] + h * D;
}
template <int D>
inline void widen_rows(const uint16_t* const* rows, int64_t h, int nk, float* buf,
                       const float** out) {
    for (int j = 0; j < nk; ++j) {
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(buf + j * D + d, load8(rows[j] + h * D + d));
        out[j] = buf + j * D;
    }
}
// fp8 rows (kv.dtype fp8_*): by F16C where the CPU has it, else a lookup per element
template <int D, typename F, std::enable_if_t<weir::is_fp8<F>, int> = 0>
inline void widen_rows(const F* const* rows, int64_t h, int nk, float* buf, const float** out) {
    for (int j = 0; j < nk; ++j) {
#if defined(__F16C__)
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(buf + j * D + d, load8(rows[j] + h * D + d));
#else
        for (int d = 0; d < D; ++d) buf[j * D + d] = weir::load(rows[j] + h * D, d);
#endif
        out[j] = buf + j * D;
    }
}

// The largest divisor of G that is at most 4: queries sharing one value row in registers
// (SG x 2 accumulators, 2 value vectors and SG broadcasts fit the 16 ymm registers).
constexpr int value_group(int g) { return g % 4 == 0 ? 4 : g % 3 == 0 ? 3 : g % 2 == 0 ? 2 : 1; }

// One tile (see the AVX-512 kernel): scores [nq][lpad], acc [nq][D], qf [nq][D],
// rowbuf [kChunk][D]; query (h, r, g) is qi = (h * nrows + r) * G + g.
template <typename T, typename KT, int D, int G>
void attend_tile(const T* q, const KT* k_cache, const KT* v_cache, T* out, int64_t row0,
                 int nrows, const int32_t* lens, int64_t kv_heads, const int32_t* table,
                 int64_t heads, int64_t q_row, int64_t block_size, float scale,
                 float* scores, int64_t lpad, float* acc, float* qf, float* rowbuf) {
    const int64_t L = lens[nrows - 1];
    const int64_t row_stride = kv_heads * D;
    const int nq = static_cast<int>(kv_heads) * nrows * G;
    for (int qi = 0; qi < nq; ++qi) {
        const int64_t h = qi / G / nrows, r = (qi / G) % nrows, g = qi % G;
        const T* src = q + (row0 + r) * q_row + (h * G + g) * D;
        for (int d = 0; d < D; ++d) qf[qi * D + d] = weir::load(src, d) * scale;
    }
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const KT* kp[kChunk];
    const float* kf[kChunk];
    int64_t blk = 0, off = 0;
    for (int64_t t0 = 0; t0 < L; t0 += kChunk) {
        const int nk = L - t0 < kChunk ? static_cast<int>(L - t0) : kChunk;
        chunk_rows(k_cache, table, block_size, row_stride, blk, off, nk, kp);
        prefetch_rows<_MM_HINT_T1>(k_cache, table, block_size, row_stride, t0 + kChunk,
                                   kChunk, L);
        prefetch_rows<_MM_HINT_T1>(v_cache, table, block_size, row_stride, t0, kChunk, L);
        for (int64_t h = 0; h < kv_heads; ++h) {
            widen_rows<D>(kp, h, nk, rowbuf, kf);
            for (int r = 0; r < nrows; ++r) {
                if (t0 >= lens[r]) continue;
                const __m256 live = _mm256_cmp_ps(
                    lane, _mm256_set1_ps(static_cast<float>(lens[r] - t0)), _CMP_LT_OQ);
                for (int g = 0; g < G; ++g) {
                    const int qi = static_cast<int>((h * nrows + r) * G + g);
                    const float* qq = qf + qi * D;
                    __m256 v[kChunk];
                    for (int j = 0; j < kChunk; ++j) {
                        if (j >= nk) { v[j] = _mm256_setzero_ps(); continue; }
                        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qq), _mm256_loadu_ps(kf[j]));
                        for (int d = 8; d < D; d += 8)
                            a = _mm256_fmadd_ps(_mm256_loadu_ps(qq + d),
                                                _mm256_loadu_ps(kf[j] + d), a);
                        v[j] = a;
                    }
                    _mm256_storeu_ps(scores + qi * lpad + t0,
                                     _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), hsum8(v), live));
                }
            }
        }
    }
    // softmax per query over its own keys (lanes past its length hold -inf)
    float inv[64 * kTile];                 // kv_heads * G <= 64 (heads <= 64)
    for (int qi = 0; qi < nq; ++qi) {
        float* s = scores + qi * lpad;
        const int64_t len = lens[(qi / G) % nrows];
        __m256 mv = _mm256_set1_ps(-INFINITY);
        for (int64_t t = 0; t < len; t += kChunk) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
        const __m256 m = _mm256_set1_ps(hmax8(mv));
        __m256 sum = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; t += kChunk) {
            const __m256 live = _mm256_cmp_ps(
                lane, _mm256_set1_ps(static_cast<float>(len - t)), _CMP_LT_OQ);
            const __m256 e = _mm256_and_ps(live, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m)));
            _mm256_storeu_ps(s + t, e);
            sum = _mm256_add_ps(sum, e);
        }
        inv[qi] = 1.0f / hadd8(sum);
        for (int d = 0; d < D; ++d) acc[qi * D + d] = 0.0f;
    }
    // values: SG queries x 2 vectors of 8 dims in registers, over the chunk's keys
    constexpr int SG = value_group(G);
    blk = 0, off = 0;
    for (int64_t t0 = 0; t0 < L; t0 += kChunk) {
        const int nk = L - t0 < kChunk ? static_cast<int>(L - t0) : kChunk;
        chunk_rows(v_cache, table, block_size, row_stride, blk, off, nk, kp);
        for (int64_t h = 0; h < kv_heads; ++h) {
            widen_rows<D>(kp, h, nk, rowbuf, kf);
            for (int r = 0; r < nrows; ++r) {
                if (t0 >= lens[r]) continue;
                const int kn = lens[r] - t0 < nk ? static_cast<int>(lens[r] - t0) : nk;
                for (int g0 = 0; g0 < G; g0 += SG) {
                    const int q0 = static_cast<int>((h * nrows + r) * G + g0);
                    for (int d0 = 0; d0 < D; d0 += 16) {
                        __m256 a[SG][2];
                        for (int g = 0; g < SG; ++g)
                            for (int c = 0; c < 2; ++c)
                                a[g][c] = _mm256_loadu_ps(acc + (q0 + g) * D + d0 + c * 8);
                        for (int j = 0; j < kn; ++j) {
                            const __m256 v0 = _mm256_loadu_ps(kf[j] + d0);
                            const __m256 v1 = _mm256_loadu_ps(kf[j] + d0 + 8);
                            for (int g = 0; g < SG; ++g) {
                                const __m256 p = _mm256_broadcast_ss(scores + (q0 + g) * lpad + t0 + j);
                                a[g][0] = _mm256_fmadd_ps(p, v0, a[g][0]);
                                a[g][1] = _mm256_fmadd_ps(p, v1, a[g][1]);
                            }
                        }
                        for (int g = 0; g < SG; ++g)
                            for (int c = 0; c < 2; ++c)
                                _mm256_storeu_ps(acc + (q0 + g) * D + d0 + c * 8, a[g][c]);
                    }
                }
            }
        }
    }
    for (int qi = 0; qi < nq; ++qi) {
        const int64_t h = qi / G / nrows, r = (qi / G) % nrows, g = qi % G;
        T* o = out + ((row0 + r) * heads + h * G + g) * D;
        for (int d = 0; d < D; ++d) weir::store(o, d, acc[qi * D + d] * inv[qi]);
    }
}

}  // namespace
#endif

namespace {

using weir::exp_neg;
using weir::load;
using weir::store;

// ---- The portable kernel ---------------------------------------------------------------
// One work item: G query heads of one kv head over one sequence's blocks. D and G are
// compile-time constants, so q, the widened key row and the G accumulators stay in vector
// registers; each key row is widened once and shared by the G dot products.
template <typename T, typename KT, int D, int G>
void attend(const T* q, const KT* k_cache, const KT* v_cache, T* out, int64_t row, int64_t h,
            int64_t len, const int32_t* table, int64_t heads, int64_t q_row, int64_t row_stride,
            int64_t block_size, float scale, float* scores) {
    float qf[G][D], acc[G][D], kf[D];
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) {
            qf[g][d] = load(q, row * q_row + (h * G + g) * D + d) * scale;
            acc[g][d] = 0.0f;
        }
    float maxs[G];
    for (int g = 0; g < G; ++g) maxs[g] = -INFINITY;
    for (int64_t t = 0; t < len; ++t) {
        const KT* kp = k_cache + (static_cast<int64_t>(table[t / block_size]) * block_size
                                 + t % block_size) * row_stride + h * D;
        for (int d = 0; d < D; ++d) kf[d] = load(kp, d);
        for (int g = 0; g < G; ++g) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; ++d) dot += qf[g][d] * kf[d];
            scores[g * len + t] = dot;
            maxs[g] = dot > maxs[g] ? dot : maxs[g];
        }
    }
    float sums[G];
    for (int g = 0; g < G; ++g) {
        float* sg = scores + g * len;
        const float m = maxs[g];
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
            const float e = exp_neg(sg[t] - m);
            sg[t] = e;
            sum += e;
        }
        sums[g] = sum;
    }
    for (int64_t t = 0; t < len; ++t) {
        const KT* vp = v_cache + (static_cast<int64_t>(table[t / block_size]) * block_size
                                 + t % block_size) * row_stride + h * D;
        for (int d = 0; d < D; ++d) kf[d] = load(vp, d);
        for (int g = 0; g < G; ++g) {
            const float p = scores[g * len + t];
            for (int d = 0; d < D; ++d) acc[g][d] += p * kf[d];
        }
    }
    for (int g = 0; g < G; ++g) {
        const float inv = 1.0f / sums[g];
        for (int d = 0; d < D; ++d) store(out, (row * heads + h * G + g) * D + d, acc[g][d] * inv);
    }
}

template <typename T, typename KT, int D, int G>
void decode_attention(const T* q, const KT* k_cache, const KT* v_cache, T* out,
                      const int64_t* seqs, int64_t n, const int32_t* block_tables,
                      int64_t table_width, const int32_t* row_lens, int64_t heads,
                      int64_t q_row, int64_t kv_heads, int64_t block_size, float scale,
                      int num_threads, bool amx) {
#if defined(WEIR_TILED)
    // tiles: runs of up to kTile consecutive rows of one sequence at consecutive positions
    // (the AMX kernel: up to 16 / G, its queries' columns)
    const int64_t tile_rows = amx ? 16 / G : kTile;
    std::vector<int64_t> starts;
    starts.reserve(static_cast<size_t>(n) + 1);
    for (int64_t i = 0; i < n; ++i)
        if (i == 0 || seqs[i] != seqs[i - 1] || row_lens[i] != row_lens[i - 1] + 1
                || i - starts.back() == tile_rows)
            starts.push_back(i);
    starts.push_back(n);
    const int64_t tiles = static_cast<int64_t>(starts.size()) - 1;
#if defined(WEIR_AMX)
    if constexpr (sizeof(T) == 2) {
        if (amx) {
#pragma omp parallel num_threads(num_threads)
            {
                amx_configure();
                thread_local std::vector<float> buf;
#pragma omp for schedule(static, 1)
                for (int64_t tile = 0; tile < tiles; ++tile) {
                    const int64_t i0 = starts[tile];
                    // this thread's next tile, when it reads another sequence's keys (a
                    // prefill's next rows share this one's, already on their way in)
                    NextTile next;
                    const int64_t i1 = tile + num_threads < tiles ? starts[tile + num_threads] : -1;
                    if (i1 >= 0 && seqs[i1] != seqs[i0]) {
                        next.k = reinterpret_cast<const char*>(k_cache);
                        next.v = reinterpret_cast<const char*>(v_cache);
                        next.table = block_tables + seqs[i1] * table_width;
                        next.block_size = block_size;
                        next.row_bytes = kv_heads * D * static_cast<int64_t>(sizeof(KT));
                        next.len = row_lens[starts[tile + num_threads + 1] - 1];
                    }
                    const int nrows = static_cast<int>(starts[tile + 1] - i0);
                    int32_t lens[16];
                    for (int r = 0; r < nrows; ++r) lens[r] = row_lens[i0 + r];
                    const int64_t lpad = (lens[nrows - 1] + 31) / 32 * 32;
                    const int64_t hg = std::min<int64_t>(kv_heads, 16 / (nrows * G));
                    // q tiles (hg * D / 32 KB), or P.V's scratch: 4 KB and 16 x D floats
                    const int64_t scratch = std::max<int64_t>(hg * D * 8, 1024 + 16 * D);
                    const int64_t staged = weir::is_fp8<KT> ? 8 * kv_heads * D + 16 : 0;
                    buf.resize(static_cast<size_t>(lpad * 16 + lpad / 2 * 16 + scratch + 16
                                                   + staged));
                    float* scores = buf.data();
                    auto* pairs = reinterpret_cast<uint32_t*>(scores + lpad * 16);
                    auto* qb = reinterpret_cast<uint32_t*>(
                        (reinterpret_cast<uintptr_t>(pairs + lpad / 2 * 16) + 63) & ~uintptr_t(63));
                    auto* stage = reinterpret_cast<uint16_t*>(
                        (reinterpret_cast<uintptr_t>(qb + scratch) + 63) & ~uintptr_t(63));
                    attend_tile_amx<D, G>(q, k_cache, v_cache, out, i0, nrows, lens, kv_heads,
                                          block_tables + seqs[i0] * table_width, heads, q_row,
                                          block_size, scale, scores, lpad, pairs, qb, next,
                                          stage);
                }
                _tile_release();
            }
            return;
        }
    }
#endif
    // one item per tile, all kv heads: a key row's heads share cache lines, so reading
    // them together moves each line once (decode attention is memory-bound)
    // round robin (a sequence's later tiles are longer), so each thread knows its next
    // tile and prefetches its first keys
#pragma omp parallel for schedule(static, 1) num_threads(num_threads)
    for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t i0 = starts[tile];
        if (tile + num_threads < tiles) {
            const int64_t i1 = starts[tile + num_threads];
            prefetch_rows<_MM_HINT_T1>(k_cache, block_tables + seqs[i1] * table_width,
                                       block_size, kv_heads * D, 0, kChunk, row_lens[i1]);
        }
        const int nrows = static_cast<int>(starts[tile + 1] - i0);
        int32_t lens[kTile];
        for (int r = 0; r < nrows; ++r) lens[r] = row_lens[i0 + r];
        const int64_t lpad = (lens[nrows - 1] + kChunk - 1) / kChunk * kChunk;
        const int64_t nq = kv_heads * kTile * G;
        thread_local std::vector<float> buf;
#if defined(__AVX512F__)
        // + bf16 probs, + an fp8 chunk widened to T
        const int64_t staged = weir::is_fp8<KT> ? kChunk * kv_heads * D : 0;
        buf.resize(static_cast<size_t>(nq * (lpad + D + lpad / 2) + staged));
        attend_tile<T, KT, D, G>(q, k_cache, v_cache, out, i0, nrows, lens, kv_heads,
                                 block_tables + seqs[i0] * table_width, heads, q_row, block_size,
                                 scale, buf.data(), lpad, buf.data() + nq * lpad,
                                 reinterpret_cast<uint16_t*>(buf.data() + nq * (lpad + D)),
                                 reinterpret_cast<T*>(buf.data() + nq * (lpad + D + lpad / 2)));
#else
        buf.resize(static_cast<size_t>(nq * (lpad + 2 * D) + kChunk * D));
        float* scratch = buf.data();
        attend_tile<T, KT, D, G>(q, k_cache, v_cache, out, i0, nrows, lens, kv_heads,
                                 block_tables + seqs[i0] * table_width, heads, q_row, block_size,
                                 scale, scratch, lpad, scratch + nq * lpad,
                                 scratch + nq * (lpad + D), scratch + nq * (lpad + 2 * D));
#endif
    }
#else
    (void)amx;
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads)
    for (int64_t item = 0; item < n * kv_heads; ++item) {
        const int64_t i = item / kv_heads, h = item % kv_heads;
        const int64_t s = seqs[i], len = row_lens[i];
        thread_local std::vector<float> scores;
        scores.resize(static_cast<size_t>(G * len));
        attend<T, KT, D, G>(q, k_cache, v_cache, out, i, h, len,
                        block_tables + s * table_width, heads, q_row, kv_heads * D, block_size,
                        scale,
                        scores.data());
    }
#endif
}

// The shapes compiled in: head_dim 64 or 128; 1..8 query heads per kv head.
template <typename T, typename KT, int D>
int dispatch_g(int64_t g, const T* q, const KT* k, const KT* v, T* out, const int64_t* seqs,
               int64_t n, const int32_t* bt, int64_t w, const int32_t* rlens, int64_t heads,
               int64_t q_row, int64_t kv_heads, int64_t bs, float scale, int threads,
               bool amx) {
    switch (g) {
#define WEIR_G(N) case N: decode_attention<T, KT, D, N>(q, k, v, out, seqs, n, bt, w, rlens, heads, \
                                                    q_row, kv_heads, bs, scale, threads, amx); \
                          return 0;
        WEIR_G(1) WEIR_G(2) WEIR_G(3) WEIR_G(4) WEIR_G(5) WEIR_G(6) WEIR_G(7) WEIR_G(8)
#undef WEIR_G
        default: return -1;
    }
}

template <typename T, typename KT>
int dispatch(int64_t dim, int64_t g, const T* q, const KT* k, const KT* v, T* out,
             const int64_t* seqs, int64_t n, const int32_t* bt, int64_t w, const int32_t* rlens,
             int64_t heads, int64_t q_row, int64_t kv_heads, int64_t bs, float scale,
             int threads, bool amx) {
    if (dim == 64)
        return dispatch_g<T, KT, 64>(g, q, k, v, out, seqs, n, bt, w, rlens, heads, q_row, kv_heads,
                                 bs, scale, threads, amx);
    if (dim == 128)
        return dispatch_g<T, KT, 128>(g, q, k, v, out, seqs, n, bt, w, rlens, heads, q_row, kv_heads,
                                  bs, scale, threads, amx);
    return -1;
}

// One fp8 cache row per new token: 16 elements at a time on AVX-512, else one by one.
template <typename S, typename F>
void write_fp8(const S* k, const S* v, int64_t src_stride, F* k_cache, F* v_cache,
               int64_t row, const int64_t* slots, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        if (slots[i] < 0) continue;
        for (int kv = 0; kv < 2; ++kv) {
            const S* src = (kv == 0 ? k : v) + i * src_stride;
            F* dst = (kv == 0 ? k_cache : v_cache) + slots[i] * row;
            int64_t d = 0;
#if defined(__AVX512F__)
            for (; d + 16 <= row; d += 16)
                _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                                 weir::fp8_encode16<F>(weir::load16(src + d)));
#endif
            for (; d < row; ++d) dst[d].bits = weir::fp8_encode<F>(weir::load(src, d));
        }
    }
}

// One family of caches (WEIR_ATTN_PART): q and out of dtype (0 float32, 1 bf16), caches
// of KT; the arguments of weir_decode_attention.
template <typename KT>
int attention_part(int dtype, const void* q, const void* k_cache, const void* v_cache,
                   void* out, const int64_t* seqs, int64_t n, const int32_t* block_tables,
                   int64_t table_width, const int32_t* row_lens, int64_t heads, int64_t q_row,
                   int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                   int num_threads, int amx) {
    const int64_t g = heads / kv_heads;
    auto run = [&](auto qt) {
        using T = std::remove_const_t<std::remove_pointer_t<decltype(qt)>>;
        using K = std::conditional_t<std::is_void_v<KT>, T, KT>;
        return dispatch(dim, g, static_cast<const T*>(q), static_cast<const K*>(k_cache),
                        static_cast<const K*>(v_cache), static_cast<T*>(out), seqs, n,
                        block_tables, table_width, row_lens, heads, q_row, kv_heads, block_size,
                        scale, num_threads, amx != 0);
    };
    if (dtype == 0) return run(static_cast<const float*>(nullptr));
    if (dtype == 1) return run(static_cast<const uint16_t*>(nullptr));
    return -1;
}

}  // namespace

#define WEIR_PART_ARGS int dtype, const void* q, const void* k_cache, const void* v_cache, \
    void* out, const int64_t* seqs, int64_t n, const int32_t* block_tables, \
    int64_t table_width, const int32_t* row_lens, int64_t heads, int64_t q_row, \
    int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int num_threads, int amx
#define WEIR_PART_CALL dtype, q, k_cache, v_cache, out, seqs, n, block_tables, table_width, \
    row_lens, heads, q_row, kv_heads, dim, block_size, scale, num_threads, amx

extern "C" {

int weir_attention_same(WEIR_PART_ARGS);     // caches of q's dtype (void: T itself)
int weir_attention_e4m3(WEIR_PART_ARGS);
int weir_attention_e5m2(WEIR_PART_ARGS);
#if WEIR_PART(1)
int weir_attention_same(WEIR_PART_ARGS) { return attention_part<void>(WEIR_PART_CALL); }
#endif
#if WEIR_PART(2)
int weir_attention_e4m3(WEIR_PART_ARGS) {
    return attention_part<weir::fp8_e4m3>(WEIR_PART_CALL);
}
#endif
#if WEIR_PART(3)
int weir_attention_e5m2(WEIR_PART_ARGS) {
    return attention_part<weir::fp8_e5m2>(WEIR_PART_CALL);
}
#endif

#if WEIR_PART(1)

// Store n new key and value rows (row_bytes each: all kv heads; source rows src_stride
// bytes apart, e.g. views into the fused qkv projection) at their cache slots; slot -1 =
// skip. The same bytes torch's index_copy_ writes, without its ~20 us per call.
void weir_write_kv(const void* k, const void* v, int64_t src_stride, void* k_cache,
                   void* v_cache, int64_t row_bytes, const int64_t* slots, int64_t n) {
    const char* ks = static_cast<const char*>(k);
    const char* vs = static_cast<const char*>(v);
#if defined(__AVX512F__)
    // whole cache lines: streaming stores, which do not read each destination line from
    // memory first (a decode row's block is cold: 20 us a layer for 64 rows, 4.6 hot); the
    // attention that reads them next runs on other threads, after the fence
    if (row_bytes % 64 == 0 && reinterpret_cast<uintptr_t>(k_cache) % 64 == 0
            && reinterpret_cast<uintptr_t>(v_cache) % 64 == 0) {
        for (int64_t i = 0; i < n; ++i) {
            if (slots[i] < 0) continue;
            char* kd = static_cast<char*>(k_cache) + slots[i] * row_bytes;
            char* vd = static_cast<char*>(v_cache) + slots[i] * row_bytes;
            for (int64_t b = 0; b < row_bytes; b += 64) {
                _mm512_stream_si512(reinterpret_cast<__m512i*>(kd + b),
                                    _mm512_loadu_si512(ks + i * src_stride + b));
                _mm512_stream_si512(reinterpret_cast<__m512i*>(vd + b),
                                    _mm512_loadu_si512(vs + i * src_stride + b));
            }
        }
        _mm_sfence();
        return;
    }
#endif
    for (int64_t i = 0; i < n; ++i) {
        if (slots[i] < 0) continue;
        std::memcpy(static_cast<char*>(k_cache) + slots[i] * row_bytes, ks + i * src_stride,
                    static_cast<size_t>(row_bytes));
        std::memcpy(static_cast<char*>(v_cache) + slots[i] * row_bytes, vs + i * src_stride,
                    static_cast<size_t>(row_bytes));
    }
}

// weir_write_kv for an fp8 cache (kv_dtype 2 = E4M3, 3 = E5M2): n rows of row_elems float32
// (dtype 0) or bf16 (dtype 1) elements, src_stride elements apart, rounded to the format
// (cpu_fp8.h: nearest even, saturated; what torch's clamp + .to(float8) stores). Returns
// 0, or -1 for a pair of types it does not convert.
int weir_write_kv_fp8(int dtype, int kv_dtype, const void* k, const void* v,
                      int64_t src_stride, void* k_cache, void* v_cache, int64_t row_elems,
                      const int64_t* slots, int64_t n) {
    auto run = [&](auto st, auto ft) {
        using S = std::remove_const_t<std::remove_pointer_t<decltype(st)>>;
        using F = std::remove_pointer_t<decltype(ft)>;
        write_fp8(static_cast<const S*>(k), static_cast<const S*>(v), src_stride,
                  static_cast<F*>(k_cache), static_cast<F*>(v_cache), row_elems, slots, n);
        return 0;
    };
    using E4 = weir::fp8_e4m3*;
    using E5 = weir::fp8_e5m2*;
    if (dtype == 0 && kv_dtype == 2) return run(static_cast<const float*>(nullptr), E4{});
    if (dtype == 0 && kv_dtype == 3) return run(static_cast<const float*>(nullptr), E5{});
    if (dtype == 1 && kv_dtype == 2) return run(static_cast<const uint16_t*>(nullptr), E4{});
    if (dtype == 1 && kv_dtype == 3) return run(static_cast<const uint16_t*>(nullptr), E5{});
    return -1;
}

// dtype: 0 = float32, 1 = bfloat16 (q and out); kv_dtype: the caches', the same, or 2 = fp8
// E4M3, 3 = fp8 E5M2 (widened as read). Returns 0, or -1 if the shape is not compiled in
// (head_dim 64 or 128, 1..8 query heads per kv head, at most 64 heads). Query row i
// attends the first row_lens[i] keys of sequence seqs[i]: a token at position p passes
// p + 1, which makes prefill causal. amx = 1: the AMX kernel (bf16 q, block_size a
// multiple of 16, weir_amx_supported()), else -1.
int weir_decode_attention(int dtype, int kv_dtype, const void* q, const void* k_cache,
                          const void* v_cache, void* out, const int64_t* seqs, int64_t n,
                          const int32_t* block_tables, int64_t table_width,
                          const int32_t* row_lens, int64_t heads, int64_t q_row,
                          int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                          int num_threads, int amx) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || heads > 64) return -1;
    if (amx && (dtype != 1 || block_size % 16 != 0 || !weir_amx_supported())) return -1;
    if (dtype != 0 && dtype != 1) return -1;
    if (kv_dtype == dtype) return weir_attention_same(WEIR_PART_CALL);
    if (kv_dtype == 2) return weir_attention_e4m3(WEIR_PART_CALL);
    if (kv_dtype == 3) return weir_attention_e5m2(WEIR_PART_CALL);
    return -1;
}
#endif

}
