"""Random paged-attention cases shared by the kernel tests and scripts/gpu_check: caches,
queries and metadata over shuffled, non-contiguous block tables, and their decode rows as
a CUDA graph's static buffers."""
from __future__ import annotations

import random

import torch

from kernels.metadata import AttentionMetadata


def random_paged_case(rng: random.Random, device, dtype, block_size: int, kv_heads: int,
                      group: int, query_lens: list[int], context_lens: list[int], dim: int = 64,
                      lookahead: int = 0):
    """``(q, k, v, k_cache, v_cache, meta)``: ``q`` [T, kv_heads * group, dim], new ``k``/``v``
    [T, kv_heads, dim], caches with ``sum(blocks needed) + 3`` blocks, and each sequence's
    table shuffled, followed by up to ``lookahead`` spare blocks (as a scheduler leases)."""
    need = [-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens)]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n] + [ids[-1]] * rng.randint(0, lookahead))
        at += n
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    t = sum(query_lens)
    make = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    cache = (num_blocks, block_size, kv_heads, dim)
    kc, vc = make(*cache), make(*cache)
    q, k, v = make(t, kv_heads * group, dim), make(t, kv_heads, dim), make(t, kv_heads, dim)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size, device)
    return q, k, v, kc, vc, meta


def padded_decode_buffers(meta: AttentionMetadata, contexts: list[int], pad: int,
                          tables: torch.Tensor, max_seq_len: int) -> AttentionMetadata:
    """``meta``'s decode rows (at ``contexts``) as a CUDA graph replays them
    (:meth:`AttentionMetadata.for_decode_buffers`): ``pad`` padding rows after them (slot
    -1, one key), over ``tables`` [rows + pad, width], whose first columns get ``meta``'s
    block tables (the rest is left as the caller filled it)."""
    n, device = len(contexts), tables.device
    tables[:n, :meta.block_tables.shape[1]] = meta.block_tables
    i32 = dict(dtype=torch.int32, device=device)
    return AttentionMetadata.for_decode_buffers(
        positions=torch.tensor(contexts + [0] * pad, device=device),
        slot_mapping=torch.cat([meta.slot_mapping, torch.full((pad,), -1, device=device)]),
        seq_lens=torch.cat([meta.seq_lens, torch.ones(pad, **i32)]),
        query_start_loc=torch.arange(n + pad + 1, **i32), block_tables=tables,
        block_size=meta.block_size, max_seq_len=max_seq_len)
