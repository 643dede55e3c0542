"""Random paged-attention cases shared by the kernel tests and scripts/gpu_check: caches,
queries and metadata over shuffled, non-contiguous block tables."""
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
