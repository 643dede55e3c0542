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

}  // namespace
#endif
