// fp8 KV cache elements (the opt-in kv.dtype "fp8_e4m3" / "fp8_e5m2"): one byte per key or
// value element instead of two, so a decode step reads half the KV bytes and the pool holds
// twice the tokens. Formats are OCP's: E4M3 (torch.float8_e4m3fn: bias 7, no infinities,
// 0x7f NaN, largest 448) and E5M2 (torch.float8_e5m2: bias 15, largest finite 57344).
//
// Writing rounds to nearest even and saturates to the largest finite value, which is what
// torch's `x.clamp(-max, max).to(float8_*)` stores (kernels/kv_cache.py: quantize), bit for
// bit, for float32 and bf16 inputs: normal results by integer rounding of the float32 bits,
// subnormal ones by scaling to the subnormal step and rounding to an integer.
//
// Reading never leaves the vector registers' own conversions: an E5M2 byte shifted into the
// top of a 16-bit word is the same value in fp16, and an E4M3 byte's magnitude shifted to
// bits 7..13 (its sign to 15) is the value times 2^-8 in fp16 (subnormals included), so
// vcvtph2ps widens either exactly; E4M3 then scales by 256. The values fit bf16 exactly.
#pragma once
#include "cpu_common.h"     // load, load16: float32 and bf16 widened alike
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace weir {

struct fp8_e4m3 { uint8_t bits; };
struct fp8_e5m2 { uint8_t bits; };

template <typename F> struct Fp8Format;
template <> struct Fp8Format<fp8_e4m3> {
    static constexpr int mant = 3, bias = 7;
    static constexpr uint32_t max_code = 0x7e;          // 448
    static constexpr float min_normal = 0x1p-6f, sub_step_inv = 0x1p9f;
};
template <> struct Fp8Format<fp8_e5m2> {
    static constexpr int mant = 2, bias = 15;
    static constexpr uint32_t max_code = 0x7b;          // 57344
    static constexpr float min_normal = 0x1p-14f, sub_step_inv = 0x1p16f;
};
template <typename T> constexpr bool is_fp8 = false;
template <> constexpr bool is_fp8<fp8_e4m3> = true;
template <> constexpr bool is_fp8<fp8_e5m2> = true;

// x as an fp8 code, round to nearest even, saturated; NaN stays NaN
template <typename F> inline uint8_t fp8_encode(float x) {
    using Fm = Fp8Format<F>;
    constexpr int shift = 23 - Fm::mant;
    uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    const uint32_t sign = (b >> 24) & 0x80u, a = b & 0x7fffffffu;
    if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
    float ax;
    std::memcpy(&ax, &a, sizeof ax);
    uint32_t code;
    if (ax < Fm::min_normal) {
        code = static_cast<uint32_t>(std::nearbyint(ax * Fm::sub_step_inv));
    } else {
        const uint32_t r = (a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u)) >> shift;
        code = r - ((127u - Fm::bias) << Fm::mant);
    }
    return static_cast<uint8_t>(sign | (code > Fm::max_code ? Fm::max_code : code));
}

// The 256 values of a format (the portable kernel's widening: one lookup per element)
template <typename F> inline const std::array<float, 256>& fp8_table() {
    static const std::array<float, 256> table = [] {
        using Fm = Fp8Format<F>;
        std::array<float, 256> t{};
        for (int c = 0; c < 256; ++c) {
            const int mag = c & 0x7f, e = mag >> Fm::mant, m = mag & ((1 << Fm::mant) - 1);
            float v = e == 0 ? std::ldexp(static_cast<float>(m), 1 - Fm::bias - Fm::mant)
                             : std::ldexp(1.0f + std::ldexp(static_cast<float>(m), -Fm::mant),
                                          e - Fm::bias);
            if (Fm::mant == 3 && mag == 0x7f) v = NAN;
            if (Fm::mant == 2 && e == 31) v = m == 0 ? INFINITY : NAN;
            t[c] = c & 0x80 ? -v : v;
        }
        return t;
    }();
    return table;
}
inline float load(const fp8_e4m3* p, int64_t i) { return fp8_table<fp8_e4m3>()[p[i].bits]; }
inline float load(const fp8_e5m2* p, int64_t i) { return fp8_table<fp8_e5m2>()[p[i].bits]; }

#if defined(__AVX512F__)
// 16 codes widened to float32, exactly
inline __m512 load16(const fp8_e5m2* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
}
inline __m512 load16(const fp8_e4m3* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                       _mm256_set1_epi16(static_cast<short>(0xbf80)));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}
// 16 codes as 16 bf16 (exact: an fp8 value has at most 4 significant bits)
template <typename F> inline __m256i fp8_bf16_16(const F* p) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(load16(p)), 16));
}
#if defined(__AVX512BF16__)
// The forms the bf16 dot products read (vdpbf16ps, AMX tdpbf16ps): 32 codes as bf16 of
// their value times 2^-S, which the kernels undo for free (the scores' scale times 2^S; the
// probabilities times 2^S before they meet the values: fp8_rescale).
// E5M2, 3 instructions per 32 codes where the exact widening takes 9: the byte,
// sign-extended and shifted left 5, masked to its sign and its 7 magnitude bits, is a bf16
// whose exponent field is E5M2's own, the value times 2^-112. Its subnormals (below 2^-14)
// become bf16 denormals, which those instructions read as zero (as they flush products
// below 2^-126: |q.k| terms below 2^-14).
// E4M3 exactly (S = 0), by integer arithmetic on 16-bit lanes: its normal values are bf16's
// with the exponent rebiased, its 8 zero-exponent codes come from a table (vpermw); ~7
// instructions per 32 where fp16 and vcvtne2ps2bf16 took ~10 (with the AMX kernel, compute
// alone over 30 layers: 8.3 ms by fp16).
inline __m512i fp8_scaled_bf16_32(const fp8_e5m2* p) {
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_and_si512(_mm512_slli_epi16(w, 5), _mm512_set1_epi16(static_cast<short>(0x8fe0)));
}
inline __m512i fp8_scaled_bf16_32(const fp8_e4m3* p) {
    // normal codes by integer arithmetic: magnitude << 4 plus the exponent's rebias (120 << 7);
    // the 8 codes with a zero exponent (subnormals, and zero) from a table by vpermw
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7f));
    const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3c00));
    const __m512i sub_table = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0x3c60, 0x3c40, 0x3c20, 0x3c00, 0x3bc0, 0x3b80, 0x3b00, 0);   // m x 2^-9, m = 7 .. 0
    const __m512i v = _mm512_mask_permutexvar_epi16(
        normal, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag, sub_table);
    return _mm512_or_si512(v, _mm512_and_si512(w, _mm512_set1_epi16(static_cast<short>(0x8000))));
}
#endif
template <typename T> constexpr float fp8_rescale = 1.0f;
template <> constexpr float fp8_rescale<fp8_e5m2> = 0x1p112f;

// 16 float32 as codes (fp8_encode's arithmetic, 16 lanes)
template <typename F> inline __m128i fp8_encode16(__m512 x) {
    using Fm = Fp8Format<F>;
    constexpr int shift = 23 - Fm::mant;
    const __m512i b = _mm512_castps_si512(x);
    const __m512i a = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff));
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(b, 24), _mm512_set1_epi32(0x80));
    __m512i r = _mm512_add_epi32(a, _mm512_set1_epi32((1 << (shift - 1)) - 1));
    r = _mm512_add_epi32(r, _mm512_and_si512(_mm512_srli_epi32(a, shift), _mm512_set1_epi32(1)));
    r = _mm512_sub_epi32(_mm512_srli_epi32(r, shift),
                         _mm512_set1_epi32((127 - Fm::bias) << Fm::mant));
    const __m512 ax = _mm512_castsi512_ps(a);
    const __m512i s = _mm512_cvtps_epi32(_mm512_mul_ps(ax, _mm512_set1_ps(Fm::sub_step_inv)));
    __m512i code = _mm512_mask_blend_epi32(
        _mm512_cmp_ps_mask(ax, _mm512_set1_ps(Fm::min_normal), _CMP_LT_OQ), r, s);
    code = _mm512_min_epu32(code, _mm512_set1_epi32(static_cast<int>(Fm::max_code)));
    code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000)),
                                 _mm512_set1_epi32(0x7f));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign));
}
#endif

// One row of n float32 or bf16 elements as fp8 codes (the KV writes: weir_write_kv_fp8,
// weir_rope_write_kv)
template <typename F, typename S> inline void fp8_encode_row(const S* src, F* dst, int64_t n) {
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= n; d += 16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), fp8_encode16<F>(load16(src + d)));
#endif
    for (; d < n; ++d) dst[d].bits = fp8_encode<F>(load(src, d));
}

#if defined(__AVX2__) && defined(__F16C__)
// 8 codes widened to float32, exactly (the AVX2 kernel)
inline __m256 load8(const fp8_e5m2* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
}
inline __m256 load8(const fp8_e4m3* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7),
                                    _mm_set1_epi16(static_cast<short>(0xbf80)));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}
#endif

}  // namespace weir
