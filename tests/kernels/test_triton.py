"""The Triton kernels match the torch reference, run under TRITON_INTERPRET=1 on the CPU.

Randomised but seeded: block sizes 16 and 32, GQA ratios 1 and 3, context lengths from 1 to
~2000 straddling block edges, batches mixing different lengths, decode (FlashDecoding
split-K) and prefill with cached prefixes, and decode from static buffers as replayed by
CUDA graphs (padding rows, fixed grid). Tolerance 1e-4 relative in fp32.

Where CUDA is available the same checks run natively on the GPU instead (the interpreter is
only switched on without CUDA, so it never leaks into GPU tests of the same run).
"""
import os
import random

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from kernels import torch_ref  # noqa: E402 - after TRITON_INTERPRET is set
from kernels.kv_cache import quantize  # noqa: E402 - after TRITON_INTERPRET is set
from kernels.metadata import AttentionMetadata  # noqa: E402 - after TRITON_INTERPRET is set
from kernels.testing import padded_decode_buffers, random_paged_case  # noqa: E402 - after TRITON_INTERPRET is set
from kernels.triton_paged import paged_attention, write_kv  # noqa: E402 - after TRITON_INTERPRET is set

DIM = 64


def _case(rng: random.Random, block_size: int, kv_heads: int, group: int,
          query_lens: list[int], context_lens: list[int]):
    return random_paged_case(rng, DEVICE, torch.float32, block_size, kv_heads, group,
                             query_lens, context_lens, DIM)


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


def test_decode_partitions_widen_to_the_cap():
    """partition_blocks=1 over ~125 blocks would give 125 partitions; they are widened to at
    most MAX_PARTITIONS (a few blocks each) and still merge to the reference."""
    from kernels.triton_paged import MAX_PARTITIONS
    rng = random.Random(5)
    assert -(-2000 // 16) > MAX_PARTITIONS
    _check(*_case(rng, 16, 1, 3, [1, 1, 1], [1999, 5, 16 * MAX_PARTITIONS]), partition_blocks=1)


@pytest.mark.parametrize("block_size, kv_heads, group", [(16, 3, 3), (32, 3, 1)])
def test_static_decode_buffers_match_reference(block_size, kv_heads, group):
    """Decode from AttentionMetadata.for_decode_buffers (as inside a CUDA graph): a grid
    sized for max_seq_len (most partitions empty), padded rows with slot -1 and seq_len 1
    that write nothing, a block table wider than needed with stale entries."""
    rng = random.Random(block_size + group)
    contexts = [0, block_size - 1, 3 * block_size, rng.randrange(500, 900)]
    n, pad, max_seq_len = len(contexts), 3, 1200
    q, k, v, kc, vc, meta = _case(rng, block_size, kv_heads, group, [1] * n, contexts)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    torch_ref.write_kv(kc_ref, vc_ref, k, v, meta)
    want = torch_ref.paged_attention(q, kc_ref, vc_ref, meta, DIM ** -0.5)

    b = n + pad
    width = -(-max_seq_len // block_size)
    tables = torch.randint(0, kc.shape[0], (b, width), dtype=torch.int32)  # stale junk
    tables[n:, 0] = 0
    static = padded_decode_buffers(meta, contexts, pad, tables.to(DEVICE), max_seq_len)
    g = torch.Generator().manual_seed(3)
    extra = lambda t: torch.cat(
        [t, torch.randn(pad, *t.shape[1:], generator=g).to(DEVICE)])
    assert static.context_lens == [max_seq_len - 1] * b
    write_kv(kc, vc, extra(k), extra(v), static)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    got = paged_attention(extra(q), kc, vc, static, DIM ** -0.5, partition_blocks=4)
    torch.testing.assert_close(got[:n], want, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(got[n:]).all()
    with pytest.raises(ValueError, match="GPU backend"):
        torch_ref.paged_attention(extra(q), kc, vc, static, DIM ** -0.5)


def test_decode_buffers_validate_shapes():
    z = torch.zeros(2, dtype=torch.long)
    ok = dict(positions=z, slot_mapping=z, seq_lens=torch.ones(2, dtype=torch.int32),
              query_start_loc=torch.arange(3, dtype=torch.int32),
              block_tables=torch.zeros(2, 4, dtype=torch.int32), block_size=16)
    AttentionMetadata.for_decode_buffers(**ok, max_seq_len=64)
    with pytest.raises(ValueError, match="width"):
        AttentionMetadata.for_decode_buffers(**ok, max_seq_len=65)
    with pytest.raises(ValueError, match="disagree"):
        AttentionMetadata.for_decode_buffers(**{**ok, "positions": torch.zeros(3)}, max_seq_len=8)
    with pytest.raises(ValueError, match="int32"):
        AttentionMetadata.for_decode_buffers(**{**ok, "seq_lens": z}, max_seq_len=8)


def test_the_backend_picks_the_decode_partition_by_batch_size():
    from kernels.triton_paged import TritonBackend, decode_partition_blocks
    assert decode_partition_blocks(1) == decode_partition_blocks(16) == 2
    assert decode_partition_blocks(17) == decode_partition_blocks(256) == 8
    rng = random.Random(3)
    contexts = [rng.randrange(40, 300) for _ in range(3)]
    q, k, v, kc, vc, meta = _case(rng, 16, 3, 3, [1] * 3, contexts)
    write_kv(kc, vc, k, v, meta)
    want = paged_attention(q, kc, vc, meta, DIM ** -0.5, partition_blocks=16)
    for blocks in (None, 2):
        got = TritonBackend(blocks).paged_attention(q, kc, vc, meta, DIM ** -0.5)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_caches_match_reference(fp8):
    """kv.dtype fp8: the write stores what the reference stores (the rounded rows, bit for
    bit), and decode and prefill widen the stored keys and values as they load them."""
    rng = random.Random(11)
    for qlens, ctx in (([1, 1, 1], [40, 300, 15]), ([9, 33], [0, 50])):
        q, k, v, kc, vc, meta = _case(rng, 16, 3, 3, qlens, ctx)
        kc, vc = quantize(kc, fp8), quantize(vc, fp8)
        k = k * 300                                  # many elements past E4M3's 448: saturated
        kc_ref, vc_ref = kc.clone(), vc.clone()
        torch_ref.write_kv(kc_ref, vc_ref, k, v, meta)
        write_kv(kc, vc, k, v, meta)
        assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))
        assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8))
        want = torch_ref.paged_attention(q, kc, vc, meta, DIM ** -0.5)
        got = paged_attention(q, kc, vc, meta, DIM ** -0.5)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_fp8_write_rounds_every_edge_as_quantize(fp8, src):
    """The Triton write's own rounding (integer arithmetic, not the conversion
    instructions) stores quantize's bytes for every decade, tie, subnormal, saturation and
    infinity (the edge values of tests/kernels/test_kv_fp8.py)."""
    from tests.kernels.test_kv_fp8 import _edge_values
    x = _edge_values(fp8).to(device=DEVICE, dtype=src).view(-1, 3, 64)
    n = x.shape[0]
    kc = torch.zeros(n, 1, 3, 64, dtype=fp8, device=DEVICE)
    vc = torch.zeros_like(kc)
    meta = AttentionMetadata.build([n], [0], [list(range(n))], 1, DEVICE)
    write_kv(kc, vc, x, -x, meta)
    want = quantize(x, fp8).view(torch.uint8)
    assert torch.equal(kc.view(n, 3, 64).view(torch.uint8), want)
    assert torch.equal(vc.view(n, 3, 64).view(torch.uint8), quantize(-x, fp8).view(torch.uint8))
