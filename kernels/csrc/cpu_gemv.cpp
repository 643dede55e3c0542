// Small-batch linear layers for bf16 on the CPU: y[M, N] = x[M, K] . W[N, K]^T (+ bias),
// for M up to ~64 (any M works; past ~128 oneDNN's blocked GEMM is as fast). With so few rows a linear layer only streams its weights, and oneDNN's GEMM
// reaches ~15 GB/s of them (30 SmolLM2 layers, M = 1: 14.5 ms for 212 MB) where the
// memory gives ~30. This kernel reads W in a layout packed for it, [N/16][K/2][16][2]:
// one 64-byte load holds 16 outputs x 2 k, so vdpbf16ps against a broadcast pair of x
// accumulates 16 outputs at once — no horizontal sums — and each thread streams its
// contiguous share of the blocks front to back (the hardware prefetcher's best case).
// Built only with AVX512-BF16; weir_gemv_supported() says so at run time.
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

template <int NB>
void rows(int64_t mm, const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t kp,
          const uint16_t* bias, uint16_t* y, int64_t ldy) {
    switch (mm) {
#define WEIR_M(N) case N: block<N, NB>(x, ldx, wp, kp, bias, y, ldy); return;
        WEIR_M(1) WEIR_M(2) WEIR_M(3) WEIR_M(4) WEIR_M(5) WEIR_M(6) WEIR_M(7) WEIR_M(8)
#undef WEIR_M
        default: return;
    }
}

}  // namespace
#endif

extern "C" {

int weir_gemv_supported() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

// x [m, k] bf16 rows ldx apart; wp packed [n/16][k/2][16][2]; bias [n] or null; y [m, n].
// n % 16 == 0, k % 2 == 0, m >= 0 (m == 0: nothing to do, e.g. the lm_head of a step in
// which no row samples). Returns 0, or -1 if unsupported.
int weir_gemv_bf16(const uint16_t* x, int64_t ldx, const uint16_t* wp, const uint16_t* bias,
                   uint16_t* y, int64_t m, int64_t n, int64_t k, int threads) {
#if defined(__AVX512BF16__)
    if (n % 16 || k % 2 || m < 0) return -1;
    if (m == 0) return 0;
    const int64_t blocks = n / 16, kp = k / 2, pairs = (blocks + 1) / 2;
    // two blocks (32 outputs) per item; up to 8 rows of x per pass over them (the blocks
    // stay in L1 for the second pass when m > 8)
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 4)
    for (int64_t pi = 0; pi < pairs; ++pi) {
        const int64_t b0 = 2 * pi, nb = blocks - b0 >= 2 ? 2 : 1;
        for (int64_t m0 = 0; m0 < m; m0 += 8) {
            const int64_t mm = m - m0 < 8 ? m - m0 : 8;
            const uint16_t* xb = x + m0 * ldx;
            const uint16_t* wb = wp + b0 * kp * 32;
            const uint16_t* bb = bias ? bias + b0 * 16 : nullptr;
            uint16_t* yb = y + m0 * n + b0 * 16;
            if (nb == 2) rows<2>(mm, xb, ldx, wb, kp, bb, yb, n);
            else rows<1>(mm, xb, ldx, wb, kp, bb, yb, n);
        }
    }
    return 0;
#else
    (void)x; (void)ldx; (void)wp; (void)bias; (void)y; (void)m; (void)n; (void)k; (void)threads;
    return -1;
#endif
}

}
