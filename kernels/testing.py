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
    make = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)
    cache = (num_blocks, block_size, kv_heads, dim)
    kc, vc = make(*cache), make(*cache)
    q, k, v = make(t, kv_heads * group, dim), make(t, kv_heads, dim), make(t, kv_heads, dim)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size, device)
    return q, k, v, kc, vc, meta



def random_prompt_case(rng: random.Random, dtype, block_size: int, kv_heads: int, group: int,
                       dim: int = 64):
    """A CPU case for the prompt kernels: 1-3 chunks of 32-257 rows (the prompt kernels' runs),
    fresh or after 15-513 cached keys, beside two decode rows and a 9-row chunk (the decode
    tiles), shuffled; ``(q, k_cache, v_cache, meta, query_lens, context_lens)``."""
    qlens = [rng.choice([32, 33, 47, 64, 100, 257]) for _ in range(rng.randint(1, 3))]
    ctx = [rng.choice([0, 0, 15, 31, 200, 513]) for _ in qlens]
    qlens += [1, 1, 9]                                # decode rows and a short chunk
    ctx += [rng.randint(0, 700) for _ in range(3)]
    order = list(range(len(qlens)))
    rng.shuffle(order)
    qlens, ctx = [qlens[i] for i in order], [ctx[i] for i in order]
    q, _, _, kc, vc, meta = random_paged_case(rng, "cpu", dtype, block_size, kv_heads, group,
                                              qlens, ctx, dim)
    return q, kc, vc, meta, qlens, ctx

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


def plain_draw_miss(sample, rows: int = 200, vocab: int = 49152, temperature: float = 0.7,
                    seed: int = 5) -> float:
    """How far the sampler's plain inverse-CDF draws (no top-k, top-p or seed) land from
    where a float64 cumulative sum puts them, as a fraction of the row's total mass: 0 when
    each chosen token's interval of the running mass holds u of the total. `sample` takes
    (logits, temperatures, top_k, top_p, u), as :func:`kernels.cpu_native.sample`. An index
    distance says little: the tokens around a boundary can be many and light."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    u = torch.rand(rows, generator=g)
    got = sample(x, torch.full((rows,), temperature), torch.zeros(rows, dtype=torch.int64),
                 torch.ones(rows), u)
    e = torch.exp(((x - x.max(1, keepdim=True).values) / temperature).double())
    c = e.cumsum(1)
    total, target = c[:, -1], u.double() * c[:, -1]
    hi = c.gather(1, got[:, None])[:, 0]
    lo = hi - e.gather(1, got[:, None])[:, 0]
    return (torch.clamp(torch.maximum(lo - target, target - hi), min=0) / total).max().item()


def rows_alone(attend, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
    """Each row of ``meta``'s step attended alone, as a one-row decode step at its position
    over the same caches (which already hold the step's keys): ``attend(q, k_cache, v_cache,
    meta)`` once per row. A batch-invariant kernel gives every row the bits it gave in the
    step."""
    seqs, positions = meta.token_seq.tolist(), meta.positions.tolist()
    bs = k_cache.shape[1]
    tables = [meta.block_tables[i, :-(-(q + c) // bs)].tolist()
              for i, (q, c) in enumerate(zip(meta.query_lens, meta.context_lens))]
    out = torch.empty_like(q)
    for i, (s, p) in enumerate(zip(seqs, positions)):
        one = AttentionMetadata.build([1], [p], [tables[s]], bs, q.device)
        out[i:i + 1] = attend(q[i:i + 1].contiguous(), k_cache, v_cache, one)
    return out
