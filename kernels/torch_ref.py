"""Reference paged attention in plain torch (the CPU backend).

Each :class:`~kernels.metadata.AttentionGroup` is gathered from the cache into a padded
dense batch with one index op and run through ``scaled_dot_product_attention`` (prefill)
or two batched matmuls (decode: one query per sequence).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.kv_cache import is_fp8, quantize
from kernels.metadata import AttentionMetadata


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store new keys/values ``[T, kv_heads, head_dim]`` into their slots of one layer's
    ``[num_blocks, block_size, kv_heads, head_dim]`` caches (in place), rounded to the
    cache's type (:func:`~kernels.kv_cache.quantize`)."""
    for cache, new in ((k_cache, k), (v_cache, v)):
        flat = cache.view(-1, *cache.shape[2:])
        new = quantize(new, cache.dtype)
        if is_fp8(cache.dtype):           # (no index_copy_ for float8 types: their bytes)
            flat, new = flat.view(torch.uint8), new.view(torch.uint8)
        flat.index_copy_(0, meta.slot_mapping, new)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of queries ``[T, heads, head_dim]`` over each sequence's cached
    prefix plus its new tokens (which must already be written with :func:`write_kv`).

    Grouped-query attention: ``heads`` must be a multiple of the cache's kv_heads.
    Returns ``[T, heads, head_dim]`` in ``q``'s dtype.
    """
    if meta.num_tokens and not meta.groups:
        raise ValueError("metadata without gather groups (static decode buffers) needs a "
                         "GPU backend (triton or flash_attn)")
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    keys = k_cache.reshape(-1, kv_heads, dim)
    values = v_cache.reshape(-1, kv_heads, dim)
    out = q.new_empty(q.shape)
    for g in meta.groups:
        b, length = g.kv_slots.shape
        slots = g.kv_slots.reshape(-1)
        qg = q.index_select(0, g.query_index.reshape(-1)).view(b, -1, heads, dim).transpose(1, 2)
        kg = keys.index_select(0, slots).view(b, length, kv_heads, dim).to(q.dtype)
        kg = kg.transpose(1, 2)
        vg = values.index_select(0, slots).view(b, length, kv_heads, dim).to(q.dtype)
        vg = vg.transpose(1, 2)
        if qg.shape[2] == 1:
            o = _decode_attention(qg, kg, vg, g.mask, scale)
        else:
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale,
                                               enable_gqa=heads != kv_heads)
        o = o.transpose(1, 2).reshape(-1, heads, dim)
        out.index_copy_(0, g.token_rows, o.index_select(0, g.out_index))
    return out


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query per sequence: two batched matmuls with the query heads of each kv head
    stacked, softmax in float32. CPU SDPA's flash kernel is slow for a single query row
    (especially in bf16), and this needs no repeat of K/V for GQA.

    ``q`` [B, H, 1, D], ``k``/``v`` [B, KVH, L, D], ``mask`` [B, 1, 1, L] → [B, H, 1, D].
    """
    b, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(b, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    scores.masked_fill_(~mask.view(b, 1, 1, -1), float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, heads, 1, dim)
