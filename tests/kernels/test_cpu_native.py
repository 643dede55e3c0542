"""The native CPU decode kernel (kernels/csrc, built at first use) against the torch
reference: randomized shapes — block sizes 16 and 32, GQA ratios 1 and 3, head dims 64 and
128, contexts 1..2000 straddling block edges, mixed lengths and a prefill row (one or several
row tiles, partial ones too) in one batch."""
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import AttentionMetadata, get_backend, machine, torch_ref
from kernels.testing import random_paged_case, random_prompt_case

try:
    from kernels import cpu_native, native_lib
    native_lib.load()
except ValueError as exc:                    # no compiler: the backend refuses, auto -> torch
    pytest.skip(f"native CPU kernel unavailable: {exc}", allow_module_level=True)


def _case(rng: random.Random, dtype, block_size, kv_heads, group, dim):
    edges = [1, block_size - 1, block_size, block_size + 1, 2000, rng.randint(1, 2000)]
    ctx = [rng.choice(edges) - 1 for _ in range(rng.randint(1, 6))]   # context before the new token
    qlens = [1] * len(ctx)
    if rng.random() < 0.5:                                            # a prefill row too
        ctx.append(rng.randint(0, 40))
        qlens.append(rng.choice([rng.randint(2, 9), rng.randint(17, 70)]))   # tiles of 8 rows
    q, _, _, kc, vc, meta = random_paged_case(rng, "cpu", dtype, block_size, kv_heads, group,
                                              qlens, ctx, dim, lookahead=2)
    return q, kc, vc, meta


def qkv_view(q: torch.Tensor) -> torch.Tensor:
    """``q``'s values as the model passes them: a view into a fused qkv projection, its rows
    wider than q (the keys and values beside it, here noise)."""
    t, h, d = q.shape
    return torch.cat([q.flatten(1), torch.randn(t, 5 * d).to(q.dtype)], 1)[:, :h * d].view(t, h, d)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dim", [64, 128])
def test_matches_reference_fp32(block_size, group, dim):
    rng = random.Random(block_size * 100 + group * 10 + dim)
    backend = get_backend("cpu", "cpu")
    for _ in range(4):
        q, kc, vc, meta = _case(rng, torch.float32, block_size, rng.choice([1, 2, 3]), group, dim)
        want = torch_ref.paged_attention(q, kc, vc, meta, dim ** -0.5)
        got = backend.paged_attention(q, kc, vc, meta, dim ** -0.5)
        err = (got - want).abs().max() / want.abs().max()
        assert err <= 1e-4, err
        strided = qkv_view(q)
        assert q.shape[0] == 1 or strided.stride(0) > q.stride(0)     # rows apart
        assert torch.equal(backend.paged_attention(strided, kc, vc, meta, dim ** -0.5), got)


def test_bf16_close_to_fp32_reference():
    rng = random.Random(7)
    backend = get_backend("cpu", "cpu", dtype=torch.bfloat16)
    for _ in range(4):
        q, kc, vc, meta = _case(rng, torch.bfloat16, 16, 3, 3, 64)
        want = torch_ref.paged_attention(q.float(), kc.float(), vc.float(), meta, 0.125)
        got = backend.paged_attention(q, kc, vc, meta, 0.125).float()
        assert ((got - want).abs().max() / want.abs().max()) <= 1e-2
        assert torch.equal(backend.paged_attention(qkv_view(q), kc, vc, meta, 0.125).float(), got)


def test_unsupported_shapes_fall_back_and_auto_prefers_native():
    assert not cpu_native.supports(9, 3, 80) and cpu_native.supports(9, 3, 64)
    rng = random.Random(3)
    q, kc, vc, meta = _case(rng, torch.float32, 16, 1, 1, 64)
    q80 = torch.randn(q.shape[0], 2, 80)
    k80, v80 = torch.randn(kc.shape[0], 16, 2, 80), torch.randn(kc.shape[0], 16, 2, 80)
    backend = get_backend("cpu", "cpu")
    assert torch.allclose(backend.paged_attention(q80, k80, v80, meta, 0.1),
                          torch_ref.paged_attention(q80, k80, v80, meta, 0.1))
    assert get_backend("auto", "cpu").name == "cpu"


@pytest.mark.parametrize("build", ["avx2", "scalar"])
def test_portable_kernel_matches_reference(build):
    """The kernels other CPUs run, built here in a fresh process: without AVX-512 (the AVX2
    tiled kernel, and both small-batch linears on AVX2) and without AVX2 (the portable
    attention; no small-batch linear). The cases cover decode rows, prefill
    tiles after a cached prefix, lengths off the 8- and 16-key chunks, and every G the
    model zoo has (1: MHA, 3: SmolLM2, 4, 8) at head_dim 64 and 128; and the sampler's
    plain draw lands where a float64 inverse CDF does (each build has its own exp and scan)."""
    code = (
        "import random, torch\n"
        "from kernels import get_backend, torch_ref\n"
        "from kernels.testing import random_paged_case\n"
        "for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):\n"
        "    for kvh, group, dim in ((3, 3, 64), (4, 1, 64), (2, 4, 128), (2, 8, 64)):\n"
        "        rng = random.Random(5)\n"
        "        q, _, _, kc, vc, meta = random_paged_case(rng, 'cpu', dtype, 16, kvh, group,\n"
        "            [1, 1, 40, 9, 3], [0, 300, 17, 5, 61], dim)\n"
        "        want = torch_ref.paged_attention(q.float(), kc.float(), vc.float(), meta, 0.125)\n"
        "        backend = get_backend('cpu', 'cpu', dtype=dtype)\n"
        "        got = backend.paged_attention(q, kc, vc, meta, 0.125)\n"
        "        err = ((got.float() - want).abs().max() / want.abs().max()).item()\n"
        "        assert err <= tol, (dtype, kvh, group, dim, err)\n"
        "        t, h, d = q.shape\n"
        "        wide = torch.cat([q.flatten(1), torch.randn(t, 3 * d).to(dtype)], 1)\n"
        "        strided = get_backend('cpu', 'cpu', dtype=dtype).paged_attention(\n"
        "            wide[:, :h * d].view(t, h, d), kc, vc, meta, 0.125)\n"
        "        assert torch.equal(strided, got), ('strided q', dtype, kvh, group, dim)\n"
        "from kernels import cpu_linear, cpu_native, native_lib\n"
        "bits = native_lib.load().weir_gemv_supported()\n"
        f"assert bits == {3 if build == 'avx2' else 0}, bits\n"
        "for dtype, tol in ((torch.float32, 2 ** -20), (torch.bfloat16, 2 ** -8)):\n"
        "    if not bits:\n"
        "        break\n"
        "    w = torch.randn(160, 96).to(dtype)\n"
        "    for m in (1, 5, 8):\n"
        "        x = torch.randn(m, 96).to(dtype)\n"
        "        want = torch.nn.functional.linear(x.float(), w.float())\n"
        "        got = cpu_linear.small_batch_linear(x, cpu_linear.pack_small_batch(w)).float()\n"
        "        scale = (x.float().abs() @ w.float().abs().T + 1).max()\n"
        "        assert (got - want).abs().max() <= tol * scale, (dtype, m)\n"
        "x = torch.randn(5, 777) * 4\n"
        "lse, vals, ids = cpu_native.logprobs(x, 4)\n"
        "assert (lse - torch.logsumexp(x, -1)).abs().max() < 1e-4, 'logprobs lse'\n"
        "assert torch.equal(vals, x.topk(4, -1).values), 'logprobs top'\n"
        "from kernels.testing import plain_draw_miss\n"
        "miss = plain_draw_miss(cpu_native.sample, rows=40)\n"
        "assert miss <= 1e-6, ('plain draw', miss)\n"
        "print('ok')\n")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       env={**os.environ, "WEIR_CPU_KERNEL_PORTABLE": build}, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference_on_qkv_views(dtype):
    rng = random.Random(11)
    _, k, v, kc, vc, meta = random_paged_case(rng, "cpu", dtype, 16, 3, 3, [5, 1, 40], [0, 20, 33])
    qkv = torch.cat([torch.randn(k.shape[0], 9 * 64).to(dtype), k.flatten(1), v.flatten(1)], 1)
    kview = qkv[:, 9 * 64:12 * 64].view(-1, 3, 64)           # row stride 15 * 64, as the model
    vview = qkv[:, 12 * 64:].view(-1, 3, 64)
    want_k, want_v = kc.clone(), vc.clone()
    torch_ref.write_kv(want_k, want_v, k, v, meta)
    cpu_native.write_kv(kc, vc, kview, vview, meta)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache", ["same", torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["same", "e4m3", "e5m2"])
@pytest.mark.parametrize("dim,kv_heads", [(64, 2), (128, 1), (48, 3)])
def test_rope_write_kv_is_rope_then_write_kv_to_the_bit(dtype, cache, dim, kv_heads):
    """RoPE and the KV write in one pass: the same qkv rows (q and k rotated, v untouched)
    and the same cache bytes as ``rope_`` then ``write_kv``, bit for bit, in bf16, float32
    and fp8 caches; a slot of -1 writes nothing; serial (few rows) and parallel; cache
    rows of whole cache lines (streaming stores) and not (48 x 3 bf16: 288 bytes)."""
    kv_dtype = dtype if cache == "same" else cache
    g = torch.Generator().manual_seed(dim + kv_heads)
    theta = 1e4
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(256, dtype=torch.float32), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    heads, n_kv = 3 * kv_heads, kv_heads * dim
    for rows in (1, 9, 70):
        qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g) * 4).to(dtype)
        pos = torch.randint(0, 256, (rows,), generator=g)
        slots = torch.randperm(8 * 16, generator=g)[:rows]
        slots[::4] = -1                                  # padding rows: stored nowhere
        fill = torch.randint(0, 100, (8, 16, kv_heads, dim), generator=g, dtype=torch.uint8)
        kc = fill.to(torch.float32).to(kv_dtype) if cache == "same" else fill.view(kv_dtype)
        vc = kc.flip(0).contiguous()
        want_qkv, want_k, want_v = qkv.clone(), kc.clone(), vc.clone()
        cpu_native.rope_(want_qkv, heads + kv_heads, dim, pos, cos, sin)
        n_q = heads * dim
        cpu_native.write_kv(want_k, want_v,
                            want_qkv[:, n_q:n_q + n_kv].view(-1, kv_heads, dim),
                            want_qkv[:, n_q + n_kv:].view(-1, kv_heads, dim),
                            cpu_native._Slots(slots))
        got_qkv, got_k, got_v = qkv.clone(), kc.clone(), vc.clone()
        cpu_native.rope_write_kv_(got_qkv, heads, kv_heads, dim, pos, cos, sin, got_k, got_v,
                                  slots)
        assert torch.equal(got_qkv, want_qkv), rows
        assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8)), rows
        assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8)), rows
        skipped = slots < 0                               # (the fill left as it was)
        kept = torch.ones(8 * 16, dtype=torch.bool)
        kept[slots[~skipped]] = False
        assert torch.equal(got_k.view(torch.uint8).flatten(0, 1)[kept],
                           kc.view(torch.uint8).flatten(0, 1)[kept])


def test_native_row_ops_take_no_rows():
    """The other per-row native ops accept an empty batch too."""
    assert cpu_native.argmax(torch.empty(0, 10)).shape == (0,)
    assert cpu_native.silu_mul(torch.empty(0, 8)).shape == (0, 4)
    out = torch.empty(0, 8)
    cpu_native.add_rms_norm(torch.empty(0, 8), None, torch.ones(8), out, 1e-5)
    assert cpu_native.sample(torch.empty(0, 10), *(torch.empty(0),) * 4).shape == (0,)


def test_logprobs_match_torch():
    """Log-sum-exp and the top k, against torch: ties go to the earlier id, k = 0 works, a
    vocabulary smaller than k pads with -inf, an empty batch is empty."""
    x = torch.randn(7, 1000, generator=torch.Generator().manual_seed(3)) * 4
    top = float(x[2].max()) + 1
    x[2, 10] = x[2, 500] = top                   # a tie at the top
    x[3] = 0.0                                   # all equal
    x[4, -1] = 60.0                              # the max at the last position
    for k in (0, 1, 5, 20):
        lse, vals, ids = cpu_native.logprobs(x, k)
        torch.testing.assert_close(lse, torch.logsumexp(x, -1), atol=2e-5, rtol=1e-6)
        assert vals.shape == ids.shape == (7, k)
        assert torch.equal(vals, x.topk(k, -1).values)
        assert torch.equal(x.gather(1, ids), vals)
        if k >= 2:
            assert ids[2, :2].tolist() == [10, 500] and ids[3].tolist() == list(range(k))
            assert ids[4, 0] == 999
    lse, vals, ids = cpu_native.logprobs(torch.tensor([[1.0, 3.0, 2.0]]), 5)
    assert ids[0, :3].tolist() == [1, 2, 0] and vals[0, 3:].tolist() == [float("-inf")] * 2
    assert cpu_native.logprobs(torch.empty(0, 10), 3)[1].shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompts_through_sdpa_match_reference(dtype):
    """With ``fresh_prompts = "sdpa"`` a batch mixing decode rows, fresh prompts (long
    enough: SDPA on the new keys; too short: the native kernel), and a prompt's later
    chunk (cached context: the native kernel) gives the reference's output; a batch of
    fresh prompts only never calls the native kernel's row subset."""
    rng = random.Random(5)
    backend = get_backend("cpu", "cpu", dtype=dtype)
    backend.fresh_prompts = "sdpa"
    cases = {  # qlens, contexts -> SDPA groups (first row, prompts, length)
        ((1, 40, 5, 20, 1, 17), (30, 0, 0, 30, 200, 0)): [(1, 1, 40), (67, 1, 17)],
        ((33, 64), (0, 0)): [(0, 1, 33), (33, 1, 64)],
        # neighbours of one length share a call; one between them (a decode row) splits
        ((24, 24, 24, 20, 1, 24, 24), (0, 0, 0, 0, 50, 0, 0)):
            [(0, 3, 24), (72, 1, 20), (93, 2, 24)],
    }
    for (qlens, ctx), groups in cases.items():
        q, k, v, kc, vc, meta = random_paged_case(rng, "cpu", dtype, 16, 3, 3, qlens, ctx, 64)
        torch_ref.write_kv(kc, vc, k, v, meta)
        want = torch_ref.paged_attention(q.float(), kc.float(), vc.float(), meta, 0.125)
        got = backend.paged_attention(q, kc, vc, meta, 0.125, new_kv=(k, v)).float()
        assert torch.equal(backend.paged_attention(qkv_view(q), kc, vc, meta, 0.125,
                                                   new_kv=(k, v)).float(), got)
        assert meta.derived["cpu_fresh"][0] == groups
        every_row_fresh = all(c == 0 and n >= backend.FRESH_MIN for n, c in zip(qlens, ctx))
        assert (meta.derived["cpu_fresh"][1] is None) == every_row_fresh
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        assert ((got - want).abs().max() / want.abs().max()) <= tol
        backend.fresh_prompts = "native"            # the same step through the native kernel
        meta.derived.clear()
        native = backend.paged_attention(q, kc, vc, meta, 0.125, new_kv=(k, v)).float()
        assert ((native - want).abs().max() / want.abs().max()) <= tol
        backend.fresh_prompts = "sdpa"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch_across_the_range(dtype):
    """silu(gate) * up, vector body and scalar tail (a width that is not a multiple of 16),
    over gates from -1e4 to 1e4: exp of a large argument is clamped, not inf * 0."""
    g = torch.cat([torch.linspace(-100, 100, 997), torch.tensor([-1e4, -88.5, -87.0, 0.0,
                                                                  87.0, 88.5, 1e4])])
    u = torch.linspace(-3, 3, g.numel())
    rows = torch.stack([g, g.flip(0)])
    gate_up = torch.cat([rows, torch.stack([u, u])], dim=1).to(dtype)
    got = cpu_native.silu_mul(gate_up).float()
    gd, ud = gate_up[:, :g.numel()], gate_up[:, g.numel():]
    want = (F.silu(gd.float()).to(dtype).float() * ud.float()).to(dtype).float()
    assert torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 1 / 128
    assert torch.allclose(got, want, rtol=tol, atol=1e-6), (got - want).abs().max()


@pytest.mark.skipif(not native_lib.amx_supported(), reason="no AMX tiles on this CPU")
@pytest.mark.parametrize("block_size", [16, 32, 48])    # 48: not a power of two
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("dim", [64, 128])
def test_amx_kernel_matches_the_vector_kernel_and_reference(block_size, group, dim):
    """The AMX kernel (q.k and P.V on the tile unit) over the randomized cases: decode rows,
    prefill rows in tiles of 16 / G, contexts straddling blocks, several kv heads sharing
    the tile's columns or not. Its probabilities are rounded to bf16 as the vector kernel's
    are, so the two agree closely, and both are within the bf16 tolerance of the fp32
    reference."""
    rng = random.Random(block_size * 1000 + group * 10 + dim)
    backend = get_backend("cpu", "cpu", dtype=torch.bfloat16)
    for _ in range(4):
        kv_heads = rng.choice([1, 2, 3, 5]) if group < 8 else rng.choice([1, 2])
        q, kc, vc, meta = _case(rng, torch.bfloat16, block_size, kv_heads, group, dim)
        want = torch_ref.paged_attention(q.float(), kc.float(), vc.float(), meta, dim ** -0.5)
        backend.tiles = "vector"
        vector = backend.paged_attention(q, kc, vc, meta, dim ** -0.5).float()
        backend.tiles = "amx"
        got = backend.paged_attention(q, kc, vc, meta, dim ** -0.5).float()
        assert torch.isfinite(got).all()
        assert ((got - want).abs().max() / want.abs().max()) <= 1e-2
        assert ((got - vector).abs().max() / vector.abs().max()) <= 1e-2
        assert torch.equal(backend.paged_attention(qkv_view(q), kc, vc, meta,
                                                   dim ** -0.5).float(), got)


@pytest.mark.parametrize("tiles", ["vector", "amx"])
@pytest.mark.parametrize("block_size", [16, 32, 48])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("scale", [0.125, 2.0], ids=["scale/8", "scale2"])
def test_prompt_kernels_match_the_reference(tiles, block_size, group, scale):
    """Prompt chunks of 32 rows or more (the prompt kernels, where the CPU has AVX512-BF16:
    16-row blocks, keys and values packed once per kv head, a lazily moving max; on the AMX
    tiles or by vdpbf16ps) beside decode rows and short chunks (the decode tiles), in one
    call: fresh prompts and chunks after cached context, lengths that end mid-block. At a
    large scale (scores spread over ~±100) the running max moves many times along a row, so
    the outputs' rescaling is exercised. Elsewhere the same cases check the decode tiles."""
    if tiles == "amx" and not native_lib.amx_supported():
        pytest.skip("no AMX tiles on this CPU")
    rng = random.Random(block_size * 100 + group * 10 + int(scale))
    backend = get_backend("cpu", "cpu", dtype=torch.bfloat16)
    backend.tiles = tiles
    for _ in range(3):
        q, kc, vc, meta, qlens, ctx = random_prompt_case(rng, torch.bfloat16, block_size,
                                                         rng.choice([1, 2, 3]), group)
        want = torch_ref.paged_attention(q.float(), kc.float(), vc.float(), meta, scale)
        got = backend.paged_attention(q, kc, vc, meta, scale).float()
        assert torch.isfinite(got).all()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err <= 1e-2, (err, qlens, ctx)
        assert torch.equal(backend.paged_attention(qkv_view(q), kc, vc, meta, scale).float(),
                           got)


@pytest.mark.parametrize("tiles", ["vector", "amx"])
@pytest.mark.parametrize("scale", [0.125, 2.0], ids=["scale/8", "scale2"])
def test_prompt_kernels_long_chunks_at_the_causal_edge(tiles, scale):
    """SmolLM2's shapes on the prompt kernels over long chunks whose lengths are not
    multiples of 16 or 32 (301 rows after 777 cached keys, 95 fresh, 64 after 1,000), so
    the causal edge falls mid-block in every item, with an attention sink (key 0 of each
    sequence aligned with every query: one term far above the rest, many small ones beside
    it, a max that moves): within the bf16 tolerance of the fp32 reference, and the AMX
    kernel within it of the vector prompt kernel."""
    if tiles == "amx" and not native_lib.amx_supported():
        pytest.skip("no AMX tiles on this CPU")
    rng = random.Random(int(scale * 8))
    q, _, _, kc, vc, meta = random_paged_case(rng, "cpu", torch.bfloat16, 16, 3, 3,
                                              [301, 95, 64], [777, 0, 1000], 64)
    for s, table in enumerate(meta.block_tables.tolist()):
        kc[table[0], 0] = (q[meta.query_start_loc[s]:meta.query_start_loc[s + 1]].float()
                           .view(-1, 3, 3, 64).mean((0, 2)) * 4).bfloat16()
    want = torch_ref.paged_attention(q.float(), kc.float(), vc.float(), meta, scale)
    backend = get_backend("cpu", "cpu", dtype=torch.bfloat16)
    backend.tiles = "vector"
    vector = backend.paged_attention(q, kc, vc, meta, scale).float()
    backend.tiles = tiles
    got = backend.paged_attention(q, kc, vc, meta, scale).float()
    assert torch.isfinite(got).all()
    assert ((got - want).abs().max() / want.abs().max()) <= 1e-2
    assert ((got - vector).abs().max() / vector.abs().max()) <= 1e-2


@pytest.mark.parametrize("tiles", ["vector", "amx"])
def test_prompt_kernels_divide_by_the_sum_of_what_they_multiply(tiles):
    """The prompt kernels (AMX, and the AVX512-BF16 vector one) sum each row's bf16
    probabilities exactly as P.V multiplies them, so where every key's value is the same
    vector the output is that vector to the bit, whatever the scores (at a scale where the
    max moves along the rows)."""
    if tiles == "amx" and not native_lib.amx_supported():
        pytest.skip("no AMX tiles on this CPU")
    if tiles == "vector" and ("avx512_bf16" not in machine.cpu_info()[1]
                              or native_lib.variant() != "native"):
        pytest.skip("the vector prompt kernel needs AVX512-BF16")
    rng = random.Random(3)
    q, _, _, kc, vc, meta = random_paged_case(rng, "cpu", torch.bfloat16, 16, 3, 3,
                                              [97, 40], [300, 0], 64)
    row = torch.randn(3, 64).bfloat16()
    vc[:] = row
    backend = get_backend("cpu", "cpu", dtype=torch.bfloat16)
    backend.tiles = tiles
    got = backend.paged_attention(q, kc, vc, meta, 2.0)
    assert torch.equal(got.view(-1, 3, 3, 64), row.view(1, 3, 1, 64).expand(got.shape[0], 3, 3, 64))


def test_avx2_prompt_kernel_matches_the_reference():
    """The AVX2 build's prompt kernel (fp32 by FMA; each run's keys and values widened and
    packed once per kv head, 2 rows x 32 keys a step, a lazily moving max), built here in a
    fresh process, over the cases above: chunks of 32-257 rows, fresh and after cached
    context, beside decode rows and a short chunk (the AVX2 decode tiles), at both scales;
    bf16 and fp32 queries and caches, head dims 64 and 128, G 1, 3 and 8, blocks of 16, 32
    and 48 keys. fp8 caches: tests/kernels/test_kv_fp8.py's portable case."""
    code = (
        "import random, torch\n"
        "from kernels import get_backend, torch_ref\n"
        "from kernels.testing import random_prompt_case\n"
        "for block_size in (16, 32, 48):\n"
        "    for group in (1, 3, 8):\n"
        "        for scale in (0.125, 2.0):\n"
        "            rng = random.Random(block_size * 100 + group * 10 + int(scale))\n"
        "            for dtype, dim, tol in ((torch.bfloat16, 64, 1e-2),\n"
        "                                    (torch.float32, 64, 1e-4),\n"
        "                                    (torch.bfloat16, 128, 1e-2)):\n"
        "                q, kc, vc, meta, qlens, ctx = random_prompt_case(\n"
        "                    rng, dtype, block_size, rng.choice([1, 2, 3]), group, dim)\n"
        "                want = torch_ref.paged_attention(q.float(), kc.float(), vc.float(),\n"
        "                                                 meta, scale)\n"
        "                got = get_backend('cpu', 'cpu', dtype=dtype).paged_attention(\n"
        "                    q, kc, vc, meta, scale).float()\n"
        "                err = ((got - want).abs().max() / want.abs().max()).item()\n"
        "                assert torch.isfinite(got).all() and err <= tol, (\n"
        "                    block_size, group, scale, dtype, dim, err, qlens, ctx)\n"
        "print('ok')\n")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       env={**os.environ, "WEIR_CPU_KERNEL_PORTABLE": "avx2"}, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]

def test_amx_refuses_what_it_cannot_run():
    q = torch.randn(1, 3, 64)
    kc = torch.zeros(2, 16, 1, 64)
    meta = AttentionMetadata.build([1], [0], [[0]], 16)
    with pytest.raises(ValueError, match="refused"):           # fp32: the AMX kernel is bf16
        cpu_native.paged_attention(q, kc, kc, meta, 0.125, amx=True)
    if native_lib.amx_supported():
        kb = torch.zeros(2, 8, 1, 64, dtype=torch.bfloat16)     # blocks of 8 keys
        meta8 = AttentionMetadata.build([1], [0], [[0]], 8)
        with pytest.raises(ValueError, match="refused"):
            cpu_native.paged_attention(q.bfloat16(), kb, kb, meta8, 0.125, amx=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [576, 100])                 # 36 vectors; 6 and a tail of 4
def test_add_rms_norm_is_exact(dtype, dim):
    """h += delta in the model's dtype, the sum of squares in float64, then (as torch)
    normalised in float32, rounded to the dtype, times the weight, rounded: bit for bit,
    the vector loops and their scalar tails alike, with and without the residual add."""
    g = torch.Generator().manual_seed(dim)
    for rows in (1, 3, 64):
        h = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
        delta = torch.randn(rows, dim, generator=g).to(dtype)
        w = (torch.rand(dim, generator=g) + 0.5).to(dtype)
        for d in (delta, None):
            summed = h if d is None else (h.float() + d.float()).to(dtype)
            inv = (1.0 / torch.sqrt(summed.double().pow(2).mean(1, keepdim=True) + 1e-5)).float()
            want = ((summed.float() * inv).to(dtype).float() * w.float()).to(dtype)
            got_h, out = h.clone(), torch.empty_like(h)
            cpu_native.add_rms_norm(got_h, d, w, out, 1e-5)
            assert torch.equal(got_h, summed) and torch.equal(out, want), (rows, d is None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [64, 128, 48])          # whole vectors; 48: the scalar loop
def test_rope_is_the_torch_formula_to_the_bit(dtype, dim):
    """In-place rotate-half RoPE on the first ``heads`` heads of strided qkv rows: in bf16
    as the torch path (cos and sin rounded to the dtype, each product rounded, the sum
    rounded), bit for bit, the vector loop and the scalar one alike; in float32 within an
    ulp or two (the compiler may fuse a product and the sum); the heads after them (v) and
    the row padding untouched."""
    from components.executor.elementwise import ElementwiseOps
    g = torch.Generator().manual_seed(dim)
    theta = 1e5
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(512, dtype=torch.float32), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    heads, total = 5, 7                                   # rotate 5 of 7 heads
    for rows in (1, 9, 40):
        qkv = (torch.randn(rows, total * dim + 8, generator=g) * 4).to(dtype)
        pos = torch.randint(0, 512, (rows,), generator=g)
        x = qkv[:, :heads * dim].view(rows, heads, dim)
        c, s = cos[pos].to(dtype)[:, None, :], sin[pos].to(dtype)[:, None, :]
        want = qkv.clone()
        want[:, :heads * dim] = ElementwiseOps.rope(x, c, s).reshape(rows, heads * dim)
        got = qkv.clone()
        cpu_native.rope_(got, heads, dim, pos, cos, sin)
        assert torch.equal(got[:, heads * dim:], qkv[:, heads * dim:])
        if dtype == torch.bfloat16:
            assert torch.equal(got, want), rows
        else:
            assert torch.allclose(got, want, rtol=2 ** -21, atol=2 ** -20), rows
