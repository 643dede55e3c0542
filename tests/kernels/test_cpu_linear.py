"""The small-batch linear kernels (kernels/cpu_linear.py on csrc/cpu_gemv.cpp) against a
float reference: the vector kernel (AVX-512 or AVX2) in bf16 and fp32, the AMX tiles, and
the AMX forms with SiLU x up and with the argmax fused in, each to the bit of its unfused
pair; their refusals, and empty batches."""
import pytest
import torch
import torch.nn.functional as F

try:
    from kernels import cpu_linear, cpu_native, native_lib
    native_lib.load()
except ValueError as exc:                    # no compiler: callers fall back to torch
    pytest.skip(f"native CPU kernel unavailable: {exc}", allow_module_level=True)

def _needs_small_batch(dtype):
    if not cpu_linear.small_batch_supported(dtype):
        pytest.skip(f"no small-batch {dtype} linear kernel on this CPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (48, 64), (160, 2), (32, 7),
                                  (16, 64), (80, 96)])
@pytest.mark.parametrize("threads", [1, 3])
def test_small_batch_linear_matches_float_reference(n, k, dtype, threads, monkeypatch):
    """bf16 products are exact in float32, so only the summation order and the final
    rounding differ from a float32 reference: within bf16's half-ulp, scaled by the sum.
    float32: the summation order alone, a few ulps of the sum. Output widths of 1 to 60
    blocks of 16, split between 1 or 3 threads."""
    _needs_small_batch(dtype)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    if dtype == torch.bfloat16 and k % 2:
        assert cpu_linear.pack_small_batch(torch.zeros(n, k, dtype=dtype)) is None
        return
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    packed = cpu_linear.pack_small_batch(w)
    tol = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -20
    for m in (1, 3, 4, 5, 8, 9, 17, 64):      # one pass, whole passes and a remainder
        x = torch.randn(m + 2, k, generator=g).to(dtype)[1:m + 1]   # a row-strided view
        for bias in (None, b):
            want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            got = cpu_linear.small_batch_linear(x, packed, bias)
            assert got.dtype == dtype and got.shape == (m, n)
            scale = (x.float().abs() @ w.float().abs().T + 1).max()
            assert (got.float() - want).abs().max() <= tol * scale, (m, bias is None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_small_batch_linear_of_no_rows_is_empty(dtype):
    """M = 0 (the lm_head of a step in which no row samples) is an empty result, as
    F.linear gives, at both the wrapper and the kernel; only a negative M is refused, and
    rows of another dtype than the weight are a clear error."""
    _needs_small_batch(dtype)
    w = torch.randn(48, 64).to(dtype)
    packed = cpu_linear.pack_small_batch(w)
    for bias in (None, torch.randn(48).to(dtype)):
        got = cpu_linear.small_batch_linear(torch.empty(0, 64, dtype=dtype), packed, bias)
        assert got.shape == (0, 48) and got.dtype == dtype
    x, y = torch.randn(1, 64).to(dtype), torch.empty(1, 48, dtype=dtype)
    kernel = native_lib.load().weir_gemv_bf16 if dtype == torch.bfloat16 \
        else native_lib.load().weir_gemv_f32
    call = lambda m: kernel(x.data_ptr(), 64, packed.data_ptr(), None, y.data_ptr(),
                            m, 48, 64, 1)
    assert call(0) == 0 and call(-1) == -1
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="rows against"):
        cpu_linear.small_batch_linear(x.to(other), packed)


_AMX = pytest.mark.skipif(not native_lib.available() or not native_lib.amx_supported(),
                          reason="no AMX tiles on this CPU")


@_AMX
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (48, 64), (16, 32), (80, 96)])
@pytest.mark.parametrize("threads", [1, 3])
def test_amx_linear_matches_float_reference(n, k, threads, monkeypatch):
    """The AMX tile linear on the small-batch layout: within bf16's half-ulp of a float32
    reference, scaled by the sum; and (the same products, summed in another order) within
    one bf16 ulp of the vector kernel. Row counts below, at and across tiles of 16 and
    pairs of them (32), into a second pass of 64 rows and beyond; one block and odd block
    counts (a pair's second block missing); a row-strided view of x; 1 or 3 threads."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    packed = cpu_linear.pack_small_batch(w)
    for m in (1, 5, 15, 16, 17, 31, 32, 33, 47, 64, 100, 256):
        x = torch.randn(m + 2, k, generator=g).bfloat16()[1:m + 1]
        for bias in (None, b):
            want = F.linear(x.float(), w.float(),
                                              None if bias is None else bias.float())
            got = cpu_linear.small_batch_linear(x, packed, bias, tiles="amx")
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            scale = (x.float().abs() @ w.float().abs().T + 1).max()
            assert (got.float() - want).abs().max() <= 2 ** -8 * scale, (m, bias is None)
            if cpu_linear.small_batch_supported(torch.bfloat16):
                vec = cpu_linear.small_batch_linear(x, packed, bias).float()
                assert (got.float() - vec).abs().max() <= 2 ** -7 * scale, m


@_AMX
def test_amx_linear_refuses_what_it_cannot_run():
    """k % 32 (a tile's 16 k-pairs) and a negative M are refused by the kernel; M = 0 is
    an empty result."""
    w = torch.randn(48, 64).bfloat16()
    packed = cpu_linear.pack_small_batch(w)
    assert cpu_linear.small_batch_linear(torch.empty(0, 64).bfloat16(), packed,
                                         tiles="amx").shape == (0, 48)
    x, y = torch.randn(1, 64).bfloat16(), torch.empty(1, 48, dtype=torch.bfloat16)
    call = lambda m, k: native_lib.load().weir_gemm_amx_bf16(
        x.data_ptr(), 64, packed.data_ptr(), None, y.data_ptr(), m, 48, k, 1)
    assert call(1, 64) == 0 and call(-1, 64) == -1 and call(1, 48) == -1
    assert cpu_linear.amx_linear_fits(torch.bfloat16, 48, 64)
    assert not cpu_linear.amx_linear_fits(torch.bfloat16, 48, 48)       # k % 32
    assert not cpu_linear.amx_linear_fits(torch.bfloat16, 40, 64)       # n % 16
    assert not cpu_linear.amx_linear_fits(torch.float32, 48, 64)
    f32 = torch.randn(48, 64)
    with pytest.raises(ValueError, match="runs bf16 weights"):
        cpu_linear.small_batch_linear(f32[:1], cpu_linear.pack_small_batch(f32), tiles="amx")


@_AMX
@pytest.mark.parametrize("inter, k", [(1536, 576), (16, 32), (48, 96)])
@pytest.mark.parametrize("threads", [1, 3])
def test_amx_gate_up_with_silu_mul_is_the_unfused_pair_to_the_bit(inter, k, threads,
                                                                    monkeypatch):
    """The fused gate_up (gate block b paired with up block b + inter / 16) equals the AMX
    linear then SiLU x up, to the bit: row counts within, at and across tiles and pairs of
    tiles; one gate block and odd counts of them; a row-strided view of x; 1 or 3 threads."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(inter + k)
    w = (torch.randn(2 * inter, k, generator=g) * 0.2).bfloat16()
    packed = cpu_linear.pack_small_batch(w)
    for m in (0, 1, 5, 16, 17, 32, 33, 64, 100):
        x = torch.randn(m + 2, k, generator=g).bfloat16()[1:m + 1]
        got = cpu_linear.amx_silu_mul_linear(x, packed)
        want = cpu_native.silu_mul(cpu_linear.small_batch_linear(x, packed, tiles="amx")) \
            if m else torch.empty(0, inter, dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and got.shape == (m, inter)
        assert torch.equal(got, want), m


@_AMX
@pytest.mark.parametrize("m", [1, 17, 64])
def test_amx_linear_with_float32_output_is_the_cast_to_the_bit(m):
    """``out_dtype=torch.float32``: each output rounded to bf16 as always, then written
    widened: ``.float()`` of the bf16 result, bias or not. Only the AMX tiles offer it."""
    g = torch.Generator().manual_seed(m)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    packed = cpu_linear.pack_small_batch(w)
    x = torch.randn(m + 1, 64, generator=g).bfloat16()[1:]
    for bias in (None, b):
        got = cpu_linear.small_batch_linear(x, packed, bias, tiles="amx", out_dtype=torch.float32)
        want = cpu_linear.small_batch_linear(x, packed, bias, tiles="amx").float()
        assert got.dtype == torch.float32 and torch.equal(got, want)
    with pytest.raises(ValueError, match="no torch.float32 output"):
        cpu_linear.small_batch_linear(x, packed, tiles="vector", out_dtype=torch.float32)


@_AMX
@pytest.mark.parametrize("m", [0, 1, 17, 64, 100])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_argmax_linear_is_the_first_maximum_of_the_logits(m, threads, monkeypatch):
    """Greedy decoding's lm_head: each row's first maximum of the float32 logits the AMX
    linear would write (rounded to bf16, so ties are common), bias or not, rows of any
    count, over 1 and 2 threads (each a run of columns, merged in order). The rows that
    tie plant a weight row's copy at a later column, a later block, and in the other
    thread's half: the first one wins."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(m)
    n, k = 4096, 64
    w = torch.randn(n, k, generator=g).bfloat16()
    for src, copies in ((7, (9, 40, 3000)), (2100, (2101, 4095))):
        for c in copies:
            w[c] = w[src]
    b = torch.randn(n, generator=g).bfloat16()
    packed = cpu_linear.pack_small_batch(w)
    x = torch.randn(m + 1, k, generator=g).bfloat16()[1:]
    if m > 1:
        x[0], x[-1] = w[7] * 4, w[2100] * 4        # rows whose maximum ties
    for bias in (None, b):
        logits = cpu_linear.small_batch_linear(x, packed, bias, tiles="amx",
                                               out_dtype=torch.float32)
        got = cpu_linear.amx_argmax_linear(x, packed, bias)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))
    if m > 1:
        assert cpu_linear.amx_argmax_linear(x, packed)[[0, -1]].tolist() == [7, 2100]


@_AMX
def test_amx_argmax_linear_refuses_what_it_cannot_run():
    f32 = torch.randn(64, 64)
    with pytest.raises(ValueError, match="bf16 rows and weights"):
        cpu_linear.amx_argmax_linear(f32[:1], cpu_linear.pack_small_batch(f32))
    packed = cpu_linear.pack_small_batch(torch.randn(48, 48).bfloat16())     # k % 32
    with pytest.raises(ValueError, match="refused"):
        cpu_linear.amx_argmax_linear(torch.randn(2, 48).bfloat16(), packed)


@_AMX
def test_amx_gate_up_with_silu_mul_refuses_what_it_cannot_run():
    f32 = torch.randn(64, 64)
    with pytest.raises(ValueError, match="bf16 gate_up"):
        cpu_linear.amx_silu_mul_linear(f32[:1], cpu_linear.pack_small_batch(f32))
    odd = cpu_linear.pack_small_batch(torch.randn(48, 64).bfloat16())   # 3 blocks: no halves
    with pytest.raises(ValueError, match="bf16 gate_up"):
        cpu_linear.amx_silu_mul_linear(torch.randn(1, 64).bfloat16(), odd)
    x, y = torch.randn(1, 64).bfloat16(), torch.empty(1, 16, dtype=torch.bfloat16)
    packed = cpu_linear.pack_small_batch(torch.randn(32, 64).bfloat16())
    call = lambda m, k: native_lib.load().weir_gemm_amx_bf16_silu_mul(
        x.data_ptr(), 64, packed.data_ptr(), y.data_ptr(), m, 16, k, 1)
    assert call(1, 64) == 0 and call(-1, 64) == -1 and call(1, 48) == -1


def test_small_batch_pack_refuses_unfit_shapes():
    assert cpu_linear.pack_small_batch(torch.randn(40, 64).bfloat16()) is None     # n % 16
    assert cpu_linear.pack_small_batch(torch.randn(40, 64)) is None
    assert cpu_linear.pack_small_batch(torch.randn(48, 63).bfloat16()) is None     # bf16 k % 2
    assert cpu_linear.pack_small_batch(torch.randn(48, 63)).shape == (3, 63, 16)   # fp32: any k
    assert cpu_linear.pack_small_batch(torch.randn(48, 64).half()) is None         # float16
