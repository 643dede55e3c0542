"""Paged attention (torch reference) against dense per-sequence causal attention."""
from __future__ import annotations

import math
import random

import pytest
import torch

from kernels import AttentionMetadata, KVCache, get_backend
from kernels.torch_ref import paged_attention, write_kv

D = 16


def _dense_attention(q, k, v, ctx, scale):
    """q [n, H, D]; k, v [ctx + n, KVH, D]; token j of q sits at position ctx + j."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for j in range(q.shape[0]):
        keys = k[: ctx + j + 1]
        scores = torch.einsum("hd,lhd->hl", q[j].double(), keys) * scale
        out[j] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[: ctx + j + 1])
    return out


def _slot(table, pos, bs):
    return table[pos // bs] * bs + pos % bs


def _case(rng: random.Random, bs: int, kv_heads: int, group: int):
    """Random sequences (mixed decode / prefill, prefixes straddling block edges) laid out
    in a shuffled cache; returns everything needed to run and check one step."""
    edge = [0, 1, bs - 1, bs, bs + 1, 2 * bs - 1, 2 * bs, 3 * bs + 1]
    seqs = []
    for _ in range(rng.randint(1, 6)):
        ctx = rng.choice(edge + [rng.randint(0, 4 * bs)])
        q = rng.choice([1, 1, 2, bs - 1, bs, bs + 1, rng.randint(1, 3 * bs)])
        seqs.append((ctx, q))
    need = [math.ceil((c + q) / bs) + rng.randint(0, 1) for c, q in seqs]
    pool = list(range(sum(need) + 5))
    rng.shuffle(pool)
    tables, used = [], 0
    for n in need:
        tables.append(pool[used:used + n])
        used += n
    cache = KVCache.allocate(1, len(pool), bs, kv_heads, D)
    cache.data.normal_()  # junk everywhere: unmasked stale slots would show up
    k_cache, v_cache = cache.key(0), cache.value(0)
    flat_k, flat_v = k_cache.view(-1, kv_heads, D), v_cache.view(-1, kv_heads, D)
    full = []
    for (ctx, q), table in zip(seqs, tables):
        k = torch.randn(ctx + q, kv_heads, D)
        v = torch.randn(ctx + q, kv_heads, D)
        for p in range(ctx):
            flat_k[_slot(table, p, bs)] = k[p]
            flat_v[_slot(table, p, bs)] = v[p]
        full.append((k, v))
    queries = [torch.randn(q, kv_heads * group, D) for _, q in seqs]
    return seqs, tables, k_cache, v_cache, full, queries


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("group", [1, 3])
def test_paged_attention_matches_dense(seed, bs, group):
    rng = random.Random(seed * 1000 + bs + group)
    torch.manual_seed(seed)
    kv_heads = 2
    seqs, tables, k_cache, v_cache, full, queries = _case(rng, bs, kv_heads, group)
    meta = AttentionMetadata.build([q for _, q in seqs], [c for c, _ in seqs], tables, bs, "cpu")
    new_k = torch.cat([k[c:] for (c, _), (k, _) in zip(seqs, full)])
    new_v = torch.cat([v[c:] for (c, _), (_, v) in zip(seqs, full)])
    write_kv(k_cache, v_cache, new_k, new_v, meta)
    scale = 1 / math.sqrt(D)
    out = paged_attention(torch.cat(queries), k_cache, v_cache, meta, scale)
    expected = torch.cat([_dense_attention(qs, k, v, c, scale)
                          for (c, _), (k, v), qs in zip(seqs, full, queries)])
    assert out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("bs", [16, 32])
def test_write_kv_hits_exact_slots(bs):
    rng = random.Random(bs)
    seqs, tables, k_cache, v_cache, full, _ = _case(rng, bs, 3, 1)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    meta = AttentionMetadata.build([q for _, q in seqs], [c for c, _ in seqs], tables, bs)
    new_k = torch.cat([k[c:] for (c, _), (k, _) in zip(seqs, full)])
    new_v = torch.cat([v[c:] for (c, _), (_, v) in zip(seqs, full)])
    write_kv(k_cache, v_cache, new_k, new_v, meta)
    expect_k, expect_v = before_k.view(-1, 3, D), before_v.view(-1, 3, D)
    row, written = 0, set()
    for (ctx, q), table in zip(seqs, tables):
        for p in range(ctx, ctx + q):
            s = _slot(table, p, bs)
            assert int(meta.slot_mapping[row]) == s and int(meta.positions[row]) == p
            expect_k[s], expect_v[s] = new_k[row], new_v[row]
            written.add(s)
            row += 1
    assert len(written) == row == meta.num_tokens
    assert torch.equal(k_cache.view(-1, 3, D), expect_k)
    assert torch.equal(v_cache.view(-1, 3, D), expect_v)


def test_metadata_rejects_short_block_table():
    with pytest.raises(ValueError):
        AttentionMetadata.build([5], [12], [[0]], 16)


def test_copy_blocks_all_layers():
    cache = KVCache.allocate(3, 6, 4, 2, D)
    cache.data.normal_()
    before = cache.data.clone()
    cache.copy_blocks([1, 4], [4, 0])
    assert torch.equal(cache.data[:, :, 4], before[:, :, 1])
    assert torch.equal(cache.data[:, :, 0], before[:, :, 4])
    assert torch.equal(cache.data[:, :, [1, 2, 3, 5]], before[:, :, [1, 2, 3, 5]])


def test_backend_registry():
    backend = get_backend("torch")
    assert backend.name == "torch"
    assert backend.paged_attention is paged_attention and backend.write_kv is write_kv
    with pytest.raises(ValueError):
        get_backend("nope")
