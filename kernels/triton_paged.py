"""Paged attention in Triton (the GPU backend; checked on CPU under TRITON_INTERPRET=1).

Two kernels over the same paged cache ``[num_blocks, block_size, kv_heads, head_dim]``:

- ``_prefill_kernel``: variable-length queries, one program per (sequence, query tile,
  head), attending causally to the sequence's cached prefix and its new tokens (already
  written by ``write_kv``), block by block through the block table, with online softmax.
- ``_decode_kernel``: one query per sequence, FlashDecoding style: the context is split into
  partitions of ``PARTITION_BLOCKS`` blocks, one program per (sequence, kv head, partition)
  serving all the query heads of that kv head; ``_merge_kernel`` combines the partitions'
  partial results with a log-sum-exp reduction, one program per (sequence, query head).

The decode path is CUDA-graph safe: no host syncs, and its grid depends only on host
lists in the metadata (the number of sequences and ``max(context_lens)``), so metadata from
:meth:`AttentionMetadata.for_decode_buffers` (upper-bound context lengths) gives a fixed grid
whose partitions past a sequence's end do nothing. ``write_kv`` skips negative slots, which
padding rows of a captured batch use. Dot products run in IEEE fp32 for float32 caches and
TF32 otherwise (bf16/fp16 inputs are exact in TF32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_cache import FP8_FORMATS
from kernels.metadata import AttentionMetadata


@triton.jit
def _fp8_code(x, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr):
    """``x`` as fp8 codes (uint8): round to nearest even, saturated, NaN kept; the integer
    arithmetic of kernels/csrc/cpu_fp8.h, so every backend stores the same bytes as
    kernels.kv_cache.quantize (the conversion instructions differ in saturation, and
    Triton's interpreter rounds some carries into the next binade wrong)."""
    SHIFT: tl.constexpr = 23 - MANT
    b = x.to(tl.float32).to(tl.uint32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    normal = ((a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT) \
        - ((127 - BIAS) << MANT)
    af = a.to(tl.float32, bitcast=True)
    # subnormal: a multiple of the smallest step, rounded to nearest even by the 2^23 trick
    # (the others, NaN included, go in as 0: no out-of-range cast)
    small = af < 2.0 ** (1 - BIAS)
    sub = ((tl.where(small, af, 0.0) * (2.0 ** (BIAS + MANT - 1)) + 8388608.0)
           - 8388608.0).to(tl.uint32)
    code = tl.where(small, sub, normal)
    code = tl.minimum(code, MAX_CODE)
    code = tl.where(a > 0x7F800000, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _write_kv_kernel(K, V, KC, VC, SLOTS, row, sk_t, sv_t, ROW_PAD: tl.constexpr,
                     MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:  # padding rows of a captured batch have slot -1
        cols = tl.arange(0, ROW_PAD)
        ok = cols < row
        k = tl.load(K + t * sk_t + cols, mask=ok)
        v = tl.load(V + t * sv_t + cols, mask=ok)
        if MANT > 0:  # an fp8 cache (its bytes): rounded as quantize rounds
            k = _fp8_code(k, MANT, BIAS, MAX_CODE)
            v = _fp8_code(v, MANT, BIAS, MAX_CODE)
        tl.store(KC + slot * row + cols, k, mask=ok)
        tl.store(VC + slot * row + cols, v, mask=ok)


@triton.jit
def _online_softmax(scores, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one block of masked scores into the running max, sum and weighted values."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return (m_new, l_i * alpha + tl.sum(p, 1),
            acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION))


@triton.jit
def _prefill_kernel(Q, KC, VC, O, BT, SEQ_LENS, QSTART, scale,  # noqa: E741 - O: the output
                    sq_t, sq_h, sk_b, sk_s, sk_h, bt_stride, so_t, so_h,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr):
    s = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q0 = tl.load(QSTART + s)
    q_len = tl.load(QSTART + s + 1) - q0
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(SEQ_LENS + s)
        ctx = seq_len - q_len
        m_offs = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_DIM)
        row_ok = m_offs < q_len
        q = tl.load(Q + (q0 + m_offs)[:, None] * sq_t + h * sq_h + d[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        q_pos = ctx + m_offs
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        last = ctx + tl.minimum((tile + 1) * BLOCK_M, q_len)
        n_blocks = (last + BLOCK_SIZE - 1) // BLOCK_SIZE
        offs = tl.arange(0, BLOCK_SIZE)
        for b in range(0, n_blocks):
            block = tl.load(BT + s * bt_stride + b).to(tl.int64)  # int64 offsets
            base = block * sk_b + kvh * sk_h
            k = tl.load(KC + base + offs[:, None] * sk_s + d[None, :]).to(tl.float32)
            v = tl.load(VC + base + offs[:, None] * sk_s + d[None, :]).to(tl.float32)
            k_pos = b * BLOCK_SIZE + offs
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            ok = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
            scores = tl.where(ok, scores, float("-inf"))
            m_i, l_i, acc = _online_softmax(scores, v, m_i, l_i, acc, PRECISION)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(O + (q0 + m_offs)[:, None] * so_t + h * so_h + d[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _decode_kernel(Q, KC, VC, ACC, ML, BT, SEQ_LENS, scale,
                   sq_t, sq_h, sk_b, sk_s, sk_h, bt_stride, num_parts,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, PARTITION_BLOCKS: tl.constexpr,
                   PRECISION: tl.constexpr):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    num_kv = tl.num_programs(1)
    seq_len = tl.load(SEQ_LENS + s)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_ok = g < GROUP
    q = tl.load(Q + s * sq_t + (kvh * GROUP + g)[:, None] * sq_h + d[None, :],
                mask=g_ok[:, None], other=0.0).to(tl.float32)
    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
    total_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    first = part * PARTITION_BLOCKS
    stop = tl.minimum(first + PARTITION_BLOCKS, total_blocks)
    offs = tl.arange(0, BLOCK_SIZE)
    for b in range(first, stop):
        block = tl.load(BT + s * bt_stride + b).to(tl.int64)  # int64 offsets
        base = block * sk_b + kvh * sk_h
        k = tl.load(KC + base + offs[:, None] * sk_s + d[None, :]).to(tl.float32)
        v = tl.load(VC + base + offs[:, None] * sk_s + d[None, :]).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where((b * BLOCK_SIZE + offs)[None, :] < seq_len, scores, float("-inf"))
        m_i, l_i, acc = _online_softmax(scores, v, m_i, l_i, acc, PRECISION)
    # partial results [seq, kv head, partition, GROUP]: only the real query heads are stored
    row = ((s * num_kv + kvh) * num_parts + part) * GROUP + g
    tl.store(ACC + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None])
    tl.store(ML + row * 2, m_i, mask=g_ok)
    tl.store(ML + row * 2 + 1, l_i, mask=g_ok)


@triton.jit
def _merge_kernel(ACC, ML, O, so_t, so_h, num_parts, GROUP: tl.constexpr,  # noqa: E741 - O: output
                  HEAD_DIM: tl.constexpr, PARTS_PAD: tl.constexpr):
    """Log-sum-exp merge of one (sequence, query head)'s partitions; empty partitions
    (max -inf, sum 0) get weight 0."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    num_kv = tl.num_programs(1) // GROUP
    p = tl.arange(0, PARTS_PAD)
    ok = p < num_parts
    row = ((s * num_kv + h // GROUP) * num_parts + p) * GROUP + h % GROUP
    m = tl.load(ML + row * 2, mask=ok, other=float("-inf"))
    lsum = tl.load(ML + row * 2 + 1, mask=ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(ACC + row[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
    den = tl.sum(lsum * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(den == 0.0, 1.0, den)
    tl.store(O + s * so_t + h * so_h + d, out.to(O.dtype.element_ty))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store new keys/values ``[T, kv_heads, head_dim]`` at ``meta.slot_mapping``. Each
    token's heads must be one dense row (views of the fused qkv rows are, and are read in
    place: no copy kernel); anything else is copied first."""
    t = k.shape[0]
    if t == 0:
        return
    row = k.shape[1] * k.shape[2]
    # an fp8 cache: rounded in the kernel (no launches around it), stored as bytes
    fmt = FP8_FORMATS.get(k_cache.dtype, (0, 0, 0))
    if fmt[0]:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:
        k, v = _dense_rows(k, k_cache.dtype), _dense_rows(v, v_cache.dtype)
    k, v = _dense_rows(k, k.dtype), _dense_rows(v, v.dtype)
    _write_kv_kernel[(t,)](k, v, k_cache, v_cache, meta.slot_mapping, row, k.stride(0),
                           v.stride(0), ROW_PAD=triton.next_power_of_2(row), MANT=fmt[0],
                           BIAS=fmt[1], MAX_CODE=fmt[2])


def _dense_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [T, heads, dim]`` in ``dtype`` with each token's heads dense (any row stride)."""
    x = x.to(dtype)
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def _pow2(n: int, at_least: int = 16) -> int:
    return max(at_least, triton.next_power_of_2(n))


MAX_PARTITIONS = 64
PARTITION_BLOCKS = 16                   # the plain function's default (see TritonBackend)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, block_m: int = 16,
                    partition_blocks: int = PARTITION_BLOCKS,
                    out: torch.Tensor | None = None, invariant: bool = False) -> torch.Tensor:
    """Same contract as :func:`kernels.torch_ref.paged_attention`.

    Decode splits each context into partitions of ``partition_blocks`` blocks, widened so
    that there are at most ``MAX_PARTITIONS`` of them. ``out``: where the result goes
    (``q``'s shape and dtype, unit stride along the head dimension; a CUDA graph's static
    buffer), returned. ``invariant`` (a deterministic step): every row, decode rows too,
    through the prefill kernel: one program per (sequence, query tile, head) walks the
    keys block by block from position 0, so a row's reduction order depends on its own
    position only (no partition chosen by the batch size or its longest context, no merge).
    """
    tokens, heads, dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if q.stride(2) != 1:
        q = q.contiguous()      # views of the fused qkv rows are read in place
    bt = meta.block_tables
    n = len(meta.query_lens)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError("out must have q's shape and dtype, with unit stride per head")
    if n == 0:
        return out
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
               k_cache.stride(2), bt.stride(0))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"   # (fp8 caches: q's)
    if not invariant and all(ql == 1 for ql in meta.query_lens):
        max_blocks = -(-max(c + 1 for c in meta.context_lens) // block_size)
        partition_blocks = max(partition_blocks, -(-max_blocks // MAX_PARTITIONS))
        parts = -(-max_blocks // partition_blocks)
        acc = torch.empty(n, kv_heads, parts, group, dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(n, kv_heads, parts, group, 2, dtype=torch.float32, device=q.device)
        _decode_kernel[(n, kv_heads, parts)](
            q, k_cache, v_cache, acc, ml, bt, meta.seq_lens, scale, *strides, parts,
            GROUP=group, GROUP_PAD=_pow2(group), BLOCK_SIZE=block_size, HEAD_DIM=dim,
            PARTITION_BLOCKS=partition_blocks, PRECISION=precision)
        _merge_kernel[(n, heads)](acc, ml, out, out.stride(0), out.stride(1), parts,
                                  GROUP=group, HEAD_DIM=dim,
                                  PARTS_PAD=_pow2(parts, 2))
        return out
    tiles = -(-max(meta.query_lens) // block_m)
    _prefill_kernel[(n, tiles, heads)](
        q, k_cache, v_cache, out, bt, meta.seq_lens, meta.query_start_loc, scale, *strides,
        out.stride(0), out.stride(1), GROUP=group, BLOCK_M=block_m, BLOCK_SIZE=block_size,
        HEAD_DIM=dim, PRECISION=precision)
    return out


SMALL_DECODE_BATCH = 16                 # up to this many sequences: 2-block partitions


def decode_partition_blocks(seqs: int) -> int:
    """The FlashDecoding partition (KV blocks of a program) for a decode batch of ``seqs``.
    Measured on an H200 (``scripts/gpu_check`` [4c], SmolLM2-135M-shaped bf16 steps replayed
    as CUDA graphs sized for 2048 tokens, 512 tokens of context): 2 blocks won at batch 1
    and 8 (1.18 and 1.25 ms against 1.72 and 1.68 with 16: few sequences need many programs
    to fill the SMs), 8 blocks at 64 and 256 (1.82 and 3.88 ms; 2 blocks 2.26 and 5.47:
    many tiny programs, and a wider merge)."""
    return 2 if seqs <= SMALL_DECODE_BATCH else 8


class TritonBackend:
    """The Triton kernels as an attention backend. ``partition_blocks`` is decode's
    FlashDecoding partition (KV blocks per program, widened to at most ``MAX_PARTITIONS``
    partitions); None picks it by batch size (:func:`decode_partition_blocks`)."""
    name = "triton"
    graph_safe = True  # decode from static buffers is capturable; write_kv skips slot -1
    write_kv = staticmethod(write_kv)

    def __init__(self, partition_blocks: int | None = None) -> None:
        self.partition_blocks = partition_blocks

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        out: torch.Tensor | None = None, invariant: bool = False) -> torch.Tensor:
        """``invariant``: a deterministic step's form (:func:`paged_attention`)."""
        blocks = self.partition_blocks or decode_partition_blocks(len(meta.query_lens))
        return paged_attention(q, k_cache, v_cache, meta, scale, partition_blocks=blocks,
                               out=out, invariant=invariant)
