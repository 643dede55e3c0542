// Token sampling for the CPU, one row per work item (OpenMP over rows): temperature, then
// top-k, then top-p on the renormalised survivors, then an inverse-CDF draw with the row's
// uniform u in (0, 1]. Same semantics as components/executor/sampling.py's torch path.
//
// Unfiltered rows never sort: one pass for the max, one for the sum of exp, and a scan in
// vocabulary order that stops where the running mass reaches u * sum. A top-k row selects
// its k survivors with nth_element and sorts only those (top-p then applies within them).
// A top-p-only row does the same with C = 1024 candidates, growing C eightfold until they
// hold p of the mass (real logits are peaked: the first try almost always suffices).
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "cpu_common.h"

namespace {

using weir::exp_neg;

constexpr int64_t kCandidates = 1024;

int64_t sample_row(const float* x, int64_t vocab, float temp, int64_t top_k, float top_p,
                   float u) {
    const float inv_t = 1.0f / temp;
    float m = x[0];
    for (int64_t i = 1; i < vocab; ++i) m = x[i] > m ? x[i] : m;
    const int64_t k = (top_k <= 0 || top_k > vocab) ? vocab : top_k;
    thread_local std::vector<float> e;
    e.resize(static_cast<size_t>(vocab));
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < vocab; ++i) {
        e[i] = exp_neg((x[i] - m) * inv_t);
        total += e[i];
    }
    if (k == vocab && top_p >= 1.0f) {                  // plain: scan in vocabulary order
        const float target = u * total;
        float acc = 0.0f;
        for (int64_t i = 0; i < vocab; ++i) {
            acc += e[i];
            if (acc >= target) return i;
        }
        return vocab - 1;
    }
    thread_local std::vector<int32_t> idx;
    idx.resize(static_cast<size_t>(vocab));
    std::iota(idx.begin(), idx.end(), 0);
    auto higher = [&](int32_t a, int32_t b) { return e[a] > e[b] || (e[a] == e[b] && a < b); };
    int64_t c = k < vocab ? k : std::min(vocab, kCandidates);
    while (true) {
        std::nth_element(idx.begin(), idx.begin() + (c - 1), idx.end(), higher);
        std::sort(idx.begin(), idx.begin() + c, higher);
        if (k < vocab || c == vocab) break;
        float held = 0.0f;                              // top-p alone: enough candidates?
        for (int64_t i = 0; i < c; ++i) held += e[idx[i]];
        if (held >= top_p * total) break;
        c = std::min(vocab, c * 8);
    }
    const int64_t kept = std::min(k, c);
    float mass = 0.0f;                                  // renormaliser: top-k survivors or all
    if (k < vocab)
        for (int64_t i = 0; i < kept; ++i) mass += e[idx[i]];
    else
        mass = total;
    int64_t n = kept;                                   // nucleus: drop once `before` >= p
    if (top_p < 1.0f) {
        float before = 0.0f;
        for (int64_t i = 0; i < kept; ++i) {
            if (i > 0 && before >= top_p * mass) { n = i; break; }
            before += e[idx[i]];
        }
    }
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

// logits [rows, vocab] float32, contiguous; every row has temperature > 0.
void weir_sample(const float* logits, int64_t rows, int64_t vocab, const float* temperature,
                 const int64_t* top_k, const float* top_p, const float* u, int64_t* out,
                 int num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r)
        out[r] = sample_row(logits + r * vocab, vocab, temperature[r], top_k[r], top_p[r], u[r]);
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
