"""The fused RoPE + paged KV write (kernels.triton_fused.rope_write_kv) against the two
kernels it replaces (rope_ then triton_paged.write_kv: the same bits) and against torch
(RoPE in float32 rounded to the model's dtype, torch_ref.write_kv): GQA and MHA, head dims
16 to 64, blocks of 16 and 32, decode rows, chunks ending in partial blocks, padding rows
(slot -1) that store nothing, fp32 / bf16 models and fp8 caches. Under TRITON_INTERPRET=1
on the CPU, natively where CUDA is available."""
import os
import random

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kernels import torch_ref  # noqa: E402 - after TRITON_INTERPRET is set
from kernels.metadata import AttentionMetadata  # noqa: E402 - after TRITON_INTERPRET is set
from kernels.triton_fused import rope_, rope_write_kv  # noqa: E402 - after TRITON_INTERPRET is set
from kernels.triton_paged import write_kv  # noqa: E402 - after TRITON_INTERPRET is set

MAX_POS = 160


def _tables(heads_dim: int):
    d = heads_dim
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    emb = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv).repeat(1, 2)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


def _case(seed: int, heads: int, kv_heads: int, dim: int, bs: int, dtype, cache_dtype,
          pad: int):
    """qkv rows of a mixed step (decode rows on block edges, prefill chunks ending inside a
    block, one after a cached prefix) plus ``pad`` padding rows at slot -1, and caches of
    noise."""
    rng = random.Random(seed)
    query_lens = [1, 1, 5, 2 * bs + 3, 1]
    context_lens = [0, bs - 1, 3, bs + 2, 2 * bs]
    need = [-(-(q + c) // bs) for q, c in zip(query_lens, context_lens)]
    ids = list(range(sum(need) + 2))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    meta = AttentionMetadata.build(query_lens, context_lens, tables, bs, DEVICE)
    t = meta.num_tokens
    slots = torch.cat([meta.slot_mapping, torch.full((pad,), -1, device=DEVICE)])
    positions = torch.cat([meta.positions,
                           torch.tensor([rng.randrange(MAX_POS) for _ in range(pad)],
                                        device=DEVICE)])
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t + pad, (heads + 2 * kv_heads) * dim, generator=g).to(DEVICE, dtype)
    shape = (len(ids), bs, kv_heads, dim)
    kc = (torch.randn(shape, generator=g) * 2).to(DEVICE, cache_dtype)
    vc = (torch.randn(shape, generator=g) * 2).to(DEVICE, cache_dtype)
    return qkv, positions, slots, kc, vc


CASES = [  # heads, kv_heads, head_dim, block size, model dtype, cache dtype
    (6, 2, 16, 16, torch.float32, torch.float32),
    (4, 4, 32, 32, torch.float32, torch.float32),
    (8, 1, 64, 16, torch.bfloat16, torch.bfloat16),
    (6, 3, 32, 32, torch.bfloat16, torch.bfloat16),
    (6, 2, 16, 16, torch.bfloat16, torch.float8_e4m3fn),
    (4, 2, 32, 16, torch.bfloat16, torch.float8_e5m2),
]


@pytest.mark.parametrize("heads, kv_heads, dim, bs, dtype, cache_dtype", CASES)
def test_rope_write_kv_matches_the_kernels_it_fuses(heads, kv_heads, dim, bs, dtype,
                                                    cache_dtype):
    qkv, pos, slots, kc, vc = _case(heads * dim + bs, heads, kv_heads, dim, bs, dtype,
                                    cache_dtype, pad=3)
    cos, sin = _tables(dim)
    kc0, vc0 = kc.clone(), vc.clone()
    q = rope_write_kv(qkv, heads, kv_heads, dim, pos, cos, sin, kc, vc, slots)
    assert q.shape == (qkv.shape[0], heads, dim) and q.dtype == dtype

    ref = qkv.clone()
    rope_(ref, heads + kv_heads, dim, pos, cos, sin)
    n_q, n_kv = heads * dim, kv_heads * dim
    meta = AttentionMetadata(num_tokens=len(slots), query_lens=[], context_lens=[],
                             block_size=bs, positions=pos, slot_mapping=slots, seq_lens=slots,
                             query_start_loc=slots, block_tables=slots)
    write_kv(kc0, vc0, ref[:, n_q:n_q + n_kv].view(-1, kv_heads, dim),
             ref[:, n_q + n_kv:].view(-1, kv_heads, dim), meta)
    assert torch.equal(q.view(-1, n_q), ref[:, :n_q])
    as_bytes = lambda c: c.view(torch.uint8)
    assert torch.equal(as_bytes(kc), as_bytes(kc0)) and torch.equal(as_bytes(vc), as_bytes(vc0))


def _torch_rope(x: torch.Tensor, pos: torch.Tensor, cos, sin) -> torch.Tensor:
    """RoPE in float32 from the stored values, rounded to ``x``'s dtype."""
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * c + rotated * s).to(x.dtype)


@pytest.mark.parametrize("heads, kv_heads, dim, bs, dtype, cache_dtype", CASES)
def test_rope_write_kv_matches_torch(heads, kv_heads, dim, bs, dtype, cache_dtype):
    pad = 4
    qkv, pos, slots, kc, vc = _case(7 * heads + dim, heads, kv_heads, dim, bs, dtype,
                                    cache_dtype, pad=pad)
    cos, sin = _tables(dim)
    before_k, before_v = kc.clone(), vc.clone()
    q_out = torch.full((qkv.shape[0] + 2, heads, dim), float("nan"), device=DEVICE,
                       dtype=dtype)[1:-1]                           # a view: any row offset
    got = rope_write_kv(qkv, heads, kv_heads, dim, pos, cos, sin, kc, vc, slots, q_out=q_out)
    assert got.data_ptr() == q_out.data_ptr()
    n_q, n_kv = heads * dim, kv_heads * dim
    q_ref = _torch_rope(qkv[:, :n_q].view(-1, heads, dim), pos, cos, sin)
    k_ref = _torch_rope(qkv[:, n_q:n_q + n_kv].view(-1, kv_heads, dim), pos, cos, sin)
    v_ref = qkv[:, n_q + n_kv:].view(-1, kv_heads, dim)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, q_ref, rtol=tol, atol=tol)
    real = slots >= 0
    meta = AttentionMetadata(num_tokens=int(real.sum()), query_lens=[], context_lens=[],
                             block_size=bs, positions=pos[real], slot_mapping=slots[real],
                             seq_lens=slots, query_start_loc=slots, block_tables=slots)
    torch_ref.write_kv(before_k, before_v, k_ref[real], v_ref[real], meta)
    # the real rows' slots hold their rotated keys and values, every other slot (padding
    # rows included: slot -1 wrote nothing) is as it was
    # (fp8: RoPE rounded one bf16 ulp apart may round one fp8 step apart: 1/8 or 1/4)
    ktol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float8_e4m3fn: 0.13,
            torch.float8_e5m2: 0.26}[cache_dtype]
    torch.testing.assert_close(kc.float(), before_k.float(), rtol=ktol, atol=ktol)
    torch.testing.assert_close(vc.float(), before_v.float(), rtol=0, atol=0)
    flat = lambda c: c.view(-1, kv_heads * dim).view(torch.uint8)
    untouched = torch.ones(flat(kc).shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[real]] = False
    assert torch.equal(flat(kc)[untouched], flat(before_k)[untouched])


def test_rope_write_kv_refuses_strided_rows():
    qkv = torch.zeros(4, 2 * (6 + 4) * 16, device=DEVICE)[:, ::2]
    cos, sin = _tables(16)
    kc = torch.zeros(2, 16, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="unit stride"):
        rope_write_kv(qkv, 6, 2, 16, torch.zeros(4, dtype=torch.long, device=DEVICE), cos, sin,
                      kc, kc.clone(), torch.zeros(4, dtype=torch.long, device=DEVICE))
