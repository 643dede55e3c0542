// The decoder layers of one step in one call: LlamaModel.forward's layer loop, kernel for
// kernel (the same functions, in the same order, on the same buffers), without the ~20
// ctypes calls, tensor allocations and views per layer that Python spends between them.
// On the 2-core AMX Xeon a batch-64 decode step spent ~6 ms of its ~36 in the interpreter
// and torch's dispatch, while the second core waited at the next parallel region.
// Built into the same library as the kernels (kernels/cpu_native.py); called by
// kernels/cpu_forward.py:forward_layers where the step's plan runs every layer on these
// kernels (LlamaModel._native_layers decides).
#include <chrono>
#include <cstdint>

extern "C" {
int weir_gemv_bf16(const uint16_t* x, int64_t ldx, const uint16_t* wp, const uint16_t* bias,
                   uint16_t* y, int64_t m, int64_t n, int64_t k, int threads);
int weir_gemv_f32(const float* x, int64_t ldx, const float* wp, const float* bias, float* y,
                  int64_t m, int64_t n, int64_t k, int threads);
int weir_gemm_amx_bf16(const uint16_t* x, int64_t ldx, const uint16_t* wp, const uint16_t* bias,
                       uint16_t* y, int64_t m, int64_t n, int64_t k, int threads);
int weir_gemm_amx_bf16_silu_mul(const uint16_t* x, int64_t ldx, const uint16_t* wp,
                                uint16_t* y, int64_t m, int64_t inter, int64_t k, int threads);
void weir_add_rms_norm(int dtype, void* h, const void* delta, const void* weight, void* x,
                       int64_t rows, int64_t dim, float eps, int threads);
void weir_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter,
                   int threads);
int weir_rope_write_kv(int dtype, int kv_dtype, void* qkv, int64_t rows, int64_t row_stride,
                       int64_t heads, int64_t kv_heads, int64_t dim, const int64_t* positions,
                       const float* cos, const float* sin, void* k_cache, void* v_cache,
                       const int64_t* slots, int threads);
int weir_decode_attention(int dtype, int kv_dtype, const void* q, const void* k_cache,
                          const void* v_cache, void* out, const int64_t* seqs, int64_t n,
                          const int32_t* block_tables, int64_t table_width,
                          const int32_t* row_lens, int64_t heads, int64_t q_row,
                          int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                          int num_threads, int amx);
}

namespace {

// A weight in the small-batch layout (cpu_linear.pack_small_batch) and how it runs.
struct Linear {
    const void* w;
    const void* bias;          // [n] or null
    int64_t n, k;
    int32_t kind;              // 0: the vector kernel (weir_gemv_*), 1: AMX tiles (bf16)
    int32_t pad;
};

struct Layer {
    Linear qkv, o, gate_up, down;
    const void* mlp_norm;
    const void* next_norm;     // the next layer's attn_norm; null for the last layer
    void* k_cache;             // this layer's [num_blocks, block_size, kv_heads, dim]
    void* v_cache;
};

struct Step {
    int32_t dtype;             // 0 float32, 1 bfloat16
    int32_t threads;
    int64_t rows, hidden, heads, kv_heads, head_dim, inter;
    void* h;                   // [rows, hidden] the residual stream, updated in place
    void* x;                   // [rows, hidden] the first layer's normed input; overwritten
    void* qkv;                 // [rows, (heads + 2 kv_heads) dim] scratch
    void* attn;                // [rows, heads dim] scratch
    void* gate_up;             // [rows, 2 inter] scratch (the unfused gate_up only)
    void* act;                 // [rows, inter] scratch
    void* delta;               // [rows, hidden] out: the last layer's down projection
    const int64_t* positions;  // [rows]
    const float* cos;          // [max_position, dim] float32
    const float* sin;
    const int64_t* slots;      // [rows] cache slot of each row's key and value (-1: none)
    const int64_t* seqs;       // [rows] each row's sequence (its block table's row)
    const int32_t* row_lens;   // [rows] keys each row attends (position + 1)
    const int32_t* tables;     // [sequences, table_width]
    int64_t table_width, block_size;
    float scale, eps;
    int32_t amx_attention;
    int32_t kv_dtype;          // the caches': dtype's own, or 2 fp8 E4M3, 3 fp8 E5M2
    // null, or 7 accumulators for weir_forward_layers' parts (bench_step's breakdown): qkv,
    // rope+kv write, attention, o, add+norm, gate_up, down (cpu_forward.LAYER_PARTS)
    double* seconds;
};

// Adds the seconds since the last mark to part p (when timing).
struct Clock {
    double* acc;
    std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
    void mark(int p) {
        if (acc == nullptr) return;
        const auto now = std::chrono::steady_clock::now();
        acc[p] += std::chrono::duration<double>(now - t).count();
        t = now;
    }
};

int linear(const Step& s, const Linear& l, const void* x, int64_t ldx, void* y) {
    if (s.dtype == 0)
        return l.kind == 0 ? weir_gemv_f32(static_cast<const float*>(x), ldx,
                                           static_cast<const float*>(l.w),
                                           static_cast<const float*>(l.bias),
                                           static_cast<float*>(y), s.rows, l.n, l.k, s.threads)
                           : -1;
    auto run = l.kind == 1 ? weir_gemm_amx_bf16 : weir_gemv_bf16;
    return run(static_cast<const uint16_t*>(x), ldx, static_cast<const uint16_t*>(l.w),
               static_cast<const uint16_t*>(l.bias), static_cast<uint16_t*>(y), s.rows, l.n,
               l.k, s.threads);
}

}  // namespace

extern "C" {

// Layers [0, num_layers) of one step, as LlamaModel.forward runs each: qkv, RoPE on q and
// k with the new keys and values to the cache (one pass), paged attention, o, h += o and
// the MLP's norm, gate_up and silu * up, down, h += down and the next layer's norm; the last
// layer's down projection is left in `delta` (LlamaModel.head adds it to the sampled rows
// only, then takes their final norm). Returns 0, or the 1-based index of the layer whose
// kernel refused its shapes.
int weir_forward_layers(const Layer* layers, int64_t num_layers, const Step* step) {
    const Step& s = *step;
    const int64_t n_q = s.heads * s.head_dim, n_kv = s.kv_heads * s.head_dim;
    const int64_t qkv_n = n_q + 2 * n_kv;
    Clock clock{s.seconds};
    for (int64_t i = 0; i < num_layers; ++i) {
        const Layer& l = layers[i];
        const int bad = static_cast<int>(i + 1);
        if (linear(s, l.qkv, s.x, s.hidden, s.qkv) != 0) return bad;
        clock.mark(0);
        // RoPE on q and k and the new keys and values to the cache in one pass
        if (weir_rope_write_kv(s.dtype, s.kv_dtype, s.qkv, s.rows, qkv_n, s.heads, s.kv_heads,
                               s.head_dim, s.positions, s.cos, s.sin, l.k_cache, l.v_cache,
                               s.slots, s.threads) != 0)
            return bad;
        clock.mark(1);
        if (weir_decode_attention(s.dtype, s.kv_dtype, s.qkv, l.k_cache, l.v_cache, s.attn, s.seqs, s.rows,
                                  s.tables, s.table_width, s.row_lens, s.heads, qkv_n,
                                  s.kv_heads, s.head_dim, s.block_size, s.scale, s.threads,
                                  s.amx_attention) != 0)
            return bad;
        clock.mark(2);
        if (linear(s, l.o, s.attn, n_q, s.delta) != 0) return bad;
        clock.mark(3);
        weir_add_rms_norm(s.dtype, s.h, s.delta, l.mlp_norm, s.x, s.rows, s.hidden, s.eps,
                          s.threads);
        clock.mark(4);
        if (l.gate_up.kind == 1 && s.dtype == 1 && l.gate_up.bias == nullptr) {
            if (weir_gemm_amx_bf16_silu_mul(static_cast<const uint16_t*>(s.x), s.hidden,
                                            static_cast<const uint16_t*>(l.gate_up.w),
                                            static_cast<uint16_t*>(s.act), s.rows, s.inter,
                                            s.hidden, s.threads) != 0)
                return bad;
        } else {
            if (linear(s, l.gate_up, s.x, s.hidden, s.gate_up) != 0) return bad;
            weir_silu_mul(s.dtype, s.gate_up, s.act, s.rows, s.inter, s.threads);
        }
        clock.mark(5);
        if (linear(s, l.down, s.act, s.inter, s.delta) != 0) return bad;
        clock.mark(6);
        if (l.next_norm != nullptr)
            weir_add_rms_norm(s.dtype, s.h, s.delta, l.next_norm, s.x, s.rows, s.hidden, s.eps,
                              s.threads);
        clock.mark(4);
    }
    return 0;
}

// Time-keeping for benchmarks (scripts/bench/step.py's GEMM floor): n linear layers run
// back to back on the same rows x [rows, ldx] into y, each its own weight, with no Python
// between them, as weir_forward_layers runs them. dtype 0 float32, 1 bfloat16. Returns 0,
// or the 1-based index of the weight whose kernel refused.
int weir_linear_chain(const Linear* ls, int64_t n, int32_t dtype, const void* x, int64_t ldx,
                      void* y, int64_t rows, int32_t threads) {
    Step s{};
    s.dtype = dtype;
    s.threads = threads;
    s.rows = rows;
    for (int64_t i = 0; i < n; ++i)
        if (linear(s, ls[i], x, ldx, y) != 0) return static_cast<int>(i + 1);
    return 0;
}

}
