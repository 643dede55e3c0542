"""Speculative decoding's verify rows through the Triton paged attention: rows of 1 + k
query tokens (k drafts, 1..4) on top of cached contexts, beside plain decode rows and a
prefill chunk with a cached prefix, in one flat batch, against the torch reference
(fp32, 1e-4). Contexts cross block edges and the new tokens straddle them. Under
TRITON_INTERPRET=1 on the CPU, natively where CUDA is available (as tests/kernels/
test_triton.py)."""
import os
import random

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from kernels import torch_ref  # noqa: E402 - after TRITON_INTERPRET is set
from kernels.testing import random_paged_case  # noqa: E402 - after TRITON_INTERPRET is set
from kernels.triton_paged import TritonBackend  # noqa: E402 - after TRITON_INTERPRET is set

DIM = 32


def verify_rows(block_size: int) -> tuple[list[int], list[int]]:
    """(query_lens, context_lens): verify rows of 2..5 tokens whose new tokens sit inside a
    block, end on its last slot, start on a block's first slot or straddle an edge, at
    contexts from empty to several blocks, and plain decode rows on block edges."""
    b = block_size
    rows = [
        (2, b - 3),          # both new tokens inside the first block
        (3, b - 1),          # straddles the first edge: b-1 | b, b+1
        (5, 2 * b - 2),      # straddles: 2b-2, 2b-1 | 2b, 2b+1, 2b+2
        (4, 3 * b),          # starts on a block's first slot, cached context exactly 3 blocks
        (5, 4 * b - 5),      # ends on a block's last slot
        (2, 5 * b - 1),      # straddles at a longer context
        (1, b),              # plain decode, first slot of a block
        (1, 2 * b - 1),      # plain decode, last slot of a block
        (5, 0),              # no cached context
        (1, 0),
    ]
    return [q for q, _ in rows], [c for _, c in rows]


def _check(case, backend=None):
    q, k, v, kc, vc, meta = case
    backend = backend or TritonBackend()
    scale = q.shape[-1] ** -0.5
    kc_ref, vc_ref = kc.clone(), vc.clone()
    torch_ref.write_kv(kc_ref, vc_ref, k, v, meta)
    want = torch_ref.paged_attention(q, kc_ref, vc_ref, meta, scale)
    backend.write_kv(kc, vc, k, v, meta)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    got = backend.paged_attention(q, kc, vc, meta, scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    return got


@pytest.mark.parametrize("block_size, kv_heads, group", [(16, 2, 3), (32, 1, 1)])
def test_verify_rows_beside_decode_rows_match_reference(block_size, kv_heads, group):
    qs, cs = verify_rows(block_size)
    rng = random.Random(block_size + group)
    _check(random_paged_case(rng, DEVICE, torch.float32, block_size, kv_heads, group, qs, cs,
                             DIM, lookahead=2))


def test_verify_rows_with_a_prefill_chunk_match_reference():
    """The same rows with a prefill chunk after a cached prefix (its tokens straddling an
    edge too) and one more verify row after it, in one flat batch."""
    qs, cs = verify_rows(16)
    qs, cs = qs[:6] + [21] + qs[6:] + [3], cs[:6] + [37] + cs[6:] + [6 * 16 - 1]
    rng = random.Random(5)
    _check(random_paged_case(rng, DEVICE, torch.float32, 16, 2, 3, qs, cs, DIM))


def test_a_verify_row_attends_as_its_tokens_would_one_at_a_time():
    """Each of a verify row's 1 + k outputs equals a plain decode step at that position
    over the same cache: the row's causal mask hides the later drafts."""
    rng = random.Random(9)
    k_drafts, ctx, bs = 4, 2 * 16 - 2, 16
    q, k, v, kc, vc, meta = random_paged_case(rng, DEVICE, torch.float32, bs, 2, 3,
                                              [1 + k_drafts], [ctx], DIM)
    got = _check((q, k, v, kc, vc, meta))
    from kernels.metadata import AttentionMetadata
    table = meta.block_tables[0].tolist()
    backend = TritonBackend()
    for j in range(1 + k_drafts):                   # the cache already holds every token
        one = AttentionMetadata.build([1], [ctx + j], [table], bs, DEVICE)
        alone = backend.paged_attention(q[j:j + 1], kc, vc, one, DIM ** -0.5)
        torch.testing.assert_close(got[j:j + 1], alone, rtol=1e-4, atol=1e-4)
