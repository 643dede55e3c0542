// Helpers shared by Weir's native CPU kernels: bf16 widening/narrowing and a branch-free
// exp that vectorizes.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace weir {

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

// exp(x) for x <= 0 (softmax arguments), ~2 ulp; 0 below -87.
inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float log2e = 1.44269504088896341f;
    float n = std::nearbyint(x * log2e);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = static_cast<int32_t>(n) + 127;
    uint32_t bits = static_cast<uint32_t>(e < 0 ? 0 : e) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

}  // namespace weir
