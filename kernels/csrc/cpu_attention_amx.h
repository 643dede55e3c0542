// Part of cpu_decode_attention.cpp, included there after its shared helpers (row
// pointers, prefetch) and before the entry points: the AMX kernel (q.k on the tile unit).
// Not a standalone header: it is compiled only as that file's part, once per build part
// (WEIR_ATTN_PART).
#pragma once

// ---- The AMX kernel (bf16 caches, CPUs with AMX tiles) -----------------------------------
// q.k on the tile unit: a chunk of 16 keys is an A tile read straight from the cache (16
// rows, 32 bf16 each: a kv head's slice of each key row, the rows a key row apart), and
// the tile's queries are B tiles packed once per tile: 16 columns, each a query (row r,
// kv head h, group member g) holding its d pairs, zero outside its own head. So one
// tdpbf16ps gives 16 keys x 16 queries; the queries of several kv heads share the columns
// when they fit (SmolLM2 decode: 3 heads x 3 = 9 columns, 6 A tiles per chunk). The scores
// land as [key][query] (a key per vector), where the softmax is one vector op per key for
// all the tile's queries; the probabilities, normalized and rounded to bf16 as the AVX-512
// kernel rounds them, are stored as pairs of neighbouring keys per query (one dword), which
// transposed are P.V's A tile (below). A tile holds at most 16 / G rows (16 columns).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define WEIR_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

namespace {

using weir::amx_configure;
// Tiles (weir::amx_configure: each 16 rows x 64 bytes). q.k: tmm0 the scores (16 keys x 16
// queries, fp32), tmm1 the keys (16 x 32 bf16), tmm2 .. tmm7 the queries. P.V: tmm1 the
// probabilities (16 queries x 32 keys), tmm2 the values (16 key pairs x 16 dims), tmm3-6
// the outputs (16 queries x 64 dims)

// Prefetch the 16 rows [t, t + 16) (clipped to len) of a cache into cache level Hint, t a
// multiple of 16 and block_size of 16 (the AMX kernel's chunks): one block, one run of bytes.
// With weir::slot_of for the kernel's row addresses, in place of a 64-bit divide per row:
// 30 layers, 2 Xeon (AMX) cores, A/B alternating: prefill 4 x 128 6.7-7.1 -> 6.1-6.2 ms,
// 2 x 256 after 1000 87 -> 76-80 ms; decode 64 x 160 unchanged at ~15.4 (its keys come from
// memory: see NextTile).
template <int Hint, typename T>
inline void prefetch_block_rows(const T* cache, const int32_t* table, int64_t block_size,
                                int64_t row_stride, int64_t t, int64_t len) {
    if (t >= len) return;
    const char* p = reinterpret_cast<const char*>(cache + weir::slot_of(table, block_size, t)
                                                  * row_stride);
    const int64_t bytes = std::min<int64_t>(16, len - t) * row_stride * static_cast<int64_t>(sizeof(T));
    for (int64_t x = 0; x < bytes; x += 64) _mm_prefetch(p + x, static_cast<_mm_hint>(Hint));
}

// The next tile's keys and values, prefetched to L2 a few lines at a time while this tile
// computes (spread over its key chunks and value pairs), so one tile's reads overlap the
// tile unit's work on the one before; a decode tile's own chunk-ahead prefetch is too
// short a distance to hide DRAM latency. Blocks alternate keys and values; lines() issues
// up to n more prefetches. 2 AMX Xeon cores, decode 64 x 160, 30 layers' caches, the two
// builds A/B in one process: 13.8 -> 11.7 ms (scattered blocks: 13.8 -> 11.9); with every
// sequence on the same blocks (all in L2) 3.5 -> 5.1 ms, the prefetches' own cost. A
// sparser stream (every 2nd-16th line, for the L2 streamer to fill in) was slower than
// none (14.6 ms): the hardware prefetcher does not follow blocks this size.
struct NextTile {
    const char* k = nullptr;
    const char* v = nullptr;
    const int32_t* table = nullptr;
    int64_t block_size = 16, row_bytes = 0, len = 0;
    int64_t block = 0, off = 0;       // cursor: block index (2j keys, 2j + 1 values), byte
    void lines(int n) {
        while (n > 0 && block / 2 * block_size < len) {
            const int64_t j = block / 2;
            const int64_t bytes = std::min<int64_t>(block_size, len - j * block_size) * row_bytes;
            const char* base = (block % 2 == 0 ? k : v)
                               + static_cast<int64_t>(table[j]) * block_size * row_bytes;
            for (; off < bytes && n > 0; off += 64, --n) _mm_prefetch(base + off, _MM_HINT_T1);
            if (off >= bytes) { off = 0; ++block; }
        }
    }
    int64_t total_lines() const {
        return len <= 0 ? 0 : 2 * ((len * row_bytes + 63) / 64 + (len + block_size - 1) / block_size);
    }
};

// The query tiles held in tmm2 .. tmm7 (tile numbers are immediates: one case each).
inline void load_query_tile(int i, const uint32_t* p) {
    switch (i) {
        case 0: _tile_loadd(2, p, 64); break;
        case 1: _tile_loadd(3, p, 64); break;
        case 2: _tile_loadd(4, p, 64); break;
        case 3: _tile_loadd(5, p, 64); break;
        case 4: _tile_loadd(6, p, 64); break;
        default: _tile_loadd(7, p, 64); break;
    }
}
// tmm0 += the keys in tmm1 . query tile i
inline void dot_query_tile(int i) {
    switch (i) {
        case 0: _tile_dpbf16ps(0, 1, 2); break;
        case 1: _tile_dpbf16ps(0, 1, 3); break;
        case 2: _tile_dpbf16ps(0, 1, 4); break;
        case 3: _tile_dpbf16ps(0, 1, 5); break;
        case 4: _tile_dpbf16ps(0, 1, 6); break;
        default: _tile_dpbf16ps(0, 1, 7); break;
    }
}

// 32 value elements as bf16: in place, or an fp8 cache's widened in registers
inline __m512i bf16_32(const uint16_t* p) { return _mm512_loadu_si512(p); }
template <typename F, std::enable_if_t<weir::is_fp8<F>, int> = 0>
inline __m512i bf16_32(const F* p) { return weir::fp8_scaled_bf16_32(p); }

// P.V of a decode tile (one row: G queries per kv head) by vdpbf16ps from the value rows
// in registers: two keys' rows interleaved (vpunpck{l,h}wd, as value_pair), each query's
// probability pair broadcast. The tile unit's form (in attend_tile_amx) writes the
// interleaved rows out and loads them back as B tiles, and multiplies 16 query rows where
// a decode tile has G. 2 AMX Xeon cores, decode 64 x 160, 30 layers' caches, A/B in one
// process, medians of 20: 13.41 -> 12.99 ms (scattered blocks 14.31 -> 13.93; every
// sequence on one L2-resident block set 5.82 -> 5.42). pairs: [L2 / 2][16], not
// transposed; out: the row's output, heads h0 .. h0 + nh - 1.
template <int D, int G, typename KT>
inline void decode_pv(const KT* v_cache, const int32_t* table, int64_t block_size,
                      int64_t row_stride, int64_t h0, int nh, int64_t L, const uint32_t* pairs,
                      uint16_t* out, NextTile& next, int per_spot) {
    for (int hl = 0; hl < nh; ++hl) {
        __m512 acc[G][D / 16];
        for (int g = 0; g < G; ++g)
            for (int i = 0; i < D / 16; ++i) acc[g][i] = _mm512_setzero_ps();
        for (int64_t t = 0; t < L; t += 2) {
            next.lines(per_spot);
            const KT* v0 = v_cache + weir::slot_of(table, block_size, t) * row_stride + (h0 + hl) * D;
            const bool two = t + 1 < L;
            __m512i p[G];
            for (int g = 0; g < G; ++g) p[g] = _mm512_set1_epi32(static_cast<int>(pairs[t / 2 * 16 + hl * G + g]));
            for (int c = 0; c < D / 32; ++c) {
                const __m512i x0 = bf16_32(v0 + c * 32);
                const __m512i x1 = two ? bf16_32(v0 + row_stride + c * 32) : _mm512_setzero_si512();
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
                const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
                for (int g = 0; g < G; ++g) {
                    acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], lo, (__m512bh)p[g]);
                    acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], hi, (__m512bh)p[g]);
                }
            }
        }
        alignas(64) float buf[D];
        for (int g = 0; g < G; ++g) {
            for (int i = 0; i < D / 16; ++i) _mm512_store_ps(buf + i * 16, acc[g][i]);
            store_pairs<D>(out + ((h0 + hl) * G + g) * D, buf);
        }
    }
}

template <int D, int G, typename KT>
void attend_tile_amx(const uint16_t* q, const KT* k_cache, const KT* v_cache,
                     uint16_t* out, int64_t row0, int nrows, const int32_t* lens,
                     int64_t kv_heads, const int32_t* table, int64_t heads, int64_t q_row,
                     int64_t block_size, float scale, float* scores, int64_t lpad,
                     uint32_t* pairs, uint32_t* qb, NextTile& next, uint16_t* stage) {
    // scores: [lpad][16] fp32; pairs: [lpad / 2][16] bf16 pairs; qb: [hg * D / 32][16][16];
    // stage: [16][kv_heads * D] bf16, an fp8 cache's 16 key rows widened for the A tiles
    const int64_t L = lens[nrows - 1];
    const int64_t row_stride = kv_heads * D;               // elements between key rows
    const int cph = nrows * G;                             // columns per kv head
    const int64_t hg = std::min<int64_t>(kv_heads, 16 / cph);   // kv heads per pass
    constexpr int DT = D / 32;                             // A tiles per head slice
    const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t h0 = 0; h0 < kv_heads; h0 += hg) {
        const int nh = static_cast<int>(std::min(hg, kv_heads - h0));
        const int ncols = nh * cph;
        // column c = hl * cph + r * G + g; lenv: its row's key count (0: an unused column)
        alignas(64) float lenf[16];
        for (int c = 0; c < 16; ++c) lenf[c] = c < ncols ? static_cast<float>(lens[(c % cph) / G]) : 0.0f;
        const __m512 lenv = _mm512_load_ps(lenf);
        std::memset(qb, 0, static_cast<size_t>(nh) * DT * 1024);
        for (int hl = 0; hl < nh; ++hl)
            for (int r = 0; r < nrows; ++r)
                for (int g = 0; g < G; ++g) {
                    const int c = hl * cph + r * G + g;
                    const uint16_t* qq = q + (row0 + r) * q_row + ((h0 + hl) * G + g) * D;
                    for (int i = 0; i < DT; ++i)
                        for (int p = 0; p < 16; ++p)
                            std::memcpy(qb + ((hl * DT + i) * 16 + p) * 16 + c, qq + i * 32 + 2 * p, 4);
                }
        // the next tile's prefetches, spread over this group's key chunks, its softmax (every
        // 4th key of both passes: without them the line fill buffers drain there; decode
        // 64 x 160, 30 layers' caches, 2 AMX Xeon cores, A/B in one process, medians of
        // 25: 14.15 -> 13.61 ms) and its value pairs
        const int64_t L32 = (L + 31) / 32 * 32;
        const int64_t spots = (L + 15) / 16 + 2 * ((L + 3) / 4) + nh * (L32 / 2);
        const int per_spot = static_cast<int>((next.total_lines() + spots - 1) / spots);
        // scores, 16 keys (one block's rows: block_size is a multiple of 16) at a time; the
        // query tiles stay in tmm2.. when they fit (SmolLM2: 6), loaded once, not per chunk
        const int nqt = nh * DT;
        const bool resident = nqt <= 6;
        if (resident)
            for (int x = 0; x < nqt; ++x) load_query_tile(x, qb + x * 256);
        for (int64_t t0 = 0; t0 < L; t0 += 16) {
            const KT* kc = k_cache + weir::slot_of(table, block_size, t0) * row_stride + h0 * D;
            const uint16_t* kb;
            if constexpr (weir::is_fp8<KT>) {
                // the chunk's 16 rows (one block) widened once, this group's heads only
                for (int j = 0; j < 16; ++j)
                    for (int64_t d = 0; d < nh * D; d += 32)
                        _mm512_storeu_si512(stage + j * row_stride + d,
                                            bf16_32(kc + j * row_stride + d));
                kb = stage;
            } else {
                kb = kc;
            }
            if (h0 == 0) {          // the next chunk's keys to L1, this chunk's values to L2
                prefetch_block_rows<_MM_HINT_T0>(k_cache, table, block_size, row_stride, t0 + 16, L);
                prefetch_block_rows<_MM_HINT_T1>(v_cache, table, block_size, row_stride, t0, L);
            }
            next.lines(per_spot);
            _tile_zero(0);
            for (int hl = 0; hl < nh; ++hl)
                for (int i = 0; i < DT; ++i) {
                    _tile_loadd(1, kb + hl * D + i * 32, row_stride * 2);
                    if (resident) {
                        dot_query_tile(hl * DT + i);
                    } else {
                        _tile_loadd(2, qb + (hl * DT + i) * 256, 64);
                        _tile_dpbf16ps(0, 1, 2);
                    }
                }
            _tile_stored(0, scores + t0 * 16, 64);
        }
        // softmax per column over the keys (a key per vector); keys past a column's row
        // (and the chunk's tail past L) are masked out
        // (an fp8 cache's keys and values are read scaled by 2^-S: bf16_32)
        constexpr float rescale = weir::fp8_rescale<KT>;
        const __m512 sc = _mm512_set1_ps(scale * rescale);
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < L; ++t) {
            const __mmask16 live = _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(t)), lenv, _CMP_LT_OQ);
            m = _mm512_mask_max_ps(m, live, m, _mm512_mul_ps(_mm512_loadu_ps(scores + t * 16), sc));
            if ((t & 3) == 0) next.lines(per_spot);
        }
        __m512 sum = _mm512_setzero_ps();
        const int64_t L2 = (L + 1) / 2 * 2;
        for (int64_t t = 0; t < L2; ++t) {
            const __mmask16 live = _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(t)), lenv, _CMP_LT_OQ);
            const __m512 e = _mm512_maskz_mov_ps(live, weir::exp16(_mm512_fmsub_ps(
                _mm512_loadu_ps(scores + t * 16), sc, m)));
            _mm512_storeu_ps(scores + t * 16, e);
            if ((t & 3) == 0) next.lines(per_spot);
            sum = _mm512_add_ps(sum, e);
        }
        const __mmask16 any = _mm512_cmp_ps_mask(sum, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __m512 inv = _mm512_maskz_div_ps(any, _mm512_set1_ps(rescale), sum);
        for (int64_t t = 0; t < L2; t += 2) {
            const __m512i p0 = _mm512_cvtepu16_epi32(weir::bf16_16(
                _mm512_mul_ps(_mm512_loadu_ps(scores + t * 16), inv)));
            const __m512i p1 = _mm512_cvtepu16_epi32(weir::bf16_16(
                _mm512_mul_ps(_mm512_loadu_ps(scores + (t + 1) * 16), inv)));
            _mm512_storeu_si512(pairs + t / 2 * 16, _mm512_or_si512(p0, _mm512_slli_epi32(p1, 16)));
        }
        // P.V on the tiles: per 32 keys, the probabilities as an A tile (16 queries x 16 key
        // pairs: the pairs transposed, in place, once for every head) and each head's values
        // as B tiles, its rows key pairs interleaved (vpunpck{l,h}wd, as value_pair: the
        // output dims come out in that order, which store_pairs undoes); keys past L are
        // zeros, not read.
        if constexpr (G * D / 16 <= 24) {
            if (nrows == 1) {          // a decode tile
                decode_pv<D, G>(v_cache, table, block_size, row_stride, h0, nh, L, pairs,
                                out + row0 * heads * D, next, per_spot);
                continue;
            }
        }
        for (int64_t t = L2; t < L32; t += 2)
            _mm512_storeu_si512(pairs + t / 2 * 16, _mm512_setzero_si512());
        for (int64_t t0 = 0; t0 < L32; t0 += 32) transpose16(pairs + t0 / 2 * 16, pairs + t0 / 2 * 16);
        uint32_t* vb = qb;                       // [4][16 pairs][16 dims] (q is packed: free)
        float* ob = reinterpret_cast<float*>(qb + 1024);         // [16 queries][D]
        for (int hl = 0; hl < nh; ++hl) {
            for (int dh = 0; dh < D / 64; ++dh) {
                _tile_zero(3); _tile_zero(4); _tile_zero(5); _tile_zero(6);
                for (int64_t t0 = 0; t0 < L32; t0 += 32) {
                    for (int j = 0; j < 16; ++j) {
                        const int64_t t = t0 + 2 * j;
                        next.lines(per_spot);
                        __m512i x0a, x0b, x1a, x1b;
                        if (t < L) {
                            const KT* v0 = v_cache + weir::slot_of(table, block_size, t) * row_stride
                                           + (h0 + hl) * D + dh * 64;
                            x0a = bf16_32(v0);
                            x0b = bf16_32(v0 + 32);
                            if (t + 1 < L) {
                                x1a = bf16_32(v0 + row_stride);
                                x1b = bf16_32(v0 + row_stride + 32);
                            } else {
                                x1a = x1b = _mm512_setzero_si512();
                            }
                        } else {
                            x0a = x0b = x1a = x1b = _mm512_setzero_si512();
                        }
                        _mm512_store_si512(vb + (0 * 16 + j) * 16, _mm512_unpacklo_epi16(x0a, x1a));
                        _mm512_store_si512(vb + (1 * 16 + j) * 16, _mm512_unpackhi_epi16(x0a, x1a));
                        _mm512_store_si512(vb + (2 * 16 + j) * 16, _mm512_unpacklo_epi16(x0b, x1b));
                        _mm512_store_si512(vb + (3 * 16 + j) * 16, _mm512_unpackhi_epi16(x0b, x1b));
                    }
                    _tile_loadd(1, pairs + t0 / 2 * 16, 64);
                    _tile_loadd(2, vb + 0 * 256, 64);
                    _tile_dpbf16ps(3, 1, 2);
                    _tile_loadd(2, vb + 1 * 256, 64);
                    _tile_dpbf16ps(4, 1, 2);
                    _tile_loadd(2, vb + 2 * 256, 64);
                    _tile_dpbf16ps(5, 1, 2);
                    _tile_loadd(2, vb + 3 * 256, 64);
                    _tile_dpbf16ps(6, 1, 2);
                }
                _tile_stored(3, ob + dh * 64 + 0, D * 4);
                _tile_stored(4, ob + dh * 64 + 16, D * 4);
                _tile_stored(5, ob + dh * 64 + 32, D * 4);
                _tile_stored(6, ob + dh * 64 + 48, D * 4);
            }
            for (int r = 0; r < nrows; ++r)
                for (int g = 0; g < G; ++g)
                    store_pairs<D>(out + ((row0 + r) * heads + (h0 + hl) * G + g) * D,
                                   ob + (hl * cph + r * G + g) * D);
        }
    }
}


// ---- The AMX prefill kernel: a prompt's chunk (a long run of one sequence's rows) ----------
// The tile kernel above is built for decode: a tile is 16 / G rows (SmolLM2: 5), so a 2,048-
// row chunk is ~400 tiles per kv head, each reading every key again, re-interleaving every
// value row into B tiles, and writing its whole score row (L x 16 floats) out and reading it
// back three times. 2 AMX Xeon cores, 30 layers, a 2,048-token prompt: 326 ms of a 610 ms
// step, 0.44 TFLOP/s against the GEMM's 2.4.
// This one is flash attention on the tiles, with no transpose in its key loop. Per call, each
// kv head's keys are packed once as q.k's A tiles (``pack_keys``: 16 keys x 32 dims, each
// tile one contiguous kilobyte) and its values as P.V's A tiles, transposed
// (``pack_values_t``: per 32 keys, 4 tiles of 16 dims x 32 keys for D = 64), for every query
// block to share. A work item is 16 consecutive rows of a run and one kv head; for each of its
// G query heads the queries are one B tile pair (Q^T, transposed once), so S^T = K.Q^T lands
// a key per vector, 16 queries across (the softmax is vertical: one vector op per key for all
// 16 rows). P is then already in a B tile's layout: two neighbouring keys' rows, cut to bf16
// and interleaved by one shift and one vpternlogd (exp2_bf16), are a row of pairs, a query per
// dword. So the output is kept transposed, O^T = V^T.P (four tiles, tmm4-7, 16 dims x 16
// queries each, over the whole key loop), and transposed back once per item. Each block's
// scores go to the tile unit before the block before it runs its softmax (two score buffers),
// the probabilities are 2^x by 7 vector ops (exp2_bf16), their sums one vdpbf16ps a key pair
// on the rounded pairs (against a ones pair: the sum of exactly what P.V multiplies), and Q^T
// stays in two tiles over the head's key loop (9 tile loads a 32-key block, not 13).
// The running max is lazy: it moves only when a block's max passes it by more than
// kLazyRescale (e^8: P's bf16 and the fp32 sums have room), so the output tiles are stored,
// rescaled (a query per lane: one multiply a dim row) and reloaded a few times per row, not
// once per block; and away from the edge the max is not even looked at unless a column's
// block sum passes e^8 (a term larger than that would have to be in the sum).
// One layer of a 2,048-token prompt (9 q / 3 kv heads), one Xeon core's CPU time, each step
// against the one before it (docs/perf-log.md, 2026-12-06): 17.0-18.0 ms the first form (keys
// A tiles read from the cache, 384 bytes a row apart; O = P^T.V with P transposed every 32
// keys and widened by vpmovzxwd on the shuffle port); 16.6 O^T = V^T.P; 12.9-13.6 the keys
// packed (the loads from the cache were the kernel's largest stall); 13.0 the next block's
// scores first; 9.6-11.2 2^x and the sum-checked max. Then with the call's 2 threads, wall
// time (scripts/run bench/prompt_attention), 2,048 fresh / after 2,048: 3.6-3.8 / 11.1-11.8 ms;
// 3.4 / 10.8 the degree-3 2^x and the sums by vdpbf16ps; 3.1 / 10.0 Q^T resident; 2.9 / 9.0-9.2
// the pairs by vpternlogd. Only D = 64 and bf16 caches; other shapes take the tile kernel.
inline void zero_output_tiles() { _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7); }
inline void store_output_tiles(float* o) {      // O^T: [64 dims][16 queries], tile i at o + 256 i
    _tile_stored(4, o, 64); _tile_stored(5, o + 256, 64);
    _tile_stored(6, o + 512, 64); _tile_stored(7, o + 768, 64);
}
inline void load_output_tiles(const float* o) {
    _tile_loadd(4, o, 64); _tile_loadd(5, o + 256, 64);
    _tile_loadd(6, o + 512, 64); _tile_loadd(7, o + 768, 64);
}

// a run's values for kv head h as P.V's A tiles (V^T): for each 32 keys, D / 16 tiles of 16
// dims x 16 key pairs (dword: key 2j's element low, 2j + 1's high; keys past len zeros):
// pack_values' B tiles, each transposed
template <int D>
void pack_values_t(const uint16_t* v_cache, const int32_t* table, int64_t block_size,
                   int64_t row_stride, int64_t h, int64_t len, uint32_t* dst) {
    pack_values<D>(v_cache, table, block_size, row_stride, h, len, dst);
    const int64_t tiles = (len + 31) / 32 * (D / 16);
    for (int64_t i = 0; i < tiles; ++i) transpose16(dst + i * 256, dst + i * 256);
}

// a run's keys for kv head h as q.k's A tiles, each one contiguous kilobyte: for each 16
// keys, D / 32 tiles of 16 keys x 32 dims (keys past len, up to a whole 32, zeros)
template <int D>
void pack_keys(const uint16_t* k_cache, const int32_t* table, int64_t block_size,
               int64_t row_stride, int64_t h, int64_t len, uint32_t* dst) {
    const int64_t len32 = (len + 31) / 32 * 32;
    for (int64_t t = 0; t < len32; ++t) {
        uint16_t* tile = reinterpret_cast<uint16_t*>(dst + (t / 16) * (D / 32) * 256) + (t % 16) * 32;
        const uint16_t* k = k_cache + weir::slot_of(table, block_size, std::min(t, len - 1)) * row_stride + h * D;
        for (int c = 0; c < D / 32; ++c) {
            const __m512i x = t < len ? _mm512_loadu_si512(k + 32 * c) : _mm512_setzero_si512();
            _mm512_store_si512(tile + c * 512, x);
        }
    }
}

// rows [row0, row0 + nr) of a run (nr <= 16), kv head h: every one of its G query heads,
// KB keys (a multiple of 32) a block
template <int D, int G, int KB = kFlashKeys>
void flash_block_amx(const uint16_t* q, const uint32_t* kpk, uint16_t* out, int64_t row0,
                     int nr, const int32_t* row_lens, int64_t h, int64_t heads, int64_t q_row,
                     float scale, const uint32_t* vpk) {
    static_assert(D == 64, "the prefill kernel's output is four 16-dim tiles");
    alignas(64) uint32_t qrows[16 * 32];     // [16 queries][32 dwords]
    alignas(64) uint32_t qt[2 * 256];        // Q^T: [d half][16 d pairs][16 queries]
    alignas(64) float sbufs[2][KB * 16];     // S^T: [KB keys][16 queries], two blocks'
    alignas(64) uint32_t pbuf[KB / 2 * 16];  // P: [KB / 2 key pairs][16 queries]
    alignas(64) float obuf[64 * 16];         // O^T: [64 dims][16 queries]
    const int64_t L = row_lens[row0 + nr - 1];
    const int64_t full = nr < 16 ? 0 : row_lens[row0];   // keys every column attends
    alignas(64) float lenf[16];
    for (int c = 0; c < 16; ++c) lenf[c] = c < nr ? static_cast<float>(row_lens[row0 + c]) : 0.0f;
    const __m512 lenv = _mm512_load_ps(lenf);
    const __m512 sc = _mm512_set1_ps(scale);
    const __m512 log2e = _mm512_set1_ps(weir::kLog2e);
    const __m512 sc2 = _mm512_set1_ps(scale * weir::kLog2e);
    const __m512 lazy_sum = _mm512_set1_ps(std::exp(kLazyRescale));
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);    // bf16 1.0 pairs
    for (int g = 0; g < G; ++g) {
        const int64_t head = h * G + g;
        for (int c = 0; c < 16; ++c) {
            if (c < nr)
                std::memcpy(qrows + c * 32, q + (row0 + c) * q_row + head * D, D * 2);
            else
                std::memset(qrows + c * 32, 0, D * 2);
        }
        transpose16(qrows, qt, 32);
        transpose16(qrows + 16, qt + 256, 32);
        zero_output_tiles();
        __m512 m = ninf, l = _mm512_setzero_ps();
        // S^T of the keys [t0, t0 + KB), 16 at a time, into sb: Q^T stays in tmm2 and tmm3
        // for the head's whole key loop, so a chunk is two key loads for its two products
        // (loaded per chunk beside the keys, 13 tile loads a block, now 9); chunks past L are
        // not read
        _tile_loadd(2, qt, 64); _tile_loadd(3, qt + 256, 64);
        auto scores = [&](int64_t t0, float* sb) {
            for (int c = 0; c < KB / 16 && t0 + 16 * c < L; ++c) {
                const uint32_t* kc = kpk + (t0 / 16 + c) * (D / 32) * 256;
                _tile_zero(0);
                _tile_loadd(1, kc, 64); _tile_dpbf16ps(0, 1, 2);
                _tile_loadd(1, kc + 256, 64); _tile_dpbf16ps(0, 1, 3);
                _tile_stored(0, sb + c * 256, 64);
            }
        };
        scores(0, sbufs[0]);
        for (int64_t t0 = 0; t0 < L; t0 += KB) {
            // the next block's scores go to the tile unit first, to run while this block's
            // softmax runs on the vector units
            float* sbuf = sbufs[(t0 / KB) & 1];
            if (t0 + KB < L) scores(t0 + KB, sbufs[((t0 / KB) + 1) & 1]);
            // P in bf16 pairs of neighbouring keys, a column per query: 2^(s x scale x log2 e
            // - m x log2 e); masked at the edge. Returns the block's sum per column.
            __mmask16 live_m = _mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ);
            auto probabilities = [&](bool masked) {
                const __m512 m2 = _mm512_mul_ps(m, log2e);
                __m512 bs = _mm512_setzero_ps();
                for (int t = 0; t < KB; t += 2) {
                    const __m512 s0 = _mm512_load_ps(sbuf + t * 16), s1 = _mm512_load_ps(sbuf + (t + 1) * 16);
                    __m512 e0, e1;
                    if (!masked) {
                        e0 = exp2_bf16(_mm512_fmsub_ps(s0, sc2, m2));
                        e1 = exp2_bf16(_mm512_fmsub_ps(s1, sc2, m2));
                    } else {
                        e0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, ninf, _CMP_NEQ_OQ) & live_m,
                                                 exp2_bf16(_mm512_fmsub_ps(s0, log2e, m2)));
                        e1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, ninf, _CMP_NEQ_OQ) & live_m,
                                                 exp2_bf16(_mm512_fmsub_ps(s1, log2e, m2)));
                    }
                    // the pair row (dword c: query c, the even key's bf16 low, the odd's high)
                    const __m512i pp = bf16_pairs(e0, e1);
                    bs = _mm512_dpbf16_ps(bs, (__m512bh)pp, ones);
                    _mm512_store_si512(pbuf + t / 2 * 16, pp);
                }
                return bs;
            };
            // where the block's max bm (scaled) passes m by more than kLazyRescale, m moves
            // to it and what was summed so far is rescaled; returns whether any column moved
            auto move_max = [&](__m512 bm) {
                const __mmask16 up = _mm512_cmp_ps_mask(
                    bm, _mm512_add_ps(m, _mm512_set1_ps(kLazyRescale)), _CMP_GT_OQ);
                if (!up) return false;
                const __m512 m1 = _mm512_mask_mov_ps(m, up, bm);
                const __mmask16 had = _mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ);
                const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), up,
                    _mm512_maskz_mov_ps(had, weir::exp16(_mm512_sub_ps(m, m1))));
                l = _mm512_mul_ps(l, alpha);
                if (up & had) {
                    store_output_tiles(obuf);
                    for (int d = 0; d < 64; ++d)
                        _mm512_store_ps(obuf + d * 16, _mm512_mul_ps(_mm512_load_ps(obuf + d * 16), alpha));
                    load_output_tiles(obuf);
                }
                m = m1;
                return true;
            };
            __m512 bs;
            if (t0 + KB > full) {
                // the edge (keys past some column's length, or past L): those scores are set
                // to -inf, and the max is taken first
                __m512 bm = ninf;
                for (int t = 0; t < KB; ++t) {
                    __m512 s = t0 + t < L ? _mm512_mul_ps(_mm512_load_ps(sbuf + t * 16), sc) : ninf;
                    s = _mm512_mask_mov_ps(ninf, _mm512_cmp_ps_mask(
                        _mm512_set1_ps(static_cast<float>(t0 + t)), lenv, _CMP_LT_OQ), s);
                    _mm512_store_ps(sbuf + t * 16, s);
                    bm = _mm512_max_ps(bm, s);
                }
                move_max(bm);
                live_m = _mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ);
                bs = probabilities(true);
            } else {
                // every score live: the probabilities at the max so far, and only where a
                // column's block sum passes e^kLazyRescale (or is not a number: m is -inf
                // before a column's first block) its max is looked at, and moved if it must
                // be (each term is at most the sum: none passes e^kLazyRescale unnoticed)
                bs = probabilities(false);
                if (_mm512_cmp_ps_mask(bs, lazy_sum, _CMP_NLE_UQ)) {
                    __m512 bm = ninf;
                    for (int t = 0; t < KB; ++t) bm = _mm512_max_ps(bm, _mm512_load_ps(sbuf + t * 16));
                    if (move_max(_mm512_mul_ps(bm, sc))) bs = probabilities(false);
                }
            }
            l = _mm512_add_ps(l, bs);
            // P.V, transposed: per 32 keys, the packed values are the A tiles (tmm1), P the B
            // tile (tmm0, free once the scores are stored)
            for (int j = 0; j < KB / 32 && t0 + 32 * j < L; ++j) {
                _tile_loadd(0, pbuf + j * 256, 64);
                const uint32_t* vt = vpk + (t0 / 32 + j) * (D / 16) * 256;
                _tile_loadd(1, vt, 64); _tile_dpbf16ps(4, 1, 0);
                _tile_loadd(1, vt + 256, 64); _tile_dpbf16ps(5, 1, 0);
                _tile_loadd(1, vt + 512, 64); _tile_dpbf16ps(6, 1, 0);
                _tile_loadd(1, vt + 768, 64); _tile_dpbf16ps(7, 1, 0);
            }
        }
        // O^T normalized (a query per lane), transposed back to rows, 16 dims at a time
        store_output_tiles(obuf);
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
        for (int d = 0; d < 64; ++d)
            _mm512_store_ps(obuf + d * 16, _mm512_mul_ps(_mm512_load_ps(obuf + d * 16), inv));
        auto* ob = reinterpret_cast<uint32_t*>(obuf);
        for (int i = 0; i < 4; ++i) transpose16(ob + i * 256, ob + i * 256);
        for (int c = 0; c < nr; ++c) {
            uint16_t* o = out + ((row0 + c) * heads + head) * D;
            for (int i = 0; i < 4; ++i)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * i),
                                    weir::bf16_16(_mm512_load_ps(obuf + i * 256 + c * 16)));
        }
    }
}

// the runs: pack every run's values per kv head, then the blocks (16 rows, one kv head),
// longest first (a run's last blocks read the most keys), as threads come free
template <int D, int G>
void flash_runs_amx(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                    uint16_t* out, const std::vector<FlashRun>& runs, const int32_t* row_lens,
                    const int32_t* block_tables, int64_t table_width, int64_t heads,
                    int64_t q_row, int64_t kv_heads, int64_t block_size, float scale,
                    int num_threads, uint32_t* vpk) {
    auto at = [&](const FlashRun& run, int64_t h, int which) {   // 0 values, 1 keys
        return vpk + run.vpk + (2 * h + which) * flash_span<D>(run.len);
    };
    auto pack = [&](const FlashRun& run, int64_t h) {
        const int32_t* table = block_tables + run.seq * table_width;
        pack_values_t<D>(v_cache, table, block_size, kv_heads * D, h, run.len, at(run, h, 0));
        pack_keys<D>(k_cache, table, block_size, kv_heads * D, h, run.len, at(run, h, 1));
    };
    auto block = [&](const FlashRun& run, const FlashItem& it) {
        flash_block_amx<D, G>(q, at(run, it.h, 1), out, run.i0 + it.b0,
                              static_cast<int>(std::min<int64_t>(16, run.n - it.b0)), row_lens,
                              it.h, heads, q_row, scale, at(run, it.h, 0));
    };
    flash_schedule(runs, row_lens, kv_heads, num_threads, pack, block, [] { amx_configure(); },
                   [] { _tile_release(); });
}
}  // namespace

#if WEIR_PART(1)
extern "C" int weir_amx_supported() {
    // Linux hands out the tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA)
    static const int ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : 0;
    return ok;
}
#endif
#elif WEIR_PART(1)
extern "C" int weir_amx_supported() { return 0; }
#endif
