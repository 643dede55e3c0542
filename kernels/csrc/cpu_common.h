// Helpers shared by Weir's native CPU kernels: bf16 widening/narrowing, a branch-free
// exp that vectorizes, and their AVX-512 and AVX2 forms.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace weir {

// The cache row (slot) of key u of a sequence: table[u / bs] * bs + u % bs, by a shift and
// a mask where bs is a power of two (all block sizes but multiples of 256 such as 768).
inline int64_t slot_of(const int32_t* table, int64_t bs, int64_t u) {
    if ((bs & (bs - 1)) == 0) {
        const int sh = __builtin_ctzll(static_cast<unsigned long long>(bs));
        return (static_cast<int64_t>(table[u >> sh]) << sh) | (u & (bs - 1));
    }
    return static_cast<int64_t>(table[u / bs]) * bs + u % bs;
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
    uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) {   // round to nearest even; branch-free
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    const uint16_t r = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    p[i] = (bits & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>(0x7fc0) : r;   // NaN
}

// exp(x) = 2^n exp(r), n = round(x log2 e), r = x - n ln 2 (ln 2 split in two for
// precision), exp(r) = 1 + r + r^2 p(r) with p of degree 5 (coefficients highest first).
// The scalar, AVX-512 and AVX2 forms below share these constants.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = 2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// exp(x) for x <= 0 (softmax arguments), ~2 ulp; 0 below -87.
inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = std::nearbyint(x * kLog2e);
    float r = x - n * kLn2Hi + n * kLn2Lo;
    float p = kExpPoly[0];
    for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
    p = p * r * r + r + 1.0f;
    int32_t e = static_cast<int32_t>(n) + 127;
    uint32_t bits = static_cast<uint32_t>(e < 0 ? 0 : e) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX512F__)
// 16 elements as float32 (bf16 widened: its bits are a float's top half)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
// exp(x) for x in [-87, 88] (clamped): 2^n p(r), the power of two by vscalefps.
inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
    __m512 p = _mm512_set1_ps(kExpPoly[0]);
    for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
// v rounded to bf16 (nearest even; NaN to a quiet NaN): one vcvtneps2bf16 where the CPU
// has AVX512-BF16, else integer rounding
inline __m256i bf16_16(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7fc00000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}
// v rounded to bf16 and widened back: what a bf16 store and load would give
inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_16(v)), 16));
}
// silu(g) * u in float32; with ``bf16`` (g and u are bf16, widened) silu is rounded to
// bf16 first, as torch's bf16 F.silu(gate) * up. sigmoid = 1 / (1 + exp(-g)) by a
// reciprocal estimate and one Newton step (~1 ulp; a vector division costs more than the
// rest together). exp(-g) may be huge (g < -80): the reciprocal is then ~0, as it should
// be. The caller rounds the result to its type. (SiLU x up and the AMX gate_up linear's
// fused form both call this, so they agree to the bit.)
inline __m512 silu_mul16(__m512 g, __m512 u, bool bf16) {
    const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f),
                                     exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    const __m512 r0 = _mm512_rcp14_ps(den);
    const __m512 sig = _mm512_mul_ps(r0, _mm512_fnmadd_ps(den, r0, _mm512_set1_ps(2.0f)));
    const __m512 silu = _mm512_mul_ps(g, sig);
    return _mm512_mul_ps(bf16 ? round_bf16(silu) : silu, u);
}
#endif

// (also built where AVX-512 is: the small-batch bf16 linear uses them on CPUs without
// AVX512-BF16)
#if defined(__AVX2__) && defined(__FMA__)
// 8 elements as float32
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// exp(x) for x in [-87, 88] (clamped): 2^n p(r), 2^n built in the exponent bits
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
    __m256 p = _mm256_set1_ps(kExpPoly[0]);
    for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// the sum of v's 8 lanes
inline float hadd8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// v rounded to bf16 (nearest even; NaN to a quiet NaN), as 8 packed uint16
inline __m128i bf16_8(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                             _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                                             _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    r = _mm256_srli_epi32(r, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// AMX (the kernels that use it need AVX512-BF16 beside it): every tile 16 rows x 64 bytes (palette 1). The process must have asked for the
// tile state first (weir_amx_supported: arch_prctl), and each thread configures its own.
struct TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

inline void amx_configure() {
    alignas(64) TileConfig cfg;
    for (int i = 0; i < 8; ++i) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    _tile_loadconfig(&cfg);
}
#endif

}  // namespace weir
