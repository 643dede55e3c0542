"""Native CPU kernels on the native library (:mod:`kernels.native_lib`): paged attention
(the ``cpu`` attention backend; the torch reference does what it does not compile),
token sampling, and the fused elementwise ops of the forward.

The attention reads each sequence's keys and values straight from its blocks (no gather
into a padded copy). If the library does not build, the backend refuses (ValueError) and
``get_backend("auto")`` falls back to ``torch``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kernels import torch_ref
from kernels.kv_cache import is_fp8
from kernels.metadata import AttentionMetadata
from kernels.native_lib import DTYPES, KV_DTYPES, load

MODE_AMX, MODE_INVARIANT = 1, 2      # weir_decode_attention's mode bits


def attention_mode(amx: bool, invariant: bool) -> int:
    """The native attention's mode: the AMX tiles, and the batch-invariant kernels (a
    deterministic step: no prompt kernel, each row reduced in an order fixed by its own
    key count; AMX tiles of one row each)."""
    return (MODE_AMX if amx else 0) | (MODE_INVARIANT if invariant else 0)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, amx: bool = False,
                    invariant: bool = False) -> torch.Tensor:
    """Every new token at once, decode and prefill alike: the token at position p attends
    keys 0..p of its sequence (causal), read in place from the blocks. ``q``'s rows may be
    apart (a view into the fused qkv projection); its heads must be packed. ``amx``: the
    AMX kernel (bf16, block size a multiple of 16,
    :func:`~kernels.native_lib.amx_supported`). ``invariant``: each row's result depends
    on its own query and keys only, not on the rows beside it (:func:`attention_mode`).
    The caches are q's dtype, or fp8 (widened as read)."""
    if q.dtype not in DTYPES or not (k_cache.dtype == q.dtype or is_fp8(k_cache.dtype)):
        raise ValueError(f"native attention needs q in one of {list(DTYPES)} and the cache "
                         f"in q's dtype or fp8, not {q.dtype} and {k_cache.dtype}")
    if not (q.stride(2) == 1 and q.stride(1) == q.shape[2] and k_cache.is_contiguous()
            and v_cache.is_contiguous()):
        raise ValueError("native attention needs q's heads packed and contiguous caches")
    out = q.new_empty(q.shape)
    seqs, row_lens, tables = kernel_rows(meta)
    heads, dim = q.shape[1], q.shape[2]
    rc = load().weir_decode_attention(
        DTYPES[q.dtype], KV_DTYPES[k_cache.dtype], q.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), out.data_ptr(), seqs.data_ptr(), q.shape[0], tables.data_ptr(),
        tables.shape[1], row_lens.data_ptr(),
        heads, q.stride(0), k_cache.shape[2], dim, k_cache.shape[1], scale,
        torch.get_num_threads(), attention_mode(amx, invariant))
    if rc != 0:
        raise ValueError(f"native attention refused shapes: heads {heads}, kv heads "
                         f"{k_cache.shape[2]}, dim {dim}")
    return out


def kernel_rows(meta: AttentionMetadata):
    """The kernel's per-step arguments for every row of ``meta`` (:func:`_kernel_rows`),
    built once per step, not per layer."""
    args = meta.derived.get("cpu")
    if args is None:
        args = meta.derived["cpu"] = _kernel_rows(meta.token_seq, meta.positions, meta)
    return args


def _kernel_rows(token_seq: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
    """The kernel's per-step arguments for these rows: each row's sequence, its key count
    (position + 1), and the block tables."""
    return (token_seq.contiguous(), (positions + 1).to(torch.int32),
            meta.block_tables.contiguous())


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """:func:`torch_ref.write_kv` natively: rows of ``k``/``v`` [T, kv_heads, dim] may be
    views with a row stride (the fused qkv projection); other layouts go through torch. An
    fp8 cache gets the rows rounded as :func:`~kernels.kv_cache.quantize` rounds them."""
    row = k.shape[1] * k.shape[2]
    fp8 = is_fp8(k_cache.dtype) and k.dtype in DTYPES
    if not ((k.dtype == k_cache.dtype or fp8) and k.dtype == v.dtype and k.shape == v.shape
            and k.stride(0) == v.stride(0) and k.stride(1) == k.shape[2] and k.stride(2) == 1
            and v.stride(1) == v.shape[2] and v.stride(2) == 1 and k_cache.is_contiguous()
            and v_cache.is_contiguous() and meta.slot_mapping.dtype == torch.long
            and row == k_cache.shape[2] * k_cache.shape[3]):
        return torch_ref.write_kv(k_cache, v_cache, k, v, meta)
    size = k.element_size()
    slots = meta.slot_mapping.contiguous()
    if fp8:
        load().weir_write_kv_fp8(DTYPES[k.dtype], KV_DTYPES[k_cache.dtype], k.data_ptr(),
                                 v.data_ptr(), k.stride(0), k_cache.data_ptr(),
                                 v_cache.data_ptr(), row, slots.data_ptr(), slots.numel())
        return
    load().weir_write_kv(k.data_ptr(), v.data_ptr(), k.stride(0) * size, k_cache.data_ptr(),
                         v_cache.data_ptr(), row * size, slots.data_ptr(), slots.numel())


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, u: torch.Tensor, keys: torch.Tensor | None = None
           ) -> torch.Tensor:
    """One token per row of float32 ``logits`` [S, vocab] (every temperature > 0): top-k,
    then top-p on the renormalised survivors, then a row with ``keys[r]`` >= 0 by the
    exponential race seeded by it, another by the inverse-CDF draw at ``u[r]``."""
    x = logits.contiguous()
    t = temperature.to(torch.float32).contiguous()
    k = top_k.to(torch.int64).contiguous()
    p = top_p.to(torch.float32).contiguous()
    uu = u.to(torch.float32).contiguous()
    kk = (torch.full((x.shape[0],), -1, dtype=torch.int64) if keys is None
          else keys.to(torch.int64).contiguous())
    out = torch.empty(x.shape[0], dtype=torch.int64)
    load().weir_sample(x.data_ptr(), x.shape[0], x.shape[1], t.data_ptr(), k.data_ptr(),
                       p.data_ptr(), uu.data_ptr(), kk.data_ptr(), out.data_ptr(),
                       torch.get_num_threads())
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for float32 rows [S, vocab] (first maximum), rows in parallel:
    64 x 49k rows in ~0.2 ms where torch takes ~1.5 ms on 2 cores."""
    x = logits.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    load().weir_argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(),
                       torch.get_num_threads())
    return out


def apply_bitmask(logits: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor) -> None:
    """Structured output: in float32 ``logits`` [S, vocab] (contiguous; in place), row
    ``rows[j]``'s tokens whose bit is clear in ``masks[j]`` (int32 [n, words], token ``t``
    bit ``t % 32`` of word ``t // 32``) to -inf."""
    assert logits.is_contiguous() and logits.dtype == torch.float32
    assert masks.dtype == torch.int32 and masks.is_contiguous() and rows.dtype == torch.int64
    assert masks.shape[1] * 32 >= logits.shape[1] and masks.shape[0] == rows.numel()
    load().weir_apply_bitmask(logits.data_ptr(), logits.shape[1], masks.data_ptr(),
                              masks.shape[1], rows.data_ptr(), rows.numel(),
                              torch.get_num_threads())


def logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For float32 rows [S, vocab]: each row's log-sum-exp [S], and its ``k``
    largest logits [S, k] and their ids [S, k], largest first (ties: the earlier id)."""
    x = logits.contiguous()
    rows = x.shape[0]
    lse = torch.empty(rows, dtype=torch.float32)
    vals = torch.empty(rows, k, dtype=torch.float32)
    ids = torch.empty(rows, k, dtype=torch.int64)
    load().weir_logprobs(x.data_ptr(), rows, x.shape[1], k, lse.data_ptr(), ids.data_ptr(),
                         vals.data_ptr(), torch.get_num_threads())
    return lse, vals, ids


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 out: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` (in place, if given), then ``out = rmsnorm(h) * weight``; rows of
    ``h`` [T, hidden] contiguous, all in one dtype (float32 or bfloat16)."""
    load().weir_add_rms_norm(DTYPES[h.dtype], h.data_ptr(),
                             None if delta is None else delta.contiguous().data_ptr(),
                             weight.data_ptr(), out.data_ptr(), h.shape[0], h.shape[1], eps,
                             torch.get_num_threads())
    return out


def rope_(qkv: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor,
          cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place on the first ``heads`` heads of each contiguous qkv row;
    ``cos``/``sin`` float32 tables [max_position, head_dim]."""
    pos = positions.contiguous()
    load().weir_rope(DTYPES[qkv.dtype], qkv.data_ptr(), qkv.shape[0], qkv.stride(0), heads,
                     head_dim, pos.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                     torch.get_num_threads())


def rope_write_kv_(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                   positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """:func:`rope_` on the q and k heads of the fused qkv rows ``[T, (heads + 2 kv_heads)
    x head_dim]`` (in place), then each row's k and v heads to its cache slot ``slots[t]``
    (-1: none) of one layer's caches ``[num_blocks, block_size, kv_heads, head_dim]``, in one
    pass over the rows (each row's keys stored while still in L1) and one parallel region:
    the same bytes, in qkv and in the caches (fp8: rounded as :func:`write_kv` rounds), as
    ``rope_`` then :func:`write_kv`. Layouts the kernel does not take go that way."""
    row = kv_heads * head_dim
    fp8 = is_fp8(k_cache.dtype)
    if not (qkv.dtype in DTYPES and (k_cache.dtype == qkv.dtype or fp8)
            and v_cache.dtype == k_cache.dtype and qkv.dim() == 2 and qkv.stride(1) == 1
            and qkv.shape[1] == (heads + 2 * kv_heads) * head_dim and head_dim <= 256
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and slots.dtype == torch.long and row == k_cache.shape[2] * k_cache.shape[3]):
        rope_(qkv, heads + kv_heads, head_dim, positions, cos, sin)
        n_q = heads * head_dim
        k = qkv[:, n_q:n_q + row].view(-1, kv_heads, head_dim)
        v = qkv[:, n_q + row:].view(-1, kv_heads, head_dim)
        write_kv(k_cache, v_cache, k, v, _Slots(slots))
        return
    pos, slots = positions.contiguous(), slots.contiguous()
    rc = load().weir_rope_write_kv(DTYPES[qkv.dtype], KV_DTYPES[k_cache.dtype], qkv.data_ptr(),
                                   qkv.shape[0], qkv.stride(0), heads, kv_heads, head_dim,
                                   pos.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                   k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                                   torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"rope_write_kv_ does not store {qkv.dtype} rows in a "
                         f"{k_cache.dtype} cache")


@dataclasses.dataclass
class _Slots:
    """What :func:`write_kv` (and torch_ref's) reads of a step's metadata: its slots."""
    slot_mapping: torch.Tensor


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for contiguous fused rows [T, 2 * inter], into ``out`` (contiguous
    [T, inter]) where given."""
    inter = gate_up.shape[1] // 2
    if out is None:
        out = gate_up.new_empty(gate_up.shape[0], inter)
    elif out.shape != (gate_up.shape[0], inter) or not out.is_contiguous() \
            or out.dtype != gate_up.dtype:
        raise ValueError(f"silu_mul writes contiguous {gate_up.dtype} "
                         f"[{gate_up.shape[0]}, {inter}], not {out.dtype} {tuple(out.shape)}")
    load().weir_silu_mul(DTYPES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(),
                         gate_up.shape[0], inter, torch.get_num_threads())
    return out


class CpuBackend:
    """Every token through the native kernel (decode and prefill), the torch reference for
    shapes not compiled in. With ``fresh_prompts = "sdpa"`` (the executor's plan sets it
    where it measured faster), the rows of a prompt whose first chunk is in this step (no
    cached context: its keys are exactly this step's new keys) go through torch's fused
    causal attention on the new keys and values instead; on the 2-core AMX Xeon that was
    2x the vector kernel for 16 x 128-token prompts (oneDNN's tiles vs. its dot products).
    ``tiles = "amx"`` (the plan sets it where it measured faster) runs the paged kernel's
    q.k and P.V on the AMX tile unit (bf16 with blocks of a multiple of 16 keys; other
    steps keep the vector kernel): there it beats SDPA on those prompts (1.2 against 2.0
    ms a layer for 16 x 128)."""

    name = "cpu"
    takes_new_kv = True              # the model passes this step's k, v to paged_attention
    FRESH_MIN = 16                   # shorter fresh prompts stay on the native kernel

    def __init__(self, dtype: torch.dtype | None = None, **_opts) -> None:
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"the native CPU kernel supports {list(DTYPES)}, not {dtype}")
        load()
        self.write_kv = write_kv
        self.fresh_prompts = "native"
        self.tiles = "vector"            # the paged kernel: "vector", or "amx" (bf16 only)
        self.invariant_tiles = "vector"  # the same, in a deterministic step

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                        invariant: bool = False) -> torch.Tensor:
        """``invariant`` (a deterministic step): every row through the paged kernel's
        invariant form, on ``invariant_tiles``, no fresh prompt through SDPA."""
        fp8 = is_fp8(k_cache.dtype)
        native = supports(q.shape[1], k_cache.shape[2], q.shape[2]) and (
            q.dtype == k_cache.dtype or fp8)
        if not (native and meta.token_seq is not None):
            return torch_ref.paged_attention(q, k_cache, v_cache, meta, scale)
        # (an fp8 cache: every row reads the stored keys, so a prompt attends the same
        # rounded keys whether its first chunk is fresh, cached or chunked)
        fresh = self._fresh(meta) if new_kv is not None and self.fresh_prompts == "sdpa" \
            and not fp8 and not invariant else None
        tiles = self.invariant_tiles if invariant else self.tiles
        amx = tiles == "amx" and q.dtype == torch.bfloat16 and k_cache.shape[1] % 16 == 0
        if not fresh:
            return paged_attention(q, k_cache, v_cache, meta, scale, amx, invariant)
        groups, rest = fresh
        k, v = new_kv
        out = q.new_empty(q.shape)
        for a, n, length in groups:   # n prompts of one length, rows a .. a + n * length
            def batch(x, a=a, n=n, length=length):   # [n * L, H, D] -> [n, H, L, D], a view
                return x[a:a + n * length].view(n, length, *x.shape[1:]).transpose(1, 2)
            o = F.scaled_dot_product_attention(batch(q), batch(k), batch(v), is_causal=True,
                                               scale=scale, enable_gqa=True)  # GQA inside
            batch(out).copy_(o)
        if rest is not None:
            sub = meta.derived["cpu_rest"]
            out[rest] = paged_attention(q[rest].contiguous(), k_cache, v_cache, sub, scale, amx)
        return out

    def paged_only(self, meta: AttentionMetadata) -> bool:
        """Whether :meth:`paged_attention` runs every row of this step through the paged
        kernel (no fresh prompt through SDPA): what the native layer loop runs."""
        return self.fresh_prompts != "sdpa" or self._fresh(meta) is None

    def _fresh(self, meta: AttentionMetadata):
        """Once per step: the fresh prompts (no cached context, at least FRESH_MIN tokens)
        as groups ``(first row, prompts, length)`` of neighbouring prompts of one length
        (one SDPA call each: on 2 AMX cores, 16 x 128 tokens at once is 1.4 ms a layer
        against 2.0 as 16 calls), and the rows left for the native kernel (None if none),
        with a metadata view of those rows."""
        if "cpu_fresh" not in meta.derived:
            starts = meta.query_start_loc.tolist()
            spans = [(starts[i], starts[i + 1]) for i, (c, n) in
                     enumerate(zip(meta.context_lens, meta.query_lens))
                     if c == 0 and n >= self.FRESH_MIN]
            groups: list[list[int]] = []
            for a, b in spans:
                last = groups[-1] if groups else None
                if last and last[2] == b - a and last[0] + last[1] * last[2] == a:
                    last[1] += 1
                else:
                    groups.append([a, 1, b - a])
            rest = None
            if spans and sum(b - a for a, b in spans) < meta.num_tokens:
                keep = torch.ones(meta.num_tokens, dtype=torch.bool)
                for a, b in spans:
                    keep[a:b] = False
                rest = keep.nonzero().squeeze(1)
                meta.derived["cpu_rest"] = dataclasses.replace(meta, derived={
                    "cpu": _kernel_rows(meta.token_seq[rest], meta.positions[rest], meta)})
            meta.derived["cpu_fresh"] = ([tuple(g) for g in groups], rest) if spans else None
        return meta.derived["cpu_fresh"]


def supports(heads: int, kv_heads: int, head_dim: int) -> bool:
    """The shapes compiled into the kernel (others decode through the torch reference)."""
    return (head_dim in (64, 128) and heads <= 64 and heads % kv_heads == 0
            and 1 <= heads // kv_heads <= 8)
