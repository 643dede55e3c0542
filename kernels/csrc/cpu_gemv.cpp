// Small-batch linear layers on the CPU: y[M, N] = x[M, K] . W[N, K]^T (+ bias), for M up
// to a few dozen rows (any M works; the executor measures where oneDNN's blocked GEMM takes
// over). With so few rows a linear layer only streams its weights, and oneDNN's GEMM
// reaches about half the memory's bandwidth on them (30 SmolLM2 layers, bf16, M = 1 on
// Zen 4: 14.5 ms for 212 MB where the memory gives ~30 GB/s). Each kernel reads W in a
// layout packed for it, 16 outputs per 64-byte line, so one load feeds 16 (or 8) outputs
// at once with no horizontal sums, and each thread streams its contiguous share of the
// blocks front to back (the hardware prefetcher's best case). Three kernels:
//
// - bf16, AVX512-BF16: W packed [N/16][K/2][16][2]; vdpbf16ps against a broadcast pair
//   of x accumulates 16 outputs x 2 k per instruction.
// - bf16, AVX2 + FMA (CPUs without AVX512-BF16): the same layout, 8 outputs x 2 k per
//   256-bit load; each 32-bit lane holds one output's pair (k even in the low half), so a
//   shift gives the even k's weight as a float32 and a mask the odd one. x is widened to
//   float32 once per call.
// - float32, AVX2 + FMA (any CPU with them, AVX-512 ones too): W packed [N/16][K][16].
//   On a 2-core AVX2 EPYC, oneDNN's fp32 GEMM streams SmolLM2's weights at 8.5 GB/s at
//   M = 1, where the memory copies at 19.
//
// weir_gemv_supported() says which are built in: bit 0 bf16, bit 1 float32.
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

// MM rows of x against NB blocks of 16 outputs.
template <int MM, int NB>
inline void block(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t kp,
                  const uint16_t* bias, uint16_t* y, int64_t ldy) {
    __m512 acc[MM][NB];
    for (int i = 0; i < MM; ++i)
        for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kp; ++p) {
        __m512bh w[NB];
        for (int b = 0; b < NB; ++b)
            w[b] = (__m512bh)_mm512_loadu_si512(wp + (b * kp + p) * 32);
        for (int i = 0; i < MM; ++i) {
            int32_t pair;
            std::memcpy(&pair, x + i * ldx + 2 * p, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], xv, w[b]);
        }
    }
    for (int b = 0; b < NB; ++b) {
        __m512 bv = _mm512_setzero_ps();
        if (bias)
            bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + b * 16))), 16));
        for (int i = 0; i < MM; ++i)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * ldy + b * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][b], bv)));
    }
}

// A pass: up to kMaxRows rows of x against up to kItemBlocks blocks, 24 accumulators in
// registers (of 32) beside 4 weight vectors, each weight load feeding 6 vdpbf16ps and each
// broadcast of x 4. Measured on 2 Zen 4 cores against 8 rows x 2 blocks (SmolLM2's step
// GEMMs, bf16, best of 15 interleaved runs): the same at M = 1, 64-256, 6-8% faster at
// M = 8-32; every blocking gives bit-identical results (the k order is the same).
constexpr int kMaxRows = 6;
constexpr int kItemBlocks = 4;

template <int NB, int MM>
void rows_upto(int64_t mm, const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t kp,
               const uint16_t* bias, uint16_t* y, int64_t ldy) {
    if constexpr (MM >= 1) {
        if (mm == MM) { block<MM, NB>(x, ldx, wp, kp, bias, y, ldy); return; }
        rows_upto<NB, MM - 1>(mm, x, ldx, wp, kp, bias, y, ldy);
    }
}

template <int NB>
void item_blocks(int64_t nb, int64_t mm, const uint16_t* x, int64_t ldx, const uint16_t* wp,
                 int64_t kp, const uint16_t* bias, uint16_t* y, int64_t ldy) {
    if constexpr (NB >= 1) {
        if (nb == NB) { rows_upto<NB, kMaxRows>(mm, x, ldx, wp, kp, bias, y, ldy); return; }
        item_blocks<NB - 1>(nb, mm, x, ldx, wp, kp, bias, y, ldy);
    }
}

}  // namespace
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <vector>

#include "cpu_common.h"

namespace {

using weir::bf16_8;
using weir::load8;

// the 16 outputs of one block for MM rows: acc[i][0] outputs 0-7, acc[i][1] outputs 8-15
template <int MM>
inline void store_block(__m256 (&acc)[MM][2], const float* bias, float* y, int64_t ldy) {
    for (int h = 0; h < 2; ++h) {
        const __m256 bv = bias ? _mm256_loadu_ps(bias + 8 * h) : _mm256_setzero_ps();
        for (int i = 0; i < MM; ++i) _mm256_storeu_ps(y + i * ldy + 8 * h, _mm256_add_ps(acc[i][h], bv));
    }
}
template <int MM>
inline void store_block(__m256 (&acc)[MM][2], const uint16_t* bias, uint16_t* y, int64_t ldy) {
    for (int h = 0; h < 2; ++h) {
        const __m256 bv = bias ? load8(bias + 8 * h) : _mm256_setzero_ps();
        for (int i = 0; i < MM; ++i)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i * ldy + 8 * h),
                             bf16_8(_mm256_add_ps(acc[i][h], bv)));
    }
}

// MM rows of x (float32, ldx apart) against one block of 16 outputs, bf16 weights packed
// [K/2][16][2]
template <int MM>
inline void block_bf16(const float* x, int64_t ldx, const uint16_t* wp, int64_t kp,
                       const uint16_t* bias, uint16_t* y, int64_t ldy) {
    __m256 acc[MM][2];
    for (int i = 0; i < MM; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const __m256i odd = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
    for (int64_t p = 0; p < kp; ++p) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + p * 32));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + p * 32 + 16));
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, odd));
        const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, odd));
        for (int i = 0; i < MM; ++i) {
            const __m256 xe = _mm256_broadcast_ss(x + i * ldx + 2 * p);
            const __m256 xo = _mm256_broadcast_ss(x + i * ldx + 2 * p + 1);
            acc[i][0] = _mm256_fmadd_ps(xo, o0, _mm256_fmadd_ps(xe, e0, acc[i][0]));
            acc[i][1] = _mm256_fmadd_ps(xo, o1, _mm256_fmadd_ps(xe, e1, acc[i][1]));
        }
    }
    store_block<MM>(acc, bias, y, ldy);
}

// MM rows of x against one block of 16 outputs, float32 weights packed [K][16]
template <int MM>
inline void block_f32(const float* x, int64_t ldx, const float* wp, int64_t k,
                      const float* bias, float* y, int64_t ldy) {
    __m256 acc[MM][2];
    for (int i = 0; i < MM; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; ++j) {
        const __m256 w0 = _mm256_loadu_ps(wp + j * 16), w1 = _mm256_loadu_ps(wp + j * 16 + 8);
        for (int i = 0; i < MM; ++i) {
            const __m256 xv = _mm256_broadcast_ss(x + i * ldx + j);
            acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
        }
    }
    store_block<MM>(acc, bias, y, ldy);
}

constexpr int kRows = 4;     // rows of x per pass over a block: 8 accumulators

// the kernels' block functions, with what they share as members
struct Bf16Blocks {
    int64_t kp;
    template <int MM>
    void run(const float* x, int64_t ldx, const uint16_t* wp, const uint16_t* bias,
             uint16_t* y, int64_t ldy) const { block_bf16<MM>(x, ldx, wp, kp, bias, y, ldy); }
};
struct F32Blocks {
    int64_t k;
    template <int MM>
    void run(const float* x, int64_t ldx, const float* wp, const float* bias, float* y,
             int64_t ldy) const { block_f32<MM>(x, ldx, wp, k, bias, y, ldy); }
};

// every block of 16 outputs, in parallel; rows kRows at a time (the block stays in cache
// for the next pass)
template <typename Kernel, typename W, typename T>
void blocks(const Kernel& kernel, const float* x, int64_t ldx, const W* wp,
            int64_t block_elems, const T* bias, T* y, int64_t m, int64_t n, int threads) {
    const int64_t nblocks = n / 16;
#pragma omp parallel for schedule(static) num_threads(threads) if (nblocks > 4)
    for (int64_t b = 0; b < nblocks; ++b) {
        const W* wb = wp + b * block_elems;
        const T* bb = bias ? bias + b * 16 : nullptr;
        for (int64_t m0 = 0; m0 < m; m0 += kRows) {
            const float* xb = x + m0 * ldx;
            T* yb = y + m0 * n + b * 16;
            switch (m - m0 < kRows ? m - m0 : kRows) {
                case 1: kernel.template run<1>(xb, ldx, wb, bb, yb, n); break;
                case 2: kernel.template run<2>(xb, ldx, wb, bb, yb, n); break;
                case 3: kernel.template run<3>(xb, ldx, wb, bb, yb, n); break;
                default: kernel.template run<kRows>(xb, ldx, wb, bb, yb, n); break;
            }
        }
    }
}

// x as float32 rows, once per call (bf16 widened), reused by every block
[[maybe_unused]] const float* widened(const uint16_t* x, int64_t ldx, int64_t m, int64_t k) {
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < m * k) buf.resize(m * k);
    for (int64_t i = 0; i < m; ++i) {
        int64_t j = 0;
        for (; j + 8 <= k; j += 8) _mm256_storeu_ps(buf.data() + i * k + j, load8(x + i * ldx + j));
        for (; j < k; ++j) buf[i * k + j] = weir::load(x + i * ldx, j);
    }
    return buf.data();
}

}  // namespace
#define WEIR_GEMV_AVX2 1
#endif

// - bf16 on AMX tiles (CPUs with AMX-BF16): the same packed layout is what a tile multiply
//   wants for its B operand: 16 k-pairs x 16 outputs of one block are 1 KB, contiguous.
//   Rows of x are A tiles read in place (16 rows x 32 k); two neighbouring blocks' outputs
//   for 32 rows at a time accumulate in four tiles, every row of x passing over a pair of
//   blocks while its weights are in cache, so the weights come from memory once for any M.
//   (weir_gemm_amx_bf16; measured against the vector kernel and oneDNN like every
//   candidate.)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <omp.h>

#include <vector>

#include "cpu_common.h"
#define WEIR_GEMM_AMX 1

extern "C" int weir_amx_supported();

namespace {

// MT (1 or 2) tiles of 16 rows of x (lda elements apart) against NB (1 or 2) neighbouring
// blocks of weights (ksteps B tiles of 1 KB each; the second block w2 elements after the
// first: kp * 32 for neighbours, further for gate and up): accumulators
// tmm0-3 (row tile i, block b: tmm[i * NB + b]), x in tmm4-5, the weights in tmm6-7. Four
// multiplies per four loads, none of them waiting on the one before (a tile register is
// reused only a k step later). c: [MT][NB][16][16].
template <int MT, int NB>
inline void amx_block(const uint16_t* a, int64_t lda, const uint16_t* wb, int64_t w2,
                      int64_t ksteps, float* c) {
    const int64_t stride = lda * 2;
    _tile_zero(0);
    if constexpr (NB == 2) _tile_zero(1);
    if constexpr (MT == 2 && NB == 1) _tile_zero(1);
    if constexpr (MT == 2 && NB == 2) { _tile_zero(2); _tile_zero(3); }
    for (int64_t j = 0; j < ksteps; ++j) {
        _tile_loadd(4, a + j * 32, stride);
        if constexpr (MT == 2) _tile_loadd(5, a + 16 * lda + j * 32, stride);
        _tile_loadd(6, wb + j * 512, 64);
        if constexpr (NB == 2) _tile_loadd(7, wb + w2 + j * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
        if constexpr (MT == 2 && NB == 1) _tile_dpbf16ps(1, 5, 6);
        if constexpr (MT == 2 && NB == 2) { _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
    }
    _tile_stored(0, c, 64);
    if constexpr (NB == 2) _tile_stored(1, c + 256, 64);
    if constexpr (MT == 2 && NB == 1) _tile_stored(1, c + 256, 64);
    if constexpr (MT == 2 && NB == 2) {
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
    }
}

// x's m rows (ldx apart, k wide) as whole 16-row tiles: x itself where m % 16 == 0, else
// a copy with zero rows after m, in the calling thread's buffer (no allocation per call
// once it is big enough); ldx becomes the copy's row stride.
inline const uint16_t* whole_tiles(const uint16_t* x, int64_t& ldx, int64_t m, int64_t k) {
    const int64_t mpad = (m + 15) / 16 * 16;
    if (mpad == m) return x;
    thread_local std::vector<uint16_t> padded;
    if (static_cast<int64_t>(padded.size()) < mpad * k)
        padded.resize(static_cast<size_t>(mpad * k));
    for (int64_t i = 0; i < m; ++i)
        std::memcpy(padded.data() + i * k, x + i * ldx, static_cast<size_t>(k) * 2);
    std::memset(padded.data() + m * k, 0, static_cast<size_t>((mpad - m) * k) * 2);
    ldx = k;
    return padded.data();
}

// 16 outputs rounded to bf16: stored as bf16, or (the lm_head's logits) widened to float32
// there, which is what a bf16 linear and a cast to float32 would give, in one pass
inline void store_row(uint16_t* y, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), weir::bf16_16(v));
}
inline void store_row(float* y, __m512 v) { _mm512_storeu_ps(y, weir::round_bf16(v)); }

// The tile loop of every AMX linear: each thread a contiguous run of pairs of neighbouring
// blocks (runs ascending with the thread number), so its weights stream front to back, each
// pair's once for every row of x. For each 32 rows (or fewer) of x against a pair, calls
// sink(thread, m0, rows, b, nb, c): the pair's outputs in c [mt][nb][16][16], unrounded,
// bias not added. x's rows ldx apart (any m: whole_tiles pads a copy).
template <typename Sink>
int amx_pairs(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t m, int64_t n,
              int64_t k, int threads, Sink&& sink) {
    if (n % 16 || k % 32 || m < 0 || !weir_amx_supported()) return -1;
    if (m == 0) return 0;
    const int64_t blocks = n / 16, kp = k / 2, ksteps = k / 32;
    const int64_t mpad = (m + 15) / 16 * 16;
    int64_t lda = ldx;
    const uint16_t* a = whole_tiles(x, lda, m, k);
    const int t = blocks > 4 ? threads : 1;
#pragma omp parallel num_threads(t)
    {
        weir::amx_configure();
        alignas(64) float c[4 * 256];
        const int tid = omp_get_thread_num();
        const int64_t pairs = (blocks + 1) / 2;
#pragma omp for schedule(static)
        for (int64_t pr = 0; pr < pairs; ++pr) {
            const int64_t b = 2 * pr;
            const int nb = b + 1 < blocks ? 2 : 1;
            const uint16_t* wb = wp + b * kp * 32;
            for (int64_t m0 = 0; m0 < mpad; m0 += 32) {
                const int mt = mpad - m0 >= 32 ? 2 : 1;
                const uint16_t* a0 = a + m0 * lda;
                if (mt == 2 && nb == 2) amx_block<2, 2>(a0, lda, wb, kp * 32, ksteps, c);
                else if (mt == 2) amx_block<2, 1>(a0, lda, wb, kp * 32, ksteps, c);
                else if (nb == 2) amx_block<1, 2>(a0, lda, wb, kp * 32, ksteps, c);
                else amx_block<1, 1>(a0, lda, wb, kp * 32, ksteps, c);
                const int64_t rows = m - m0 < mt * 16 ? m - m0 : mt * 16;
                sink(tid, m0, rows, b, nb, c);
            }
        }
        _tile_release();
    }
    return 0;
}

// output (row r, block b + q) of a pair's tiles c, plus the bias
inline __m512 pair_out(const float* c, int64_t r, int nb, int q, const uint16_t* bias,
                       int64_t b) {
    const __m512 v = _mm512_load_ps(c + ((r / 16) * nb + q) * 256 + (r % 16) * 16);
    return bias ? _mm512_add_ps(v, weir::load16(bias + (b + q) * 16)) : v;
}

template <typename Out>
int gemm_amx(const uint16_t* x, int64_t ldx, const uint16_t* wp, const uint16_t* bias, Out* y,
             int64_t m, int64_t n, int64_t k, int threads) {
    return amx_pairs(x, ldx, wp, m, n, k, threads,
                     [&](int, int64_t m0, int64_t rows, int64_t b, int nb, const float* c) {
        for (int64_t r = 0; r < rows; ++r)
            for (int q = 0; q < nb; ++q)
                store_row(y + (m0 + r) * n + (b + q) * 16, pair_out(c, r, nb, q, bias, b));
    });
}

// Greedy decoding's lm_head: out[r] = the first index of the maximum of row r of the
// logits gemm_amx<float> would write (each rounded to bf16), without writing them (64 x
// 49k float32 is 12.6 MB, then read again by an argmax). Each thread keeps, per row, 16
// lanes of running maxima (lane j: columns 16 i + j, the first block i holding it, by a
// strict >); the lanes, then the threads (in column order) are reduced to the first
// maximum, as torch.argmax. NaN logits are not special-cased (a finite model has none).
int gemm_amx_argmax(const uint16_t* x, int64_t ldx, const uint16_t* wp, const uint16_t* bias,
                    int64_t* out, int64_t m, int64_t n, int64_t k, int threads) {
    // one slot per thread amx_pairs may run (a thread it does not start stays at -inf)
    const int nt = threads > 1 ? threads : 1;
    std::vector<float> best(static_cast<size_t>(nt * m * 16), -INFINITY);
    std::vector<int32_t> at(static_cast<size_t>(nt * m * 16), 0);
    const int rc = amx_pairs(x, ldx, wp, m, n, k, threads,
                             [&](int tid, int64_t m0, int64_t rows, int64_t b, int nb,
                                 const float* c) {
        for (int64_t r = 0; r < rows; ++r) {
            float* bv = best.data() + (tid * m + m0 + r) * 16;
            int32_t* bi = at.data() + (tid * m + m0 + r) * 16;
            __m512 mv = _mm512_loadu_ps(bv);
            __m512i mi = _mm512_loadu_si512(bi);
            for (int q = 0; q < nb; ++q) {
                const __m512 v = weir::round_bf16(pair_out(c, r, nb, q, bias, b));
                const __mmask16 gt = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ);
                mv = _mm512_mask_mov_ps(mv, gt, v);
                mi = _mm512_mask_mov_epi32(mi, gt, _mm512_set1_epi32(static_cast<int>(b + q)));
            }
            _mm512_storeu_ps(bv, mv);
            _mm512_storeu_si512(bi, mi);
        }
    });
    if (rc != 0 || m == 0) return rc;
    for (int64_t r = 0; r < m; ++r) {
        float top = -INFINITY;
        int64_t first = 0;
        for (int tid = 0; tid < nt; ++tid)
            for (int j = 0; j < 16; ++j) {
                const float v = best[(tid * m + r) * 16 + j];
                const int64_t col = static_cast<int64_t>(at[(tid * m + r) * 16 + j]) * 16 + j;
                if (v > top || (v == top && col < first)) { top = v; first = col; }
            }
        out[r] = first;
    }
    return 0;
}

}  // namespace
#endif

extern "C" {

int weir_gemv_supported() {
    int bits = 0;
#if defined(__AVX512BF16__) || defined(WEIR_GEMV_AVX2)
    bits |= 1;
#endif
#if defined(WEIR_GEMV_AVX2)
    bits |= 2;
#endif
    return bits;
}

// x [m, k] bf16 rows ldx apart; wp packed [n/16][k/2][16][2]; bias [n] or null; y [m, n].
// n % 16 == 0, k % 2 == 0, m >= 0 (m == 0: nothing to do, e.g. the lm_head of a step in
// which no row samples). Returns 0, or -1 if unsupported.
int weir_gemv_bf16(const uint16_t* x, int64_t ldx, const uint16_t* wp, const uint16_t* bias,
                   uint16_t* y, int64_t m, int64_t n, int64_t k, int threads) {
#if defined(__AVX512BF16__)
    if (n % 16 || k % 2 || m < 0) return -1;
    if (m == 0) return 0;
    const int64_t blocks = n / 16, kp = k / 2;
    // items of up to kItemBlocks neighbouring blocks, as many as a multiple of the threads
    // (so each thread gets the same number of blocks, +-1 per item)
    const int64_t t = blocks > 4 ? threads : 1;
    int64_t items = (blocks + kItemBlocks - 1) / kItemBlocks;
    items = (items + t - 1) / t * t;
    if (items > blocks) items = blocks;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 4)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t b0 = blocks * it / items, nb = blocks * (it + 1) / items - b0;
        for (int64_t m0 = 0; m0 < m; m0 += kMaxRows) {
            const int64_t mm = m - m0 < kMaxRows ? m - m0 : kMaxRows;
            item_blocks<kItemBlocks>(nb, mm, x + m0 * ldx, ldx, wp + b0 * kp * 32, kp,
                                     bias ? bias + b0 * 16 : nullptr, y + m0 * n + b0 * 16, n);
        }
    }
    return 0;
#elif defined(WEIR_GEMV_AVX2)
    if (n % 16 || k % 2 || m < 0) return -1;
    if (m == 0) return 0;
    const int64_t kp = k / 2;
    const float* xf = widened(x, ldx, m, k);
    blocks(Bf16Blocks{kp}, xf, k, wp, kp * 32, bias, y, m, n, threads);
    return 0;
#else
    (void)x; (void)ldx; (void)wp; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)threads;
    return -1;
#endif
}

// x [m, k] float32 rows ldx apart; wp packed [n/16][k][16]; bias [n] or null; y [m, n].
// n % 16 == 0, m >= 0. Returns 0, or -1 if unsupported.
int weir_gemv_f32(const float* x, int64_t ldx, const float* wp, const float* bias, float* y,
                  int64_t m, int64_t n, int64_t k, int threads) {
#if defined(WEIR_GEMV_AVX2)
    if (n % 16 || m < 0) return -1;
    if (m == 0) return 0;
    blocks(F32Blocks{k}, x, ldx, wp, k * 16, bias, y, m, n, threads);
    return 0;
#else
    (void)x; (void)ldx; (void)wp; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)threads;
    return -1;
#endif
}

// weir_gemv_bf16 on AMX tiles: the same arguments and packed weights; k % 32 == 0 too.
// Returns 0, or -1 where the CPU, the build or the shape does not allow it.
int weir_gemm_amx_bf16(const uint16_t* x, int64_t ldx, const uint16_t* wp, const uint16_t* bias,
                       uint16_t* y, int64_t m, int64_t n, int64_t k, int threads) {
#if defined(WEIR_GEMM_AMX)
    return gemm_amx(x, ldx, wp, bias, y, m, n, k, threads);
#else
    (void)x; (void)ldx; (void)wp; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)threads;
    return -1;
#endif
}

// weir_gemm_amx_bf16's logits, reduced to each row's greedy token: out [m] int64, the
// first index of the row's maximum (as torch.argmax of weir_gemm_amx_bf16_f32's output).
int weir_gemm_amx_bf16_argmax(const uint16_t* x, int64_t ldx, const uint16_t* wp,
                              const uint16_t* bias, int64_t* out, int64_t m, int64_t n,
                              int64_t k, int threads) {
#if defined(WEIR_GEMM_AMX)
    return gemm_amx_argmax(x, ldx, wp, bias, out, m, n, k, threads);
#else
    (void)x; (void)ldx; (void)wp; (void)bias; (void)out; (void)m; (void)n; (void)k;
    (void)threads;
    return -1;
#endif
}

// weir_gemm_amx_bf16 with y [m, n] float32: each output rounded to bf16, then widened.
int weir_gemm_amx_bf16_f32(const uint16_t* x, int64_t ldx, const uint16_t* wp,
                           const uint16_t* bias, float* y, int64_t m, int64_t n, int64_t k,
                           int threads) {
#if defined(WEIR_GEMM_AMX)
    return gemm_amx(x, ldx, wp, bias, y, m, n, k, threads);
#else
    (void)x; (void)ldx; (void)wp; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)threads;
    return -1;
#endif
}

// The gate_up linear with SiLU x up fused, on AMX tiles: wp packs [gate; up] (2 * inter
// rows) as weir_gemm_amx_bf16's; y [m, inter] = silu(g) * u, g and u each rounded to bf16
// first, so the result is exactly weir_gemm_amx_bf16 then weir_silu_mul (bf16), without
// the [m, 2 * inter] intermediate or a second pass. Each gate block is paired with its up
// block (inter / 16 blocks further) in the tile multiplies. inter % 16 == 0, k % 32 == 0.
// Returns 0, or -1 where the CPU, the build or the shape does not allow it.
int weir_gemm_amx_bf16_silu_mul(const uint16_t* x, int64_t ldx, const uint16_t* wp,
                                uint16_t* y, int64_t m, int64_t inter, int64_t k, int threads) {
#if defined(WEIR_GEMM_AMX)
    if (inter % 16 || k % 32 || m < 0 || !weir_amx_supported()) return -1;
    if (m == 0) return 0;
    const int64_t half = inter / 16, kp = k / 2, ksteps = k / 32;
    const int64_t mpad = (m + 15) / 16 * 16;
    int64_t lda = ldx;
    const uint16_t* a = whole_tiles(x, lda, m, k);
    const int t = half > 2 ? threads : 1;
#pragma omp parallel num_threads(t)
    {
        weir::amx_configure();
        alignas(64) float c[4 * 256];
#pragma omp for schedule(static)
        for (int64_t b = 0; b < half; ++b) {
            const uint16_t* wb = wp + b * kp * 32;
            for (int64_t m0 = 0; m0 < mpad; m0 += 32) {
                const int mt = mpad - m0 >= 32 ? 2 : 1;
                if (mt == 2) amx_block<2, 2>(a + m0 * lda, lda, wb, half * kp * 32, ksteps, c);
                else amx_block<1, 2>(a + m0 * lda, lda, wb, half * kp * 32, ksteps, c);
                const int64_t rows = m - m0 < mt * 16 ? m - m0 : mt * 16;
                for (int64_t r = 0; r < rows; ++r) {
                    const float* cr = c + (r / 16) * 2 * 256 + (r % 16) * 16;
                    const __m512 g = weir::round_bf16(_mm512_load_ps(cr));
                    const __m512 u = weir::round_bf16(_mm512_load_ps(cr + 256));
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + r) * inter + b * 16),
                                        weir::bf16_16(weir::silu_mul16(g, u, true)));
                }
            }
        }
        _tile_release();
    }
    return 0;
#else
    (void)x; (void)ldx; (void)wp; (void)y; (void)m; (void)inter; (void)k; (void)threads;
    return -1;
#endif
}

}
