"""The Triton kernels match the torch reference, run under TRITON_INTERPRET=1 on the CPU.

Randomised but seeded: block sizes 16 and 32, GQA ratios 1 and 3, context lengths from 1 to
~2000 straddling block edges, batches mixing different lengths, decode (FlashDecoding
split-K) and prefill with cached prefixes. Tolerance 1e-4 relative in fp32.
"""
import os
import random

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from kernels import torch_ref  # noqa: E402
from kernels.metadata import AttentionMetadata  # noqa: E402
from kernels.triton_paged import paged_attention, write_kv  # noqa: E402

DIM = 64


def _case(rng: random.Random, block_size: int, kv_heads: int, group: int,
          query_lens: list[int], context_lens: list[int]):
    heads = kv_heads * group
    need = [-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens)]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    kc = torch.randn(num_blocks, block_size, kv_heads, DIM, generator=g)
    vc = torch.randn(num_blocks, block_size, kv_heads, DIM, generator=g)
    t = sum(query_lens)
    q = torch.randn(t, heads, DIM, generator=g)
    k = torch.randn(t, kv_heads, DIM, generator=g)
    v = torch.randn(t, kv_heads, DIM, generator=g)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    return q, k, v, kc, vc, meta


def _check(q, k, v, kc, vc, meta, **kw):
    kc_ref, vc_ref = kc.clone(), vc.clone()
    torch_ref.write_kv(kc_ref, vc_ref, k, v, meta)
    want = torch_ref.paged_attention(q, kc_ref, vc_ref, meta, DIM ** -0.5)
    write_kv(kc, vc, k, v, meta)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    got = paged_attention(q, kc, vc, meta, DIM ** -0.5, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_heads, group", [(3, 1), (3, 3)])
def test_decode_split_k_matches_reference(block_size, kv_heads, group):
    rng = random.Random(block_size * 10 + group)
    contexts = [0, block_size - 1, block_size, 2 * block_size + 1, rng.randrange(300, 700),
                rng.randrange(1500, 1999)]
    _check(*_case(rng, block_size, kv_heads, group, [1] * len(contexts), contexts),
           partition_blocks=8)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_heads, group", [(3, 1), (3, 3)])
def test_prefill_with_cached_prefix_matches_reference(block_size, kv_heads, group):
    rng = random.Random(block_size * 100 + group)
    query_lens = [1, block_size + 1, rng.randrange(2, 40)]
    context_lens = [rng.randrange(0, 60), 0, rng.randrange(900, 1200)]
    _check(*_case(rng, block_size, kv_heads, group, query_lens, context_lens))


def test_seeded_random_batches():
    rng = random.Random(7)
    for _ in range(3):
        bs = rng.choice([16, 32])
        kvh, group = rng.choice([(1, 1), (3, 1), (3, 3)])
        n = rng.randrange(1, 4)
        if rng.random() < 0.5:
            qs = [1] * n
            cs = [rng.randrange(0, 2000) for _ in range(n)]
        else:
            qs = [rng.randrange(1, 33) for _ in range(n)]
            cs = [rng.randrange(0, 400) for _ in range(n)]
        _check(*_case(rng, bs, kvh, group, qs, cs))
