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
// 4 x 128 0.89x, 2 x 256 after 1000 0.90x. On CPUs with AMX tiles a fourth, the AMX
// kernel, runs q.k (and a prefill tile's P.V) on the tile unit where the plan measured it
// faster (attention_tiles). The tiled kernels live in cpu_attention_avx512.h,
// cpu_attention_amx.h and cpu_attention_avx2.h, included below, each with its prompt kernel
// (flash attention over a prompt's chunk: flash_runs_amx, flash_runs_vec, flash_runs_avx2;
// their runs and schedule are shared, below); the portable kernel, the dispatch and the
// entry points are here.
#include <algorithm>
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

// weir_decode_attention's mode bits: the AMX tiles; the batch-invariant kernels (a
// deterministic step: every row reduced in an order fixed by its own key count)
constexpr int kModeAmx = 1;
constexpr int kModeInvariant = 2;

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

// ---- The prompt kernels' runs and schedule (AMX, AVX-512 BF16 and AVX2 alike) -----------
// A run is kFlashRows or more consecutive rows of one sequence at consecutive positions (a
// prompt's chunk). Each kernel packs a run's keys and values once per kv head, in its own
// layout, into one buffer for the call (FlashRun::vpk: where the run's start, in words), then
// works through items of 16 rows and one kv head, every one of its G query heads.
constexpr int64_t kFlashRows = 32;     // a run of at least this many rows takes a prompt kernel
constexpr float kLazyRescale = 8.0f;   // the running max moves only when passed by e^8

struct FlashRun {
    int64_t i0, n;                     // its rows [i0, i0 + n)
    int64_t seq, len;                  // its sequence, the keys its last row attends
    int64_t vpk;                       // where its packed keys and values start (words)
};

// a prompt kernel's work: 16 rows of a run and one kv head each, longest first (a run's last
// blocks read the most keys), for threads to take as they come free
struct FlashItem { int64_t run, h, b0, keys; };
inline std::vector<FlashItem> flash_items(const std::vector<FlashRun>& runs,
                                          const int32_t* row_lens, int64_t kv_heads) {
    std::vector<FlashItem> items;
    for (int64_t r = 0; r < static_cast<int64_t>(runs.size()); ++r)
        for (int64_t b0 = 0; b0 < runs[r].n; b0 += 16)
            for (int64_t h = 0; h < kv_heads; ++h)
                items.push_back({r, h, b0, row_lens[runs[r].i0 + std::min(b0 + 16, runs[r].n) - 1]});
    std::stable_sort(items.begin(), items.end(),
                     [](const FlashItem& a, const FlashItem& b) { return a.keys > b.keys; });
    return items;
}

struct NoOp { void operator()() const {} };

// The prompt kernels' schedule, in one parallel region: pack(run, h) for every run and kv
// head, then block(run, item) for the items, longest first, each as a thread comes free;
// enter() runs on each thread before its items, leave() after (the AMX tile state)
template <typename Pack, typename Block, typename Enter = NoOp, typename Leave = NoOp>
void flash_schedule(const std::vector<FlashRun>& runs, const int32_t* row_lens,
                    int64_t kv_heads, int num_threads, Pack pack, Block block, Enter enter = {},
                    Leave leave = {}) {
    const std::vector<FlashItem> items = flash_items(runs, row_lens, kv_heads);
    const int64_t npack = static_cast<int64_t>(runs.size()) * kv_heads;
    const int64_t nitems = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t x = 0; x < npack; ++x) pack(runs[x / kv_heads], x % kv_heads);
        enter();
#pragma omp for schedule(dynamic, 1)
        for (int64_t x = 0; x < nitems; ++x) block(runs[items[x].run], items[x]);
        leave();
    }
}

}  // namespace
#endif

#include "cpu_attention_avx512.h"   // the AVX-512 tiled kernel
#include "cpu_attention_amx.h"      // the AMX kernel (and weir_amx_supported)
#include "cpu_attention_avx2.h"     // the AVX2 tiled kernel

#if defined(WEIR_FLASH)
namespace {
// The prompt kernel this build has, for the runs of one call: on AVX-512 BF16 the AMX one
// where the tiles were asked for, else the vector one; on AVX2 its own. buf: the call's
// packed keys and values, 64-byte aligned (flash_words per run).
template <typename T, typename KT, int D, int G>
void flash_runs(const T* q, const KT* k_cache, const KT* v_cache, T* out,
                const std::vector<FlashRun>& runs, const int32_t* row_lens,
                const int32_t* block_tables, int64_t table_width, int64_t heads, int64_t q_row,
                int64_t kv_heads, int64_t block_size, float scale, int num_threads, bool amx,
                FlashWord* buf) {
#if defined(__AVX512F__)
    const auto* qq = reinterpret_cast<const uint16_t*>(q);
    const auto* kk = reinterpret_cast<const uint16_t*>(k_cache);
    const auto* vv = reinterpret_cast<const uint16_t*>(v_cache);
    auto* oo = reinterpret_cast<uint16_t*>(out);
#if defined(WEIR_AMX)
    if (amx) {
        flash_runs_amx<D, G>(qq, kk, vv, oo, runs, row_lens, block_tables, table_width, heads,
                             q_row, kv_heads, block_size, scale, num_threads, buf);
        return;
    }
#endif
    flash_runs_vec<D, G>(qq, kk, vv, oo, runs, row_lens, block_tables, table_width, heads,
                         q_row, kv_heads, block_size, scale, num_threads, buf);
#else
    (void)amx;
    flash_runs_avx2<T, KT, D, G>(q, k_cache, v_cache, out, runs, row_lens, block_tables,
                                 table_width, heads, q_row, kv_heads, block_size, scale,
                                 num_threads, buf);
#endif
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
                      int num_threads, int mode) {
    const bool amx = mode & kModeAmx;
    const bool invariant = mode & kModeInvariant;
#if defined(WEIR_TILED)
    // tiles: runs of up to kTile consecutive rows of one sequence at consecutive positions
    // (the AMX kernel: up to 16 / G, its queries' columns); a run of kFlashRows or more (a
    // prompt's chunk) takes the build's prompt kernel instead, where it has the shape.
    // Invariant (a deterministic step): no prompt kernel, and each row's reduction order
    // depends on its own key count only: the vector tiles (a row's scores, softmax and P.V
    // never mix with its tile's other rows: keys past a row are -inf, probability 0), or
    // AMX tiles of one row each (a multi-row AMX tile runs P.V on the tiles, a one-row tile
    // by vdpbf16ps, so a row's bits would depend on its tile)
    const int64_t tile_rows = amx ? (invariant ? 1 : 16 / G) : kTile;
    std::vector<int64_t> starts, ends;         // each tile's rows [starts[i], ends[i])
    starts.reserve(static_cast<size_t>(n));
    ends.reserve(static_cast<size_t>(n));
#if defined(WEIR_FLASH)
    // a prompt kernel (the AMX one, the AVX-512 BF16 vector one or the AVX2 one) for the
    // shapes it takes
    constexpr bool flash_shape = kFlashFits<T, KT, D>;
    thread_local std::vector<FlashRun> runs;
    runs.clear();
    int64_t packed = 0;
#endif
    for (int64_t i = 0, j; i < n; i = j) {
        for (j = i + 1; j < n && seqs[j] == seqs[j - 1] && row_lens[j] == row_lens[j - 1] + 1; ++j) {}
#if defined(WEIR_FLASH)
        if (flash_shape && !invariant && j - i >= kFlashRows) {
            runs.push_back({i, j - i, seqs[i], row_lens[j - 1], packed});
            packed += flash_words<D>(row_lens[j - 1], kv_heads, amx);
            continue;
        }
#endif
        for (int64_t t = i; t < j; t += tile_rows) {
            starts.push_back(t);
            ends.push_back(std::min(t + tile_rows, j));
        }
    }
    const int64_t tiles = static_cast<int64_t>(starts.size());
#if defined(WEIR_FLASH)
    if constexpr (flash_shape) {
        if (!runs.empty()) {
            thread_local std::vector<FlashWord> buf;    // 64-byte aligned: tile rows, vectors
            if (buf.size() < static_cast<size_t>(packed) + 16) buf.resize(static_cast<size_t>(packed) + 16);
            const int64_t skew = ((64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64) / 4;
            flash_runs<T, KT, D, G>(q, k_cache, v_cache, out, runs, row_lens, block_tables,
                                    table_width, heads, q_row, kv_heads, block_size, scale,
                                    num_threads, amx, buf.data() + skew);
        }
    }
    if (tiles == 0) return;
#endif
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
                        next.len = row_lens[ends[tile + num_threads] - 1];
                    }
                    const int nrows = static_cast<int>(ends[tile] - i0);
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
        const int nrows = static_cast<int>(ends[tile] - i0);
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
    (void)invariant;          // one item per (row, kv head): invariant as it is
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
               int amx) {
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
             int threads, int amx) {
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
        weir::fp8_encode_row(k + i * src_stride, k_cache + slots[i] * row, row);
        weir::fp8_encode_row(v + i * src_stride, v_cache + slots[i] * row, row);
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
                        scale, num_threads, amx);
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
// p + 1, which makes prefill causal. amx: bit 0 (kModeAmx) the AMX kernel (bf16 q,
// block_size a multiple of 16, weir_amx_supported()), else -1; bit 1 (kModeInvariant) the
// batch-invariant kernels (decode_attention). Returns 0 or -1.
int weir_decode_attention(int dtype, int kv_dtype, const void* q, const void* k_cache,
                          const void* v_cache, void* out, const int64_t* seqs, int64_t n,
                          const int32_t* block_tables, int64_t table_width,
                          const int32_t* row_lens, int64_t heads, int64_t q_row,
                          int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                          int num_threads, int amx) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || heads > 64) return -1;
    if ((amx & kModeAmx) && (dtype != 1 || block_size % 16 != 0 || !weir_amx_supported())) return -1;
    if (dtype != 0 && dtype != 1) return -1;
    if (kv_dtype == dtype) return weir_attention_same(WEIR_PART_CALL);
    if (kv_dtype == 2) return weir_attention_e4m3(WEIR_PART_CALL);
    if (kv_dtype == 3) return weir_attention_e5m2(WEIR_PART_CALL);
    return -1;
}
#endif

}
