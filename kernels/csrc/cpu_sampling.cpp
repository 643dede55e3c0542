// Token sampling for the CPU, one row per work item (OpenMP over rows): temperature, then
// top-k, then top-p on the renormalised survivors, then a draw: a seeded row's by the
// exponential race (race(), below), other rows' inverse-CDF with the row's uniform u in
// (0, 1]. Same semantics as components/executor/sampling.py's torch path.
//
// Unfiltered rows never sort: one pass for the max, one for the sum of exp, and a scan in
// vocabulary order that stops where the running mass reaches u * sum.
//
// A filtered row (top-k and/or top-p) sorts only candidates. Each token falls in a bucket
// by its distance below the max, (max - x) / T, kWidth nats wide (kBuckets of them, the
// last taking the rest). The buckets nearest the max, up to the first that brings the
// count to k (top-k) or the mass to p of the total (top-p alone), plus one bucket of
// margin against rounding, hold every survivor: tokens of one bucket are within e^kWidth
// of each other in probability, so the candidates are the top tokens exactly, ties and
// all. The histogram is taken over the tokens within 4 nats of the max (one vector pass
// gathers them), then 10, then 15.75, then all, until those buckets suffice. Top-k then
// selects its k among the candidates, and top-p applies within the sorted survivors.
// Real logits are peaked: a few to a few hundred candidates, against an nth_element over
// all 49k indices before. SmolLM2's own logits, 64 rows, T 0.8, on a 2-core AVX2 EPYC:
// top-p 0.9 35.8 -> 3.4 ms, top-k 50 35.6 -> 6.4 ms. A flat row (survivors spread past
// 15.75 nats) sorts the vocabulary, as before.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "cpu_common.h"

namespace {

using weir::exp_neg;

constexpr int kBuckets = 64;
constexpr float kWidth = 0.25f;                         // nats: the buckets span 16 nats

// The bucket of a token at distance d = (max - x) / T >= 0; NaN and far ones in the last.
inline int bucket_of(float d) {
    return d < (kBuckets - 1) * kWidth ? static_cast<int>(d * (1.0f / kWidth)) : kBuckets - 1;
}

// e[i] = exp((x[i] - m) / T) over a row, and their sum. GCC leaves the plain loop over
// exp_neg scalar on AVX2 ("control flow in loop"), so each vector width has its own body
// (64 rows × 49k at T = 1 on a 2-core AVX2 EPYC: 10.3 -> 2.5 ms). The lanes' float sums
// go into a double every 64 vectors, so no float sum runs longer than 64 terms: the total
// is what the draw's target is a fraction of (see scan_to).
float exp_row(const float* x, float m, float inv_t, float* e, int64_t n) {
    int64_t i = 0;
    double total = 0.0;
#if defined(__AVX512F__)
    const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(inv_t);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 v = weir::exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm), vt));
        _mm512_storeu_ps(e + i, v);
        acc = _mm512_add_ps(acc, v);
        if ((i & 1023) == 1008) {
            total += _mm512_reduce_add_ps(acc);
            acc = _mm512_setzero_ps();
        }
    }
    total += _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = weir::exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm), vt));
        _mm256_storeu_ps(e + i, v);
        acc = _mm256_add_ps(acc, v);
        if ((i & 511) == 504) {
            total += weir::hadd8(acc);
            acc = _mm256_setzero_ps();
        }
    }
    total += weir::hadd8(acc);
#endif
    for (; i < n; ++i) {
        e[i] = exp_neg((x[i] - m) * inv_t);
        total += e[i];
    }
    return static_cast<float>(total);
}

// idx = the row's tokens in buckets below `limit`, in vocabulary order (all of them when
// limit is kBuckets). bucket_of(d) < limit <=> d / kWidth < limit (d >= 0, and limit <
// kBuckets), so the vector compare agrees exactly with bucket_of.
void gather_below(const float* x, float m, float inv_t, int limit, int64_t n,
                  std::vector<int32_t>& idx) {
    idx.resize(static_cast<size_t>(n));
    if (limit >= kBuckets) {
        std::iota(idx.begin(), idx.end(), 0);
        return;
    }
    int64_t held = 0, i = 0;
#if defined(__AVX512F__)
    const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(inv_t),
                 vw = _mm512_set1_ps(1.0f / kWidth),
                 vb = _mm512_set1_ps(static_cast<float>(limit));
    for (; i + 16 <= n; i += 16) {
        const __m512 d = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(vm, _mm512_loadu_ps(x + i)),
                                                     vt), vw);
        for (uint32_t bits = _mm512_cmp_ps_mask(d, vb, _CMP_LT_OQ); bits; bits &= bits - 1)
            idx[held++] = static_cast<int32_t>(i + __builtin_ctz(bits));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t),
                 vw = _mm256_set1_ps(1.0f / kWidth),
                 vb = _mm256_set1_ps(static_cast<float>(limit));
    for (; i + 8 <= n; i += 8) {
        const __m256 d = _mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(vm, _mm256_loadu_ps(x + i)),
                                                     vt), vw);
        for (uint32_t bits = _mm256_movemask_ps(_mm256_cmp_ps(d, vb, _CMP_LT_OQ)); bits;
             bits &= bits - 1)
            idx[held++] = static_cast<int32_t>(i + __builtin_ctz(bits));
    }
#endif
    for (; i < n; ++i)
        if (bucket_of((m - x[i]) * inv_t) < limit) idx[held++] = static_cast<int32_t>(i);
    idx.resize(static_cast<size_t>(held));
}

// A seeded row's uniform for token t, in (0, 1): a 32-bit hash of the row's key (from the
// seed and the output index) and t, its top 23 bits at their midpoint: 2^-24 .. 1 - 2^-24,
// exact in float32 (24 bits would round their top to 1, where -log u is 0 and any token,
// however unlikely, would win), and the same bits in components/executor/sampling.py's
// torch path (_race_uniforms).
inline float race_uniform(uint32_t key, int64_t t) {
    uint32_t h = key + static_cast<uint32_t>(t) * 0x9E3779B1u;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return (static_cast<float>(h >> 9) + 0.5f) * (1.0f / 8388608.0f);
}

// A seeded draw: the exponential race (Gumbel-max). Token t's score is (x_t - m) / T -
// log(-log u_t), u_t its hashed uniform; the highest wins (ties: the lower id), which draws
// t with probability e_t / sum(e): the softmax, as the inverse-CDF draw does. Unlike that
// draw, a last-bit change of the logits moves it only where two scores tie within it (the
// inverse-CDF draw moves wherever its one uniform lands within the cumulative sums' change
// of a boundary: seen in the long tail, between a prompt computed and read from the cache).
// Exact, and few logs: -log u >= 1 - u >= 2^-24, so a token cannot beat the best score s
// unless e_t > e^s (1 - u_t), nor at all unless e_t > e^s 2^-24; only those are scored (a
// 1e-3 margin covers exp_row's fast exp). ``cand`` (null: the whole vocabulary) lists the
// candidates, ``first`` one of the most likely.
int64_t race(const float* x, const float* e, float m, float inv_t, const int32_t* cand,
             int64_t n, int64_t first, uint64_t key64) {
    const uint32_t key = static_cast<uint32_t>(key64 ^ (key64 >> 32));
    auto score = [&](int64_t t) {
        return (x[t] - m) * inv_t - std::log(-std::log(race_uniform(key, t)));
    };
    int64_t best_t = first;
    float best = score(first), bar = std::exp(best) * 0.999f;
    auto consider = [&](int64_t t, float u) {
        const float s = (x[t] - m) * inv_t - std::log(-std::log(u));
        if (t != first && (s > best || (s == best && t < best_t))) {
            best = s;
            best_t = t;
            bar = std::exp(best) * 0.999f;
        }
    };
    int64_t j = 0;
    if (cand == nullptr) {
        // the whole vocabulary, 16 (8) tokens a step: the bound on e alone, then the hash
        // and the bound with u, in vector registers; scalar work only for what passes
        // (64 rows of SmolLM2's logits at T 1, 2-core AVX512 EPYC: 9.2 ms scalar)
#if defined(__AVX512F__)
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                               14, 15);
        const __m512i vkey = _mm512_set1_epi32(static_cast<int>(key));
        for (; j + 16 <= n; j += 16) {
            const __m512 ve = _mm512_loadu_ps(e + j);
            const __mmask16 near = _mm512_cmp_ps_mask(ve, _mm512_set1_ps(bar * 5.9604645e-8f),
                                                      _CMP_GT_OQ);
            if (!near) continue;
            __m512i h = _mm512_add_epi32(vkey, _mm512_mullo_epi32(
                _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j)), lane),
                _mm512_set1_epi32(static_cast<int>(0x9E3779B1u))));
            h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
            h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
            h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
            h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0xC2B2AE35u)));
            h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
            const __m512 u = _mm512_mul_ps(
                _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 9)), _mm512_set1_ps(0.5f)),
                _mm512_set1_ps(1.0f / 8388608.0f));
            alignas(64) float us[16];
            _mm512_store_ps(us, u);
            const __m512 gap = _mm512_mul_ps(_mm512_set1_ps(bar),
                                             _mm512_sub_ps(_mm512_set1_ps(1.0f), u));
            for (uint32_t bits = near & _mm512_cmp_ps_mask(ve, gap, _CMP_GT_OQ); bits;
                 bits &= bits - 1) {
                const int b = __builtin_ctz(bits);
                consider(j + b, us[b]);
            }
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i vkey = _mm256_set1_epi32(static_cast<int>(key));
        for (; j + 8 <= n; j += 8) {
            const __m256 ve = _mm256_loadu_ps(e + j);
            const int near = _mm256_movemask_ps(
                _mm256_cmp_ps(ve, _mm256_set1_ps(bar * 5.9604645e-8f), _CMP_GT_OQ));
            if (!near) continue;
            __m256i h = _mm256_add_epi32(vkey, _mm256_mullo_epi32(
                _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j)), lane),
                _mm256_set1_epi32(static_cast<int>(0x9E3779B1u))));
            h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
            h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
            h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
            h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0xC2B2AE35u)));
            h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
            const __m256 u = _mm256_mul_ps(
                _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 9)), _mm256_set1_ps(0.5f)),
                _mm256_set1_ps(1.0f / 8388608.0f));
            alignas(32) float us[8];
            _mm256_store_ps(us, u);
            const __m256 gap = _mm256_mul_ps(_mm256_set1_ps(bar),
                                             _mm256_sub_ps(_mm256_set1_ps(1.0f), u));
            for (uint32_t bits = static_cast<uint32_t>(near & _mm256_movemask_ps(
                     _mm256_cmp_ps(ve, gap, _CMP_GT_OQ))); bits; bits &= bits - 1) {
                const int b = __builtin_ctz(bits);
                consider(j + b, us[b]);
            }
        }
#endif
    }
    for (; j < n; ++j) {
        const int64_t t = cand ? cand[j] : j;
        if (t == first || e[t] <= bar * 5.9604645e-8f) continue;
        const float u = race_uniform(key, t);
        if (e[t] > bar * (1.0f - u)) consider(t, u);
    }
    return best_t;
}

// The row's maximum (a value; finite logits), 16 or 8 lanes at a time: the scalar loop
// that also tracked its index ran one compare-and-branch per token (~30 us a row).
float row_max(const float* x, int64_t n) {
    int64_t i = 0;
    float m = x[0];
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 vm = _mm512_loadu_ps(x);
        for (i = 16; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + i));
        m = _mm512_reduce_max_ps(vm);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (n >= 8) {
        __m256 vm = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + i));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        m = _mm_cvtss_f32(h);
    }
#endif
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

// The first index i at which e[0] + ... + e[i] >= target (n - 1 if none): the running sum
// taken a vector at a time (16 or 8: each block's lanes summed, then added), then token by
// token inside the block it crosses in, instead of one dependent add per token over up to
// the whole vocabulary (~35 us a row). The order of the additions is not the one-by-one
// order, so a draw at a boundary may land one token over: the distribution is the same.
// The running sum is a double: a float one over 49k tokens drifted 1.6e-5 of the total
// from the exact cumulative sum on an AVX2 EPYC (the scalar scan, 49k dependent adds); the
// dependent add costs the same in either width.
int64_t scan_to(const float* e, int64_t n, float target) {
    int64_t i = 0;
    double acc = 0.0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const double block = _mm512_reduce_add_ps(_mm512_loadu_ps(e + i));
        if (acc + block >= target) break;
        acc += block;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) {
        const double block = weir::hadd8(_mm256_loadu_ps(e + i));
        if (acc + block >= target) break;
        acc += block;
    }
#endif
    for (; i < n; ++i) {
        acc += e[i];
        if (acc >= target) return i;
    }
    return n - 1;
}

// key < 0: the inverse-CDF draw at u; key >= 0: the race seeded by key.
int64_t sample_row(const float* x, int64_t vocab, float temp, int64_t top_k, float top_p,
                   float u, int64_t key) {
    const float inv_t = 1.0f / temp;
    const float m = row_max(x, vocab);
    const int64_t k = (top_k <= 0 || top_k > vocab) ? vocab : top_k;
    thread_local std::vector<float> e;
    e.resize(static_cast<size_t>(vocab));
    const float total = exp_row(x, m, inv_t, e.data(), vocab);
    if (k == vocab && top_p >= 1.0f && key >= 0) {
        const int64_t at_max = std::find(x, x + vocab, m) - x;     // the first maximum
        return race(x, e.data(), m, inv_t, nullptr, vocab, at_max, static_cast<uint64_t>(key));
    }
    if (k == vocab && top_p >= 1.0f)                    // plain: scan in vocabulary order
        return scan_to(e.data(), vocab, u * total);
    // the candidates: the tokens in the buckets up to the first reaching k tokens (top-k)
    // or p of the mass (top-p alone), and one more; looked for among the tokens within 4,
    // then 10, then 15.75 nats of the max, then all (SmolLM2's top 50 reach 3-15 nats)
    thread_local std::vector<int32_t> idx;
    for (int limit : {16, 40, kBuckets - 1, kBuckets}) {
        gather_below(x, m, inv_t, limit, vocab, idx);
        float mass_in[kBuckets] = {};
        int64_t count_in[kBuckets] = {};
        for (int32_t i : idx) {
            const int b = bucket_of((m - x[i]) * inv_t);
            mass_in[b] += e[i];
            count_in[b] += 1;
        }
        int cut = -1;
        float mass_upto = 0.0f;
        int64_t count_upto = 0;
        for (int b = 0; b + 1 < limit; ++b) {           // the margin bucket must be held too
            mass_upto += mass_in[b];
            count_upto += count_in[b];
            if (k < vocab ? count_upto >= k : mass_upto >= top_p * total) {
                cut = b + 1;
                break;
            }
        }
        if (cut < 0 && limit < kBuckets) continue;      // not within this distance: wider
        if (cut >= 0 && cut + 1 < limit)
            idx.erase(std::remove_if(idx.begin(), idx.end(), [&](int32_t i) {
                          return bucket_of((m - x[i]) * inv_t) > cut; }), idx.end());
        break;
    }
    auto higher = [&](int32_t a, int32_t b) { return e[a] > e[b] || (e[a] == e[b] && a < b); };
    const int64_t held = static_cast<int64_t>(idx.size());
    const int64_t c = std::min(k, held);                // top-k: k; top-p alone: them all
    if (c < held)
        std::nth_element(idx.begin(), idx.begin() + (c - 1), idx.end(), higher);
    std::sort(idx.begin(), idx.begin() + c, higher);
    float mass = 0.0f;                                  // renormaliser: top-k survivors or all
    if (k < vocab)
        for (int64_t i = 0; i < c; ++i) mass += e[idx[i]];
    else
        mass = total;
    int64_t n = c;                                      // nucleus: drop once `before` >= p
    if (top_p < 1.0f) {
        float before = 0.0f;
        for (int64_t i = 0; i < c; ++i) {
            if (i > 0 && before >= top_p * mass) { n = i; break; }
            before += e[idx[i]];
        }
    }
    if (key >= 0)
        return race(x, e.data(), m, inv_t, idx.data(), n, idx[0], static_cast<uint64_t>(key));
    float nucleus = 0.0f;
    for (int64_t i = 0; i < n; ++i) nucleus += e[idx[i]];
    const float target = u * nucleus;
    float acc = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        acc += e[idx[i]];
        if (acc >= target) return idx[i];
    }
    return idx[n - 1];
}

}  // namespace

extern "C" {

// logits [rows, vocab] float32, contiguous; every row has temperature > 0. A row with
// keys[r] >= 0 is seeded: the race; else the inverse-CDF draw at u[r].
void weir_sample(const float* logits, int64_t rows, int64_t vocab, const float* temperature,
                 const int64_t* top_k, const float* top_p, const float* u, const int64_t* keys,
                 int64_t* out, int num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r)
        out[r] = sample_row(logits + r * vocab, vocab, temperature[r], top_k[r], top_p[r], u[r],
                            keys[r]);
}

}

extern "C" {

// Greedy: the first index of each row's maximum (as torch.argmax), rows in parallel. NaN
// rows are not special-cased: logits of a finite model are finite.
void weir_argmax(const float* logits, int64_t rows, int64_t vocab, int64_t* out,
                 int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const float* x = logits + r * vocab;
        // vectorizable max, then the first position that holds it
        float m = x[0];
#pragma omp simd reduction(max : m)
        for (int64_t i = 0; i < vocab; ++i) m = x[i] > m ? x[i] : m;
        int64_t at = 0;
        while (at < vocab - 1 && x[at] != m) ++at;
        out[r] = at;
    }
}

}

extern "C" {

// Logprobs of each row's distribution: lse[r] = log sum exp(x) (so a token's
// log-probability is x - lse), and the k largest logits with their first
// positions, largest first, ties to the earlier index (as torch.topk on distinct values).
// One pass keeps the max and the running top k (a token below the k-th is one compare),
// one vector pass sums exp(x - max). Logprobs of 64 x 49k rows at k = 5 on a 2-core AVX2
// EPYC, both halves of components/executor/sampling.py's Logprobs: 2.7 ms, 7.5 in torch.
void weir_logprobs(const float* logits, int64_t rows, int64_t vocab, int64_t k, float* lse,
                   int64_t* top_ids, float* top_vals, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows > 1)
    {
        std::vector<float> e(static_cast<size_t>(vocab));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const float* x = logits + r * vocab;
            float m = x[0];
#pragma omp simd reduction(max : m)
            for (int64_t i = 0; i < vocab; ++i) m = x[i] > m ? x[i] : m;
            lse[r] = m + std::log(exp_row(x, m, 1.0f, e.data(), vocab));
            float* tv = top_vals + r * k;
            int64_t* ti = top_ids + r * k;
            int64_t have = 0;
            for (int64_t i = 0; i < vocab && k > 0; ++i) {
                const float v = x[i];
                if (have == k && !(v > tv[k - 1])) continue;
                int64_t j = have < k ? have++ : k - 1;        // the slot it may take
                while (j > 0 && v > tv[j - 1]) {
                    tv[j] = tv[j - 1];
                    ti[j] = ti[j - 1];
                    --j;
                }
                tv[j] = v;
                ti[j] = i;
            }
            for (int64_t j = have; j < k; ++j) {               // vocab < k: pad
                tv[j] = -INFINITY;
                ti[j] = 0;
            }
        }
    }
}

}

extern "C" {

// Structured output's masks: in row rows[j] of logits [*, vocab] (float32, contiguous),
// every token whose bit is clear in mask j to -inf. masks [n, words] of 32-bit words,
// token t is bit t % 32 of word t / 32 (llguidance's layout); words * 32 >= vocab. A word
// of all ones (every token allowed) is skipped, one of all zeros written whole: most of a
// language's vocabulary is one or the other. 64 x 49k rows: ~0.3 ms on 2 cores, where
// unpacking the bits and a masked fill through torch took ~20.
void weir_apply_bitmask(float* logits, int64_t vocab, const int32_t* masks, int64_t words,
                        const int64_t* rows, int64_t n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n > 1)
    for (int64_t j = 0; j < n; ++j) {
        float* x = logits + rows[j] * vocab;
        const uint32_t* m = reinterpret_cast<const uint32_t*>(masks + j * words);
        for (int64_t w = 0; w * 32 < vocab; ++w) {
            const uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32, end = vocab - base < 32 ? vocab - base : 32;
            for (int64_t b = 0; b < end; ++b)
                if (!((bits >> b) & 1u)) x[base + b] = -INFINITY;
        }
    }
}

}
