"""The Triton fused elementwise ops (kernels/triton_fused.py) against torch's (the
model's ``ElementwiseOps`` without fused ops), under TRITON_INTERPRET=1 on the CPU or
natively where CUDA is available; and a whole model forced onto them against torch's."""
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from components.executor.build import build_model  # noqa: E402 - after TRITON_INTERPRET is set
from components.executor.elementwise import ElementwiseOps  # noqa: E402 - after TRITON_INTERPRET is set
from components.executor.synthetic import ModelShape, random_weights  # noqa: E402 - after TRITON_INTERPRET is set
from kernels import AttentionMetadata, triton_fused  # noqa: E402 - after TRITON_INTERPRET is set

SPEC = ModelShape("fused", num_layers=1, hidden_size=96, intermediate_size=80, num_heads=6,
                  num_kv_heads=2, head_dim=16, vocab_size=50, max_position=64)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _ops(dtype, fused):
    return ElementwiseOps(SPEC, dtype, torch.device(DEVICE), triton_fused if fused else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch(dtype, with_delta):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(7, SPEC.hidden_size, generator=g).to(dtype).to(DEVICE)
    delta = torch.randn(7, SPEC.hidden_size, generator=g).to(dtype).to(DEVICE)
    w = (torch.rand(SPEC.hidden_size, generator=g) + 0.5).to(dtype).to(DEVICE)
    want_h, want_x = _ops(dtype, False).add_norm(h.clone(), delta if with_delta else None, w)
    got_h, got_x = _ops(dtype, True).add_norm(h.clone(), delta if with_delta else None, w)
    # the residual in the stream's dtype, as torch's add leaves it (to one rounding: the
    # interpreter's casts to bf16 truncate)
    torch.testing.assert_close(got_h, want_h, **TOL[dtype])
    torch.testing.assert_close(got_x, want_x, **TOL[dtype])
    assert not torch.equal(got_x, torch.zeros_like(got_x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_torch_in_place_on_the_fused_rows(dtype):
    g = torch.Generator().manual_seed(2)
    width = (SPEC.num_heads + 2 * SPEC.num_kv_heads) * SPEC.head_dim
    qkv = torch.randn(5, width, generator=g).to(dtype).to(DEVICE)
    pos = torch.tensor([0, 3, 17, 63, 9], device=DEVICE)
    ref, fused = _ops(dtype, False), _ops(dtype, True)
    want = ref.split_qkv(qkv.clone(), pos, ref.rope_tables(pos))
    rows = qkv.clone()
    got = fused.split_qkv(rows, pos, fused.rope_tables(pos))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[dtype])
    n_qk = (SPEC.num_heads + SPEC.num_kv_heads) * SPEC.head_dim
    assert torch.equal(rows[:, n_qk:], qkv[:, n_qk:])     # v untouched
    assert torch.equal(rows[0, :n_qk], qkv[0, :n_qk])     # position 0 is the identity
    assert not torch.equal(rows[1:, :n_qk], qkv[1:, :n_qk])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(3)
    gu = (torch.randn(9, 2 * 1100, generator=g) * 3).to(dtype).to(DEVICE)  # two column tiles
    want = _ops(dtype, False).silu_mul(gu)
    got = _ops(dtype, True).silu_mul(gu)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_a_model_on_the_fused_ops_matches_torch_ops():
    shape = ModelShape("tiny", num_layers=2, hidden_size=64, intermediate_size=96,
                       num_heads=6, num_kv_heads=2, head_dim=16, vocab_size=101,
                       max_position=256)
    weights = random_weights(shape, seed=4)
    models = {e: build_model(shape, weights, device=DEVICE, backend="triton",
                             kernels={"elementwise": e}) for e in ("triton", "torch")}
    assert models["triton"].plan.elementwise == "triton"
    query_lens, context_lens = [5, 1, 1], [0, 7, 20]
    tables = [[0], [1], [2, 3]]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, 16, DEVICE)
    ids = torch.randint(0, shape.vocab_size, (sum(query_lens),),
                        generator=torch.Generator().manual_seed(5)).to(DEVICE)
    rows = torch.tensor([4, 5, 6], device=DEVICE)
    out = {}
    for e, m in models.items():
        kv = m.new_kv_cache(4, 16)
        kv.data.normal_(generator=torch.Generator(DEVICE).manual_seed(6))
        out[e] = (m.forward(ids, meta.positions, kv, meta, rows), kv.data.clone())
    torch.testing.assert_close(out["triton"][0], out["torch"][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out["triton"][1], out["torch"][1], rtol=1e-5, atol=1e-5)


def test_forcing_an_unknown_elementwise_kind_is_a_clear_error():
    shape = ModelShape("tiny", num_layers=1, hidden_size=64, intermediate_size=96,
                       num_heads=6, num_kv_heads=2, head_dim=16, vocab_size=101,
                       max_position=256)
    with pytest.raises(ValueError, match="'native', 'triton' or 'torch'"):
        build_model(shape, random_weights(shape, seed=4), device=DEVICE,
                    kernels={"elementwise": "cuda"})


def test_forcing_triton_elementwise_on_a_cpu_without_the_interpreter_is_a_clear_error(
        monkeypatch):
    from components.executor import autotune
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on a GPU"):
        autotune._elementwise_forced("triton", True, torch.device("cpu"))
    assert autotune._elementwise_forced("triton", False, torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="'native' cannot run here"):
        autotune._elementwise_forced("native", False, torch.device("cuda"))
