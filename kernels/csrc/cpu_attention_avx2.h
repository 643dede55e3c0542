// Part of cpu_decode_attention.cpp, included there after its shared helpers (row
// pointers, prefetch) and before the entry points: the AVX2 tiled kernel.
// Not a standalone header: it is compiled only as that file's part, once per build part
// (WEIR_ATTN_PART).
#pragma once

// ---- The AVX2 tiled kernel ---------------------------------------------------------------
// The AVX-512 kernel's tiles and passes, 8 lanes wide, for CPUs with AVX2 and FMA but no
// AVX-512 (Zen 2/3, Intel client cores and older Xeons). 8 keys at a time; each chunk's key
// and value rows are widened to float32 once per kv head and shared by the tile's rows and
// its G query heads, and the tile's queries are widened and scaled once. Measured on 2
// AVX2-only EPYC cores, bf16, SmolLM2 shapes, 30 layers' caches: see docs/design/executor.md, "Kernels".
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

// ---- The AVX2 prompt kernel -------------------------------------------------------------
// A prompt's chunk (a run of kFlashRows or more rows) as flash attention in fp32 by FMA, for
// every cache type (keys and values widened once per run and kv head) and head dim. The
// decode tiles above read every key again for each 8 rows and keep the whole score row. Here
// a run's keys are packed once per kv head, widened and transposed per 32 keys ([D][32]: one
// load a dim gives 8 keys' products for a broadcast query element), and its values widened
// ([key][D]), for every block of its rows and every one of the G query heads to share. A work
// item is 16 rows and one kv head (flash_schedule, as the AVX-512 and AMX kernels); for each
// query head, two rows at a time go over the keys 32 a block: their scores are 8
// accumulators (4 key vectors, 2 broadcasts: 6 loads for 8 FMAs), then an online softmax per
// row with the lazy max (kLazyRescale), then P.V into the rows' outputs (kept in L1, 2 rows x
// 32 dims in registers a pass). The output is normalized at the end.
#define WEIR_FLASH 1

constexpr int kFlashKeys = 32;       // keys a block

template <typename T, typename KT, int D>
constexpr bool kFlashFits = true;    // every q, cache type and head dim compiled in
using FlashWord = float;
// a run's packed values, then keys, per kv head: whole blocks of 32 keys (zeros past len)
template <int D> inline int64_t flash_span(int64_t len) {
    return (len + kFlashKeys - 1) / kFlashKeys * kFlashKeys * D;
}
template <int D> inline int64_t flash_words(int64_t len, int64_t kv_heads, bool) {
    return 2 * kv_heads * flash_span<D>(len);
}

// a cache row (D elements) as float32
template <int D> inline void widen_row(const float* src, float* dst) {
    std::memcpy(dst, src, D * sizeof(float));
}
template <int D> inline void widen_row(const uint16_t* src, float* dst) {
    for (int d = 0; d < D; d += 8) _mm256_store_ps(dst + d, load8(src + d));
}
template <int D, typename F, std::enable_if_t<weir::is_fp8<F>, int> = 0>
inline void widen_row(const F* src, float* dst) {
#if defined(__F16C__)
    for (int d = 0; d < D; d += 8) _mm256_store_ps(dst + d, load8(src + d));
#else
    for (int d = 0; d < D; ++d) dst[d] = weir::load(src, d);
#endif
}

// 8 x 8 floats: dst[j][i] = src[i][j] (rows sstride and dstride floats apart)
inline void transpose8(const float* src, int64_t sstride, float* dst, int64_t dstride) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_load_ps(src + i * sstride);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    // r[4b + k] holds, in each 128-bit lane l, column 4l + k of rows 4b .. 4b + 3
    for (int k = 0; k < 4; ++k) {
        _mm256_store_ps(dst + k * dstride, _mm256_permute2f128_ps(r[k], r[4 + k], 0x20));
        _mm256_store_ps(dst + (4 + k) * dstride, _mm256_permute2f128_ps(r[k], r[4 + k], 0x31));
    }
}

// a run's values ([key][D]) and keys ([D][32] per 32 keys) of kv head h, as float32
template <typename KT, int D>
void pack_run_avx2(const KT* k_cache, const KT* v_cache, const int32_t* table,
                   int64_t block_size, int64_t row_stride, int64_t h, int64_t len, float* vdst,
                   float* kdst) {
    alignas(32) float rows[kFlashKeys * D];
    for (int64_t t0 = 0; t0 < len; t0 += kFlashKeys) {
        const int nk = static_cast<int>(std::min<int64_t>(kFlashKeys, len - t0));
        float* vb = vdst + t0 * D;
        for (int j = 0; j < nk; ++j) {
            const int64_t slot = weir::slot_of(table, block_size, t0 + j) * row_stride + h * D;
            widen_row<D>(v_cache + slot, vb + j * D);
            widen_row<D>(k_cache + slot, rows + j * D);
        }
        if (nk < kFlashKeys) {                  // zeros: P is 0 there, and 0 x NaN is not
            std::memset(vb + nk * D, 0, (kFlashKeys - nk) * D * sizeof(float));
            std::memset(rows + nk * D, 0, (kFlashKeys - nk) * D * sizeof(float));
        }
        float* kb = kdst + t0 * D;
        for (int j0 = 0; j0 < kFlashKeys; j0 += 8)
            for (int d0 = 0; d0 < D; d0 += 8)
                transpose8(rows + j0 * D + d0, D, kb + d0 * kFlashKeys + j0, kFlashKeys);
    }
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), weir::bf16_8(v));
}

// One row's online softmax over a block of 32 scores (s, already scaled; t0 its first key,
// len the row's keys): the max moves lazily, rescaling the row's sum l and output o; p gets
// exp(s - m), 0 past len
template <int D>
inline void flash_softmax_avx2(__m256* s, int64_t t0, int64_t len, float& m, float& l, float* o,
                               float* p) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const bool edge = t0 + kFlashKeys > len;
    __m256 live[4];
    if (edge)
        for (int c = 0; c < 4; ++c) {
            live[c] = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(static_cast<float>(t0 + 8 * c))),
                                    _mm256_set1_ps(static_cast<float>(len)), _CMP_LT_OQ);
            s[c] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s[c], live[c]);
        }
    const float bm = hmax8(_mm256_max_ps(_mm256_max_ps(s[0], s[1]), _mm256_max_ps(s[2], s[3])));
    if (bm > m + kLazyRescale) {             // the row's max moves: rescale what was summed
        if (m != -INFINITY) {
            const float alpha = weir::exp_neg(m - bm);
            const __m256 a = _mm256_set1_ps(alpha);
            for (int d = 0; d < D; d += 8) _mm256_store_ps(o + d, _mm256_mul_ps(_mm256_load_ps(o + d), a));
            l *= alpha;
        }
        m = bm;
    }
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
        __m256 e = exp8(_mm256_sub_ps(s[c], mv));
        if (edge) e = _mm256_and_ps(e, live[c]);
        _mm256_store_ps(p + 8 * c, e);
        sum = _mm256_add_ps(sum, e);
    }
    l += hadd8(sum);
}

// rows [row0, row0 + nr) of a run (nr <= 16), query head `head`, against its kv head's packed
// keys kt and values vp
template <typename T, int D>
void flash_block_avx2(const T* q, T* out, int64_t row0, int nr, const int32_t* row_lens,
                      int64_t head, int64_t heads, int64_t q_row, float scale, const float* kt,
                      const float* vp) {
    alignas(32) float qf[16 * D];            // the queries, widened and scaled
    alignas(32) float o[16 * D];             // their outputs, unnormalized
    alignas(32) float p[16 * kFlashKeys];    // a block's probabilities
    float m[16], l[16];
    const __m256 sc = _mm256_set1_ps(scale);
    for (int r = 0; r < nr; ++r) {
        const T* src = q + (row0 + r) * q_row + head * D;
        for (int d = 0; d < D; d += 8) {
            _mm256_store_ps(qf + r * D + d, _mm256_mul_ps(load8(src + d), sc));
            _mm256_store_ps(o + r * D + d, _mm256_setzero_ps());
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int64_t L = row_lens[row0 + nr - 1];
    for (int64_t t0 = 0; t0 < L; t0 += kFlashKeys) {
        const float* kb = kt + t0 * D;
        const float* vb = vp + t0 * D;
        for (int r = 0; r < nr; r += 2) {
            const int r1 = std::min(r + 1, nr - 1);   // an odd last row goes alone (twice)
            const int64_t len1 = row_lens[row0 + r1];
            if (t0 >= len1) continue;
            // scores: 2 rows x 32 keys, a query element broadcast against 4 key vectors
            __m256 s0[4], s1[4];
            for (int c = 0; c < 4; ++c) s0[c] = s1[c] = _mm256_setzero_ps();
            const float* q0 = qf + r * D;
            const float* q1 = qf + r1 * D;
#pragma GCC unroll 4
            for (int d = 0; d < D; ++d) {
                const __m256 b0 = _mm256_broadcast_ss(q0 + d), b1 = _mm256_broadcast_ss(q1 + d);
                for (int c = 0; c < 4; ++c) {
                    const __m256 k = _mm256_load_ps(kb + d * kFlashKeys + 8 * c);
                    s0[c] = _mm256_fmadd_ps(k, b0, s0[c]);
                    s1[c] = _mm256_fmadd_ps(k, b1, s1[c]);
                }
            }
            float* o0 = o + r * D;
            float* o1 = o + r1 * D;
            float* p0 = p + r * kFlashKeys;
            float* p1 = p + r1 * kFlashKeys;
            flash_softmax_avx2<D>(s0, t0, row_lens[row0 + r], m[r], l[r], o0, p0);
            if (r1 != r) flash_softmax_avx2<D>(s1, t0, len1, m[r1], l[r1], o1, p1);
            // P.V: 2 rows x 32 dims a pass, a value vector against 2 broadcast probabilities
            const int kn = static_cast<int>(std::min<int64_t>(kFlashKeys, len1 - t0));
            for (int d0 = 0; d0 < D; d0 += 32) {
                __m256 a0[4], a1[4];
                for (int c = 0; c < 4; ++c) {
                    a0[c] = _mm256_load_ps(o0 + d0 + 8 * c);
                    a1[c] = _mm256_load_ps(o1 + d0 + 8 * c);
                }
                for (int j = 0; j < kn; ++j) {
                    const __m256 w0 = _mm256_broadcast_ss(p0 + j), w1 = _mm256_broadcast_ss(p1 + j);
                    for (int c = 0; c < 4; ++c) {
                        const __m256 v = _mm256_load_ps(vb + j * D + d0 + 8 * c);
                        a0[c] = _mm256_fmadd_ps(w0, v, a0[c]);
                        a1[c] = _mm256_fmadd_ps(w1, v, a1[c]);
                    }
                }
                for (int c = 0; c < 4; ++c) {      // (an odd last row: both the same)
                    _mm256_store_ps(o0 + d0 + 8 * c, a0[c]);
                    _mm256_store_ps(o1 + d0 + 8 * c, a1[c]);
                }
            }
        }
    }
    for (int r = 0; r < nr; ++r) {
        const __m256 inv = _mm256_set1_ps(1.0f / l[r]);
        T* dst = out + ((row0 + r) * heads + head) * D;
        for (int d = 0; d < D; d += 8) store8(dst + d, _mm256_mul_ps(_mm256_load_ps(o + r * D + d), inv));
    }
}

// the runs: pack every run's keys and values per kv head, then the blocks (16 rows, one kv
// head, each of its G query heads in turn), longest first
template <typename T, typename KT, int D, int G>
void flash_runs_avx2(const T* q, const KT* k_cache, const KT* v_cache, T* out,
                     const std::vector<FlashRun>& runs, const int32_t* row_lens,
                     const int32_t* block_tables, int64_t table_width, int64_t heads,
                     int64_t q_row, int64_t kv_heads, int64_t block_size, float scale,
                     int num_threads, float* buf) {
    auto at = [&](const FlashRun& run, int64_t h, int which) {   // 0 values, 1 keys
        return buf + run.vpk + (2 * h + which) * flash_span<D>(run.len);
    };
    auto pack = [&](const FlashRun& run, int64_t h) {
        pack_run_avx2<KT, D>(k_cache, v_cache, block_tables + run.seq * table_width, block_size,
                             kv_heads * D, h, run.len, at(run, h, 0), at(run, h, 1));
    };
    auto block = [&](const FlashRun& run, const FlashItem& it) {
        const int nr = static_cast<int>(std::min<int64_t>(16, run.n - it.b0));
        for (int g = 0; g < G; ++g)
            flash_block_avx2<T, D>(q, out, run.i0 + it.b0, nr, row_lens, it.h * G + g, heads,
                                   q_row, scale, at(run, it.h, 1), at(run, it.h, 0));
    };
    flash_schedule(runs, row_lens, kv_heads, num_threads, pack, block);
}

}  // namespace
#endif
