"""The fp8 KV cache (kv.dtype fp8_e4m3 / fp8_e5m2): what is stored, and the attention that
reads it, native and torch, against the reference over the same stored bytes."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import KVCache, cpu_native, get_backend, native_lib, torch_ref
from kernels.kv_cache import cache_dtype, is_fp8, quantize
from kernels.metadata import AttentionMetadata
from kernels.testing import random_paged_case

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
ROOT = Path(__file__).resolve().parents[2]


def _edge_values(fp8: torch.dtype) -> torch.Tensor:
    """Every decade from 1e-7 to 1e5, the format's saturation point and past it, ties
    between neighbouring codes (normal and subnormal), the subnormal/normal boundary,
    infinities and signed zero."""
    g = torch.Generator().manual_seed(1)
    m = torch.finfo(fp8).max
    sub = 2.0 ** (-9 if fp8 == torch.float8_e4m3fn else -16)       # the subnormal step
    ties = [sub * 0.5, sub * 1.5, sub * 2.5, sub * 7.5, m * 1.0625, 1.0 + 2 ** -4,
            1.0 + 3 * 2 ** -4, 1.5 + 2 ** -3]
    rows = [torch.randn(512, generator=g) * 10.0 ** e for e in range(-7, 6)]
    rows.append(torch.tensor([0.0, -0.0, m, -m, m * 1.01, -m * 1.5, 1e30, -1e30,
                              float("inf"), float("-inf"), *ties, *[-t for t in ties]]))
    x = torch.cat(rows)
    return torch.cat([x, x.new_zeros(-x.numel() % 192)])


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_native_write_stores_what_torch_rounds_to(fp8, src):
    """The native KV write rounds each element as ``quantize`` (torch's clamp + cast) does,
    bit for bit: nearest even, subnormals, saturation at the format's largest finite value
    (infinities included), signed zero. Rows are views into a wider qkv-like buffer."""
    x = _edge_values(fp8).to(src).view(-1, 3, 64)
    wide = torch.cat([x.flatten(1), torch.zeros(x.shape[0], 64, dtype=src)], 1)
    k = wide[:, :192].view(-1, 3, 64)
    n = k.shape[0]
    kc = torch.zeros(n + 2, 1, 3, 64, dtype=fp8)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(n + 2)[:n]
    meta = AttentionMetadata.build([n], [0], [list(range(n + 2))], 1)
    meta.slot_mapping = slots
    cpu_native.write_kv(kc, vc, k, k.neg(), meta)
    want = quantize(x, fp8)
    assert torch.equal(kc.view(-1, 3, 64)[slots].view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(vc.view(-1, 3, 64)[slots].view(torch.uint8),
                       quantize(x.neg(), fp8).view(torch.uint8))
    assert torch.isfinite(want.float()).all()                      # saturated, never inf
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    torch_ref.write_kv(ref_k, ref_v, k, k.neg(), meta)
    assert torch.equal(ref_k.view(torch.uint8), kc.view(torch.uint8))


def test_cache_dtype_names():
    assert cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        cache_dtype("int4", torch.bfloat16)
    assert is_fp8(torch.float8_e5m2) and not is_fp8(torch.bfloat16)


def _fp8_case(rng, dtype, fp8, block_size, kv_heads, group, dim):
    edges = [1, block_size - 1, block_size, block_size + 1, 700, rng.randint(1, 700)]
    ctx = [rng.choice(edges) - 1 for _ in range(rng.randint(1, 5))]
    qlens = [1] * len(ctx)
    if rng.random() < 0.6:                                          # a prefill chunk too
        ctx.append(rng.randint(0, 40))
        qlens.append(rng.choice([rng.randint(2, 9), rng.randint(17, 50)]))
    q, _, _, kc, vc, meta = random_paged_case(rng, "cpu", torch.float32, block_size, kv_heads,
                                              group, qlens, ctx, dim, lookahead=2)
    return q.to(dtype), quantize(kc * 3, fp8), quantize(vc, fp8), meta


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,dim", [(1, 64), (3, 64), (4, 128), (8, 64)])
def test_native_attention_over_fp8_cache_matches_reference(fp8, dtype, group, dim):
    """The native kernel widens the fp8 keys and values as it reads them (the vector
    kernel, and the AMX one for bf16 where the CPU has it): over the same stored bytes it
    agrees with the float32 reference as closely as over a cache of the model's dtype."""
    rng = random.Random(group * 100 + dim + (7 if fp8 == torch.float8_e5m2 else 0))
    backend = get_backend("cpu", "cpu", dtype=dtype)
    tiles = ["vector"] + (["amx"] if dtype == torch.bfloat16 and native_lib.amx_supported()
                          else [])
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for _ in range(3):
        kv_heads = rng.choice([1, 2, 3])
        q, kc, vc, meta = _fp8_case(rng, dtype, fp8, 16, kv_heads, group, dim)
        want = torch_ref.paged_attention(q.float(), kc, vc, meta, dim ** -0.5)
        assert torch.isfinite(want).all()
        for t in tiles:
            backend.tiles = t
            got = backend.paged_attention(q, kc, vc, meta, dim ** -0.5).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err <= tol, (t, kv_heads, err)


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_cache_never_goes_through_sdpa_on_unrounded_keys(fp8):
    """With an fp8 cache a fresh prompt reads the stored (rounded) keys like any other row,
    so its output does not depend on whether its first chunk was fresh or cached."""
    rng = random.Random(3)
    backend = get_backend("cpu", "cpu", dtype=torch.bfloat16)
    backend.fresh_prompts = "sdpa"
    q, k, v, kc, vc, meta = random_paged_case(rng, "cpu", torch.bfloat16, 16, 3, 3,
                                              [40, 1], [0, 30], 64)
    kc, vc = kc.to(fp8), vc.to(fp8)
    backend.write_kv(kc, vc, k, v, meta)
    got = backend.paged_attention(q, kc, vc, meta, 0.125, new_kv=(k, v))
    assert "cpu_fresh" not in meta.derived
    backend.fresh_prompts = "native"
    assert torch.equal(got, backend.paged_attention(q, kc, vc, meta, 0.125))


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_blocks_copy_and_hold_half_the_bytes(fp8):
    kv = KVCache.allocate(2, 6, 16, 3, 64, fp8)
    bf = KVCache.allocate(2, 6, 16, 3, 64, torch.bfloat16)
    assert kv.data[:, :, 0].numel() * kv.data.element_size() * 2 == \
        bf.data[:, :, 0].numel() * bf.data.element_size()
    kv.data.copy_(quantize(torch.randn(kv.data.shape), fp8))
    before = kv.data.view(torch.uint8).clone()
    kv.copy_blocks([1, 4], [4, 5])                 # sources read before any write
    after = kv.data.view(torch.uint8)
    assert torch.equal(after[:, :, 4], before[:, :, 1])
    assert torch.equal(after[:, :, 5], before[:, :, 4])


@pytest.mark.parametrize("build", ["avx2", "scalar"])
def test_portable_kernels_read_fp8_caches(build):
    """The kernels other CPUs run (no AVX-512: F16C widening; no AVX2: a lookup per
    element), and their KV write (scalar rounding), built here in a fresh process."""
    code = (
        "import random, torch\n"
        "from kernels import get_backend, torch_ref\n"
        "from kernels.kv_cache import quantize\n"
        "from kernels.testing import random_paged_case\n"
        "for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):\n"
        "    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):\n"
        "        rng = random.Random(5)\n"
        "        q, k, v, kc, vc, meta = random_paged_case(rng, 'cpu', dtype, 16, 3, 3,\n"
        "            [1, 1, 40, 9], [0, 300, 17, 5], 64)\n"
        "        kc, vc = kc.to(fp8), vc.to(fp8)\n"
        "        b = get_backend('cpu', 'cpu', dtype=dtype)\n"
        "        b.write_kv(kc, vc, k * 40, v, meta)\n"
        "        rk, rv = kc.clone(), vc.clone()\n"
        "        torch_ref.write_kv(rk, rv, k * 40, v, meta)\n"
        "        assert torch.equal(rk.view(torch.uint8), kc.view(torch.uint8)), 'write'\n"
        "        want = torch_ref.paged_attention(q.float(), kc, vc, meta, 0.125)\n"
        "        got = b.paged_attention(q, kc, vc, meta, 0.125).float()\n"
        "        err = ((got - want).abs().max() / want.abs().max()).item()\n"
        "        assert err <= tol, (fp8, dtype, err)\n")
    env = {**os.environ, "WEIR_CPU_KERNEL_PORTABLE": build, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
