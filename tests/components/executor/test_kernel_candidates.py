"""Every kernel candidate gives the reference's logits: each linear kernel forced (native
small-batch, oneDNN-packed, plain torch), the fused native elementwise ops against torch's,
and the measured plan itself; prefill and decode shapes, with cached prefixes."""
import dataclasses
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from components.executor import autotune, candidates, linear as linear_mod, measure
from components.executor.build import build_model
from components.executor.elementwise import ElementwiseOps
from components.executor.linear import Linear
from components.executor.model import LlamaModel
from components.executor.synthetic import ModelShape, random_weights
from kernels import AttentionMetadata, cpu_forward, cpu_linear, cpu_native, native_lib
from kernels.tuning import KernelPlan

# head_dim 64 (the native attention kernel's shapes); every weight's rows a multiple of 16
SHAPE = ModelShape("tiny", num_layers=2, hidden_size=64, intermediate_size=96, num_heads=2,
                   num_kv_heads=1, head_dim=64, vocab_size=112, max_position=128)
REFERENCE = {"linear": "torch", "elementwise": "torch", "sampling": "torch"}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _logits(model: LlamaModel) -> torch.Tensor:
    """Two steps: prompts of 5, 1 and 20 tokens (the last long enough for the fresh-prompt
    path), then 1, 3 and 1 more over their prefixes; the second step's small M is where
    the native linear kernel runs."""
    kv = model.new_kv_cache(8, 16)
    got = []
    for lens, ctx in (([5, 1, 20], [0, 0, 0]), ([1, 3, 1], [5, 1, 20])):
        meta = AttentionMetadata.build(lens, ctx, [[0, 1], [2, 3], [4, 5]], 16)
        ids = torch.randint(0, SHAPE.vocab_size, (sum(lens),),
                            generator=torch.Generator().manual_seed(sum(ctx)))
        rows = torch.cumsum(torch.tensor(lens), 0) - 1
        got.append(model.forward(ids, meta.positions, kv, meta, rows))
    return torch.cat(got)


def _available(dtype: torch.dtype) -> set[str]:
    return set.intersection(*(set(candidates.linear_candidates(dtype, torch.device("cpu"), s))
                              for s in candidates.shapes(SHAPE).values()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("forced", [{"linear": "native"}, {"linear": "amx"}, {"linear": "onednn"},
                                    {"linear": "torch"}, {"linear": "fp32"},
                                    {"linear": "fp32_onednn"}, {"elementwise": "native"},
                                    {"fresh_prompts": "sdpa"}, {"fresh_prompts": "native"},
                                    {"attention_tiles": "amx", "fresh_prompts": "native"},
                                    {"attention_tiles": "vector", "fresh_prompts": "native"},
                                    {}], ids=["native", "amx_linear", "onednn", "torch", "fp32",
                                              "fp32_onednn",
                                              "fused", "sdpa", "paged", "amx", "vector",
                                              "measured"])
def test_each_candidate_gives_the_reference_logits(dtype, forced):
    if forced.get("linear", "torch") not in _available(dtype):
        pytest.skip(f"no {forced['linear']} linear kernel here for {dtype}")
    if forced.get("attention_tiles") == "amx" and not candidates.amx_possible(dtype, 16):
        pytest.skip(f"no AMX attention kernel here for {dtype}")
    if forced.get("elementwise") == "native" and \
            not candidates.native_ops_possible(SHAPE, dtype, torch.device("cpu")):
        pytest.skip("native CPU kernels unavailable (no C++ compiler)")
    weights = random_weights(SHAPE, seed=4)
    ref = build_model(SHAPE, weights, dtype=dtype, backend="torch", kernels=REFERENCE)
    # the fresh-prompt and tile choices belong to the cpu backend: pinned, so that a busy
    # machine's timing of this tiny model (which can pick torch) does not drop them
    cpu_only = {"fresh_prompts", "attention_tiles"} & set(forced)
    if cpu_only and not native_lib.available():
        pytest.skip("the cpu attention backend did not build here (no C++ compiler)")
    model = build_model(SHAPE, weights, dtype=dtype, kernels=forced,
                        backend="cpu" if cpu_only else "auto")
    for op, choice in forced.items():               # the forced choice is what runs
        if op == "linear":
            assert {c for _, c in model.plan.linear["qkv"]} >= {choice}
            assert model.plan.linear["qkv"][0] == (model.plan.linear["qkv"][0][0], choice)
        else:
            assert getattr(model.plan, op) == choice
    if forced.get("fresh_prompts"):
        assert model.backend.fresh_prompts == forced["fresh_prompts"]
    if forced.get("attention_tiles"):
        assert model.backend.tiles == forced["attention_tiles"]
    want, got = _logits(ref), _logits(model)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= TOL[dtype], (model.plan.summary(), err)


def test_the_amx_gate_up_runs_fused_with_silu_and_changes_no_bit():
    """Where the plan runs gate_up on the AMX tiles with the native elementwise ops, the
    forward takes the fused gate_up + SiLU x up (``runs["amx+silu"]``), and its logits are
    those of the linear then the elementwise op, to the bit."""
    if "amx" not in _available(torch.bfloat16) or \
            not candidates.native_ops_possible(SHAPE, torch.bfloat16, torch.device("cpu")):
        pytest.skip("no AMX linear or native elementwise ops here")
    model = build_model(SHAPE, random_weights(SHAPE, seed=4), dtype=torch.bfloat16,
                        kernels={"linear": "amx", "elementwise": "native",
                                 "layer_loop": "python"})    # the layers' Python loop
    fused, calls = model.runs["amx+silu"], []
    model.runs["amx+silu"] = lambda x, w: calls.append(x.shape[0]) or fused(x, w)
    got = _logits(model)
    assert calls == [26] * SHAPE.num_layers + [5] * SHAPE.num_layers   # every layer, both steps
    model.runs["amx+silu"] = lambda x, w: model.ops.silu_mul(model.runs["amx"](x, w, None))
    assert torch.equal(got, _logits(model))


def test_gate_up_candidates_are_timed_with_the_silu_that_follows_them():
    """The plan times gate_up as ``Linear.silu_mul`` runs it: with the native elementwise
    ops, the AMX candidate as its fused pass and every other as the linear then the native
    SiLU x up; without them, the linear alone. Other roles: the linear alone."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(192, 64, generator=g) * 0.1).to(torch.bfloat16)
    assert measure.run_as_used("gate_up", "torch") is linear_mod.RUN["torch"]
    assert measure.run_as_used("down", "torch", True) is linear_mod.RUN["torch"]
    if not candidates.native_ops_possible(SHAPE, torch.bfloat16, torch.device("cpu")):
        pytest.skip("no native elementwise ops here")
    got = measure.run_as_used("gate_up", "torch", True)(x, w)
    assert got.shape == (5, 96)
    assert torch.equal(got, cpu_native.silu_mul(torch.nn.functional.linear(x, w)))
    if "amx" in _available(torch.bfloat16):
        packed = linear_mod.PREPARE["amx"](w)
        assert torch.equal(measure.run_as_used("gate_up", "amx", True)(x, packed),
                           cpu_linear.amx_silu_mul_linear(x, packed))


@pytest.mark.parametrize("cand", ["onednn_silu", "fp32_onednn_silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_in_the_onednn_epilogue_is_silu_times_up(cand, dtype):
    """oneDNN's GEMMs with SiLU x up as post-ops (swish on the gate's accumulators, the up
    GEMM's multiplied by it) give silu(x gate^T + b_g) * (x up^T + b_u) for every row, the
    padded sizes included: within the output's rounding of the fp32 reference (one ulp in
    bf16, and the unfused path is as far), and its plain run is the two halves' linear."""
    if dtype == torch.float32 and cand == "fp32_onednn_silu":
        pytest.skip("an fp32 model's oneDNN candidate is onednn_silu")
    base = "onednn" if cand == "onednn_silu" else "fp32_onednn"
    if base not in candidates.linear_candidates(dtype, torch.device("cpu"), (192, 64)):
        pytest.skip(f"no {base} linear here for {dtype}")
    assert cand in candidates.linear_candidates(dtype, torch.device("cpu"), (192, 64), silu=True)
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(192, 64, generator=g) * 0.2).to(dtype)
    b = torch.randn(192, generator=g).to(dtype)
    packed = linear_mod.PREPARE[cand](w)
    fused = linear_mod.SILU_FUSED[cand]
    for m in (1, 5, 256, 257, 300, 1030):
        x = torch.randn(m, 64, generator=g).to(dtype)
        y = F.linear(x.float(), w.float(), b.float())
        want = F.silu(y[:, :96]) * y[:, 96:]
        got = fused(x, packed, b)
        assert got.shape == (m, 96) and got.dtype == dtype and got.is_contiguous()
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
        err = ((got.float() - want).abs() / want.abs().clamp_min(1e-2)).max().item()
        assert err <= 2 * ulp, (m, err)
        plain = linear_mod.RUN[cand](x, packed, b)
        assert torch.equal(plain, linear_mod.RUN[base](x, linear_mod.PREPARE[base](w), b))


def test_gate_up_takes_the_onednn_silu_only_where_its_plan_does():
    """A plan whose gate_up table names ``onednn_silu`` runs those rows through the fused
    GEMMs in every layer (no native SiLU x up pass), other rows and a deterministic step by
    their own kernels; the logits stay the reference's within the dtype's tolerance. Only
    gate_up with the native elementwise ops has the candidate."""
    dtype = torch.bfloat16
    if "onednn" not in _available(dtype) or \
            not candidates.native_ops_possible(SHAPE, dtype, torch.device("cpu")):
        pytest.skip("no oneDNN bf16 linear or native elementwise ops here")
    cands = {role: candidates.linear_candidates(dtype, torch.device("cpu"), s,
                                                silu=role == "gate_up")
             for role, s in candidates.shapes(SHAPE).items()}
    assert "onednn_silu" in cands["gate_up"] and "onednn_silu" not in cands["qkv"]
    assert measure.run_as_used("gate_up", "onednn_silu", True) is \
        linear_mod.SILU_FUSED["onednn_silu"]
    weights = random_weights(SHAPE, seed=4)
    plan = KernelPlan({role: [(1 << 30, "onednn")] for role in autotune.ROLES},
                      elementwise="native", sampling="torch", attention="cpu",
                      source="forced", layer_loop="python")
    plan.linear["gate_up"] = [(5, "onednn"), (1 << 30, "onednn_silu")]
    plan.invariant_linear = autotune.determinism.invariant_linear(cands)
    model = LlamaModel(SHAPE, weights, plan=plan, dtype=dtype)
    fused, calls = model.runs["onednn_silu+silu"], []
    model.runs["onednn_silu+silu"] = lambda x, w, b: calls.append(x.shape[0]) or fused(x, w, b)
    silu, passes = model.ops.silu_mul, []
    model.ops.silu_mul = lambda gu: passes.append(gu.shape[0]) or silu(gu)
    got = _logits(model)
    assert calls == [26] * SHAPE.num_layers      # the 26-row step; the 5-row one: onednn
    assert passes == [5] * SHAPE.num_layers
    want = _logits(build_model(SHAPE, weights, dtype=dtype, backend="torch", kernels=REFERENCE))
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= TOL[dtype], err
    calls.clear()
    kv = model.new_kv_cache(8, 16)
    meta = AttentionMetadata.build([26], [0], [[0, 1]], 16)
    model.forward(torch.arange(26), meta.positions, kv, meta, torch.tensor([25]),
                  deterministic=True)
    assert calls == []                            # the invariant kernel, not oneDNN


def test_a_large_gate_up_runs_its_silu_a_block_of_rows_at_a_time(monkeypatch):
    """Above SILU_BLOCK_BYTES of [M, 2 x inter] intermediate, the GEMM and the native SiLU
    x up run a block of rows at a time into one output: the same bits as the whole (a
    row-invariant kernel), and no GEMM sees more rows than the block."""
    if not candidates.native_ops_possible(SHAPE, torch.bfloat16, torch.device("cpu")) or \
            "native" not in _available(torch.bfloat16):
        pytest.skip("no native kernels here")
    assert linear_mod.silu_block_rows(3072, 2) == 2048       # SmolLM2, bf16: 12 MiB
    assert linear_mod.silu_block_rows(16384, 2) == 512       # a 1B Llama's
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(192, 64, generator=g) * 0.2).to(torch.bfloat16)
    x = torch.randn(200, 64, generator=g).to(torch.bfloat16)
    runs, seen = dict(linear_mod.RUN), []
    runs["native"] = lambda x, w, b=None: seen.append(x.shape[0]) or \
        linear_mod.native_linear(x, w, b)
    lin = Linear(w, [(1 << 30, "native")], runs)
    ops = ElementwiseOps(SHAPE, torch.bfloat16, torch.device("cpu"), cpu_native)
    whole = lin.silu_mul(x, ops)
    assert seen == [200]
    monkeypatch.setattr(linear_mod, "SILU_BLOCK_BYTES", 1)  # blocks of 64 rows
    seen.clear()
    got = lin.silu_mul(x, ops)
    assert seen == [64, 64, 64, 8]
    assert torch.equal(got, whole)
    assert torch.equal(whole, cpu_native.silu_mul(linear_mod.native_linear(
        x, linear_mod.PREPARE["native"](w))))
    with pytest.raises(ValueError, match="silu_mul writes"):
        cpu_native.silu_mul(torch.zeros(4, 192, dtype=torch.bfloat16),
                            torch.zeros(4, 97, dtype=torch.bfloat16))


def _steps(model: LlamaModel) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_logits`, and the KV cache the two steps wrote."""
    kv = model.new_kv_cache(8, 16)
    model.new_kv_cache = lambda *_: kv
    try:
        return _logits(model), kv.data.clone()
    finally:
        del model.new_kv_cache


@pytest.mark.parametrize("dtype,linear,tiles", [
    (torch.float32, "native", "vector"), (torch.bfloat16, "native", "vector"),
    (torch.bfloat16, "amx", "vector"), (torch.bfloat16, "amx", "amx"),
    (torch.bfloat16, "native", "amx")], ids=["fp32", "bf16", "bf16-amx", "bf16-amx-tiles",
                                             "bf16-vector-amx-tiles"])
def test_the_native_layer_loop_changes_no_bit(dtype, linear, tiles, monkeypatch):
    """Where every part of a step runs on the native kernels, the decoder layers run as one
    native call (kernels/csrc/cpu_forward.cpp) with the same kernels in the same order as
    the Python loop: the same logits and the same KV cache, to the bit, prefill and
    decode; a step with a kernel outside the native set (here oneDNN or torch past the
    small-batch kernel's rows) runs the Python loop."""
    if linear not in _available(dtype) or \
            not candidates.native_ops_possible(SHAPE, dtype, torch.device("cpu")):
        pytest.skip(f"no {linear} linear kernel or native ops here for {dtype}")
    if tiles == "amx" and not candidates.amx_possible(dtype, 16):
        pytest.skip("no AMX attention kernel here")
    calls = []
    real = cpu_forward.forward_layers
    monkeypatch.setattr(cpu_forward, "forward_layers",
                        lambda layers, step: calls.append(step.rows) or real(layers, step))
    forced = {"linear": linear, "elementwise": "native", "attention_tiles": tiles,
              "fresh_prompts": "native"}
    weights = random_weights(SHAPE, seed=4)
    models = {loop: build_model(SHAPE, weights, dtype=dtype, backend="cpu",
                                kernels={**forced, "layer_loop": loop})
              for loop in ("python", "native")}
    (want, want_kv), (got, got_kv) = _steps(models["python"]), _steps(models["native"])
    assert torch.equal(got, want) and torch.equal(got_kv, want_kv)
    limit = models["native"].plan.linear["qkv"][0][0]
    assert calls == [m for m in (26, 5) if m <= limit] and calls     # 26 + 5 rows: 2 steps


@pytest.mark.parametrize("dtype,kv_dtype", [
    (torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2)], ids=["fp32", "bf16", "bf16-e4m3", "bf16-e5m2"])
def test_rope_and_the_kv_write_in_one_pass_change_no_bit(dtype, kv_dtype, monkeypatch):
    """The Python layer loop with the native ops and the cpu backend runs RoPE and the KV
    write as one pass (``cpu_native.rope_write_kv_``, every layer): the same logits and
    KV cache, to the bit, as RoPE then the backend's write, in the model's dtype and fp8."""
    if not candidates.native_ops_possible(SHAPE, dtype, torch.device("cpu")):
        pytest.skip("native CPU kernels unavailable (no C++ compiler)")
    calls = []
    real = cpu_native.rope_write_kv_
    monkeypatch.setattr(cpu_native, "rope_write_kv_",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    forced = {"linear": "torch", "elementwise": "native", "fresh_prompts": "native",
              "layer_loop": "python"}
    model = build_model(SHAPE, random_weights(SHAPE, seed=4), dtype=dtype, backend="cpu",
                        kernels=forced, kv_dtype=kv_dtype)
    assert model.native_rope_kv
    got, got_kv = _steps(model)
    assert calls == [26] * SHAPE.num_layers + [5] * SHAPE.num_layers
    model.native_rope_kv = False                         # RoPE, then backend.write_kv
    want, want_kv = _steps(model)
    assert len(calls) == 2 * SHAPE.num_layers
    assert torch.equal(got, want)
    assert torch.equal(got_kv.view(torch.uint8), want_kv.view(torch.uint8))


@pytest.mark.parametrize("elementwise", ["native", "torch"])
def test_the_last_residual_add_covers_the_sampled_rows_and_changes_no_bit(elementwise,
                                                                          monkeypatch):
    """The last layer's down projection is added to the sampled rows of the residual stream
    only (LlamaModel.head), not to every row: the same logits, to the bit, as the full add."""
    if elementwise == "native" and \
            not candidates.native_ops_possible(SHAPE, torch.bfloat16, torch.device("cpu")):
        pytest.skip("native CPU kernels unavailable (no C++ compiler)")
    model = build_model(SHAPE, random_weights(SHAPE, seed=4), dtype=torch.bfloat16,
                        backend="cpu" if native_lib.available() else "torch",
                        kernels={"linear": "torch", "elementwise": elementwise,
                                 "layer_loop": "python", "fresh_prompts": "native"})
    got = _logits(model)
    real = LlamaModel.mlp
    monkeypatch.setattr(LlamaModel, "mlp",       # every layer's add over every row, as before
                        lambda self, i, h, attn, defer_last=False: real(self, i, h, attn))
    want = _logits(model)
    assert torch.equal(got, want)


def test_the_native_layer_loop_times_its_parts_only_when_asked():
    """``model.layer_seconds`` (a profiler's) gets every part's seconds from the native
    layer loop; without it nothing is timed, and the Python loop never touches it."""
    if not candidates.native_ops_possible(SHAPE, torch.float32, torch.device("cpu")) \
            or "native" not in _available(torch.float32):
        pytest.skip("no native kernels here")
    forced = {"linear": "native", "elementwise": "native", "fresh_prompts": "native"}
    weights = random_weights(SHAPE, seed=4)
    for loop in ("native", "python"):
        model = build_model(SHAPE, weights, backend="cpu", kernels={**forced, "layer_loop": loop})
        model.layer_seconds = torch.zeros(len(cpu_forward.LAYER_PARTS), dtype=torch.float64)
        _logits(model)
        timed = model.layer_seconds.tolist()
        assert all(t > 0 for t in timed) if loop == "native" else timed == [0.0] * len(timed)


@pytest.mark.parametrize("dtype,kind", [(torch.float32, "native"), (torch.bfloat16, "native"),
                                        (torch.bfloat16, "amx")])
def test_a_linear_chain_is_its_linears_one_after_another(dtype, kind):
    """bench_step's native GEMM floor: one call over several weights gives each weight's
    linear (the last output returned), to the bit; mixed shapes are refused."""
    if kind not in _available(dtype):
        pytest.skip(f"no {kind} linear kernel here for {dtype}")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 64, generator=g).to(dtype)
    ws = [cpu_linear.pack_small_batch(torch.randn(48, 64, generator=g).to(dtype))
          for _ in range(3)]
    want = cpu_linear.small_batch_linear(x, ws[-1], tiles="amx" if kind == "amx" else "vector")
    assert torch.equal(cpu_forward.linear_chain(x, ws, kind), want)
    other = cpu_linear.pack_small_batch(torch.randn(32, 64, generator=g).to(dtype))
    with pytest.raises(ValueError):
        cpu_forward.linear_chain(x, ws + [other], kind)


def test_a_step_with_a_fresh_prompt_through_sdpa_runs_the_python_loop(monkeypatch):
    """SDPA for a fresh prompt is not in the native layers: that step (26 rows: a
    20-token prompt) runs the Python loop, the next (5 decode-and-prefix rows) the native
    call, and the logits are the Python loop's throughout."""
    if not candidates.native_ops_possible(SHAPE, torch.float32, torch.device("cpu")) \
            or "native" not in _available(torch.float32):
        pytest.skip("no native kernels here")
    calls = []
    real = cpu_forward.forward_layers
    monkeypatch.setattr(cpu_forward, "forward_layers",
                        lambda layers, step: calls.append(step.rows) or real(layers, step))
    forced = {"linear": "native", "elementwise": "native", "fresh_prompts": "sdpa"}
    weights = random_weights(SHAPE, seed=4)
    want = _logits(build_model(SHAPE, weights, backend="cpu",
                               kernels={**forced, "layer_loop": "python"}))
    assert calls == []
    got = _logits(build_model(SHAPE, weights, backend="cpu", kernels=forced))
    assert torch.equal(got, want) and calls == [5]


def test_the_amx_lm_head_writes_float32_logits_and_changes_no_bit():
    """Where the plan runs the lm_head on the AMX tiles, the logits come out float32 in
    the same pass (``runs["amx+f32"]``), equal to the bf16 linear then the cast."""
    if "amx" not in _available(torch.bfloat16):
        pytest.skip("no AMX linear here")
    model = build_model(SHAPE, random_weights(SHAPE, seed=4), dtype=torch.bfloat16,
                        kernels={"linear": "amx"})
    f32, calls = model.runs["amx+f32"], []
    model.runs["amx+f32"] = lambda x, w, b: calls.append(x.shape[0]) or f32(x, w, b)
    got = _logits(model)
    assert calls == [3, 3] and got.dtype == torch.float32     # each step's sampled rows
    model.runs["amx+f32"] = lambda x, w, b: model.runs["amx"](x, w, b).float()
    assert torch.equal(got, _logits(model))


@pytest.mark.parametrize("linear", ["amx", "torch"])
def test_greedy_forward_returns_the_first_maximum_of_the_logits(linear):
    """``forward(greedy=True)``: each row's argmax of the logits the same forward returns,
    on the AMX tiles without writing them (``runs["amx+argmax"]``), else the logits and
    the argmax."""
    if linear not in _available(torch.bfloat16):
        pytest.skip(f"no {linear} linear here")
    model = build_model(SHAPE, random_weights(SHAPE, seed=4), dtype=torch.bfloat16,
                        kernels={"linear": linear})
    fused, calls = model.runs["amx+argmax"], []
    model.runs["amx+argmax"] = lambda x, w, b: calls.append(x.shape[0]) or fused(x, w, b)
    kv = model.new_kv_cache(8, 16)
    for lens, ctx in (([5, 1, 20], [0, 0, 0]), ([1, 3, 1], [5, 1, 20])):
        meta = AttentionMetadata.build(lens, ctx, [[0, 1], [2, 3], [4, 5]], 16)
        ids = torch.randint(0, SHAPE.vocab_size, (sum(lens),),
                            generator=torch.Generator().manual_seed(sum(ctx)))
        rows = torch.cumsum(torch.tensor(lens), 0) - 1
        kv_before = kv.data.clone()
        tokens = model.forward(ids, meta.positions, kv, meta, rows, greedy=True)
        kv.data.copy_(kv_before)
        logits = model.forward(ids, meta.positions, kv, meta, rows)
        assert tokens.dtype == torch.long and torch.equal(tokens, logits.argmax(-1))
    assert calls == ([3, 3] if linear == "amx" else [])
    empty = model.forward(ids, meta.positions, kv, meta, rows[:0], greedy=True)
    assert empty.shape == (0,) and empty.dtype == torch.long


def test_the_lm_head_candidates_are_timed_with_float32_logits(monkeypatch):
    """The plan times each lm_head candidate as the model runs it (float32 logits: the AMX
    kernel's own float32 pass, the others' output cast), and every other role as the bare
    linear; either way the values are the bare linear's."""
    timed = []                                   # per role, in shapes() order

    def time_linear(runs, k, dtype, buckets, anomalies=None):
        x = torch.randn(3, k).to(dtype)
        timed.append({c: (fn(x, copies[0]), linear_mod.RUN[c](x, copies[0]))
                      for c, (fn, copies, _) in runs.items()})
        return {c: {m: 1.0 for m in buckets} for c in runs}

    monkeypatch.setattr(measure.tuning, "time_linear", time_linear)
    shapes = candidates.shapes(SHAPE)
    cands = {role: candidates.linear_candidates(torch.bfloat16, torch.device("cpu"), shape)
             for role, shape in shapes.items()}
    plan = measure.measure_plan(SHAPE, torch.bfloat16, shapes, cands, False, 64, 8, 16,
                                skip={"elementwise", "sampling", "attention",
                                      "attention_tiles", "fresh_prompts"})
    roles = [*shapes, linear_mod.GREEDY_HEAD]   # and the lm_head once more, for greedy rows
    assert len(timed) == len(roles) and set(plan.linear) == set(roles)
    for role, outs in zip(roles, timed):
        assert set(outs) == set(cands.get(role, cands["lm_head"]))
        for cand, (got, bare) in outs.items():
            want = {"lm_head": bare.float(),
                    linear_mod.GREEDY_HEAD: bare.float().argmax(-1)}.get(role, bare)
            assert got.dtype == want.dtype and torch.equal(got, want), (role, cand)


def test_the_greedy_lm_head_runs_its_own_table_and_keeps_one_copy_per_layout():
    """``Linear.argmax`` runs the greedy table's candidate (the fused AMX pass or another's
    logits and argmax), the logits the other table's; each layout is held once, shared
    by both tables, and none is held that neither table runs."""
    if "amx" not in _available(torch.bfloat16):
        pytest.skip("no AMX linear here")
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    calls = []
    runs = dict(linear_mod.RUN)
    for name in ("amx", "torch"):
        runs[name] = lambda *a, name=name: calls.append(name) or linear_mod.RUN[name](*a)
    runs["amx+f32"] = lambda *a: calls.append("amx+f32") or linear_mod.amx_linear_f32(*a)
    runs["amx+argmax"] = lambda *a: calls.append("amx+argmax") or \
        cpu_linear.amx_argmax_linear(*a)
    lin = Linear(w, [(4, "torch"), (64, "amx")], runs, greedy_table=[(64, "amx")])
    assert len({id(wt) for *_, wt in lin.table + lin.greedy_table}) == 2   # torch, native
    logits = lin.float32(x)
    tokens = lin.argmax(x, native=True)
    assert calls == ["amx+f32", "amx+argmax"] and torch.equal(tokens, logits.argmax(-1))
    calls.clear()
    lin = Linear(w, [(64, "amx")], runs, greedy_table=[(2, "torch"), (64, "amx")])
    assert torch.equal(lin.argmax(x[:2], native=False), lin.float32(x[:2]).argmax(-1))
    assert calls == ["torch", "amx+f32"]
    assert torch.equal(Linear(w, [(64, "torch")], runs).argmax(x, native=True),
                       F.linear(x, w).float().argmax(-1))        # no greedy table: the table's


def test_a_forced_choice_that_cannot_run_here_is_a_clear_error():
    odd = dataclasses.replace(SHAPE, vocab_size=SHAPE.vocab_size - 8)   # the lm_head's N % 16
    with pytest.raises(ValueError, match="engine.kernels.linear = 'native' cannot run here"):
        build_model(odd, random_weights(odd, seed=1), dtype=torch.float32,
                    kernels={"linear": "native"})
    # the AMX kernels are bf16 only, on any machine
    with pytest.raises(ValueError, match="engine.kernels.linear = 'amx' cannot run here"):
        build_model(SHAPE, random_weights(SHAPE, seed=1), dtype=torch.float32,
                    kernels={"linear": "amx"})
    with pytest.raises(ValueError, match="attention_tiles = 'amx' cannot run here"):
        build_model(SHAPE, random_weights(SHAPE, seed=1), dtype=torch.float32,
                    kernels={"attention_tiles": "amx"})
    with pytest.raises(ValueError, match="layer_loop = 'fused': 'native' or 'python'"):
        build_model(SHAPE, random_weights(SHAPE, seed=1), dtype=torch.float32,
                    kernels={"layer_loop": "fused"})


def test_the_faster_attention_tiles_are_chosen(monkeypatch):
    """With injected timings, each of the paged kernels is chosen where it is faster, and
    the fresh prompts are then timed through the chosen one."""
    monkeypatch.setattr(measure, "amx_possible", lambda dtype, block_size: True)
    monkeypatch.setattr(measure, "_time_attention", lambda *a: {"cpu": 1.0, "torch": 2.0})
    seen = []
    monkeypatch.setattr(measure, "_time_fresh_prompts",
                        lambda *a: seen.append(a[-1]) or {"native": 1.0, "sdpa": 2.0})
    for timings, want in (({"vector": 2.0, "amx": 1.0}, "amx"),
                          ({"vector": 1.0, "amx": 2.0}, "vector")):
        monkeypatch.setattr(measure, "_time_attention_tiles", lambda *a, t=timings: t)
        plan = measure.measure_plan(SHAPE, torch.bfloat16, candidates.shapes(SHAPE), {}, True,
                                    64, 8, 16, skip={"linear", "elementwise", "sampling"})
        assert plan.attention == "cpu" and plan.attention_tiles == want
        assert seen[-1] == want
        assert plan.timings["attention_tiles"] == {c: s * 1e6 for c, s in timings.items()}


def test_only_the_chosen_layouts_are_kept():
    """A weight keeps one tensor per candidate in its table, no more: plain torch alone
    holds the plain weight, nothing packed."""
    model = build_model(SHAPE, random_weights(SHAPE, seed=2), kernels=REFERENCE)
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert [c for _, c, _ in lin.table] == ["torch"]
    if "onednn" in _available(torch.float32):
        packed = build_model(SHAPE, random_weights(SHAPE, seed=2),
                             kernels={**REFERENCE, "linear": "onednn"})
        assert [c for _, c, _ in packed.layers[0].qkv.table] == ["onednn"]


def test_the_model_runs_the_plan_it_is_given_and_plans_nothing(monkeypatch):
    """The plan is made before the model (by autotune; build_model asks it, then builds):
    the model only reads it. Planning would fail here; each weight's table, the greedy
    lm_head's, the elementwise ops and the attention backend are the given plan's, and the
    logits are the torch reference's (fp32 on an fp32 model is the same arithmetic)."""
    def planned(*args, **kwargs):
        raise AssertionError("the model planned its kernels")

    monkeypatch.setattr(autotune, "plan_kernels", planned)
    monkeypatch.setattr(autotune, "measure_plan", planned)
    plan = KernelPlan({role: [(1 << 30, "torch")] for role in autotune.ROLES},
                      elementwise="torch", sampling="torch", attention="torch",
                      source="forced", layer_loop="python")
    plan.linear["qkv"] = [(2, "fp32"), (1 << 30, "torch")]
    plan.linear[linear_mod.GREEDY_HEAD] = [(1 << 30, "fp32")]
    weights = random_weights(SHAPE, seed=2)
    model = LlamaModel(SHAPE, weights, plan=plan)
    assert model.plan is plan and model.backend.name == "torch" and model.ops.fused is None
    qkv = model.layers[0].qkv
    assert [c for _, c, _ in qkv.table] == ["fp32", "torch"]
    assert (qkv.pick(2)[0], qkv.pick(3)[0]) == ("fp32", "torch")
    assert [c for _, c, _ in model.layers[1].down.table] == ["torch"]
    assert [c for _, c, _ in model.lm_head.greedy_table] == ["fp32"]
    monkeypatch.undo()
    want = _logits(build_model(SHAPE, weights, backend="torch", kernels=REFERENCE))
    assert torch.equal(_logits(model), want)


def test_the_plan_is_measured_once_per_machine(tmp_path, monkeypatch, quiet_cores):
    """A clean plan is read back at the next start; another CPU model measures its own.
    The cores read as quiet (conftest's quiet_cores): a plan measured beside the suite's
    other worker is provisional, and measured again at the next start."""
    weights = random_weights(SHAPE, seed=3)
    first = build_model(SHAPE, weights, tuning_cache=tmp_path)
    again = build_model(SHAPE, weights, tuning_cache=tmp_path)
    assert (first.plan.source, again.plan.source) == ("measured", "cached")
    assert again.plan.linear == first.plan.linear and again.plan.key == first.plan.key
    assert len(list((tmp_path / "tuning").glob("*.json"))) == 1
    real = autotune.tuning.machine_info
    monkeypatch.setattr(autotune.tuning, "machine_info",
                        lambda: {**real(), "cpu": "another CPU model"})
    other = build_model(SHAPE, weights, tuning_cache=tmp_path)
    assert other.plan.source == "measured" and other.plan.key != first.plan.key
    assert len(list((tmp_path / "tuning").glob("*.json"))) == 2
    forced = build_model(SHAPE, weights, tuning_cache=tmp_path, kernels={"linear": "torch"})
    assert forced.plan.source == "forced"              # forced plans are not cached
    assert len(list((tmp_path / "tuning").glob("*.json"))) == 2
    monkeypatch.setattr(autotune.tuning, "machine_info", real)
    if native_lib.available():         # new native kernels (an upgrade): measured again
        monkeypatch.setattr(native_lib, "build_key", lambda: "another build")
        rebuilt = build_model(SHAPE, weights, tuning_cache=tmp_path)
        assert rebuilt.plan.source == "measured" and rebuilt.plan.key != first.plan.key


def test_the_native_build_key_follows_the_kernel_sources(tmp_path, monkeypatch):
    if not native_lib.available():
        pytest.skip("no native kernels here")
    key = native_lib.build_key()
    src = tmp_path / "csrc"
    src.mkdir()
    for f in native_lib._CSRC.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(native_lib, "_CSRC", src)
    assert native_lib.build_key() == key
    gemv = src / "cpu_gemv.cpp"
    gemv.write_bytes(gemv.read_bytes() + b"\n")
    assert native_lib.build_key() != key


def test_executors_started_together_measure_once(tmp_path, monkeypatch, quiet_cores):
    """Two executors of one machine asking for the same plan: the second waits for the
    first's measurement and reads it, instead of timing its kernels beside the first's.
    The first is held inside its measurement until the second has found no plan cached, so
    without the lock the second would measure too."""
    weights = random_weights(SHAPE, seed=3)
    real_measure, real_load = autotune.measure_plan, autotune.tuning.load_cached
    measured, second_looked, done = [], threading.Event(), {}

    def measure(*args):
        measured.append(threading.current_thread().name)
        assert second_looked.wait(30)
        return real_measure(*args)

    def load_cached(path):
        if threading.current_thread().name == "second":
            second_looked.set()
        return real_load(path)

    monkeypatch.setattr(autotune, "measure_plan", measure)
    monkeypatch.setattr(autotune.tuning, "load_cached", load_cached)

    def start(name):
        done[name] = build_model(SHAPE, weights, tuning_cache=tmp_path).plan

    first = threading.Thread(target=start, args=("first",), name="first")
    first.start()
    while not measured:                        # the first is inside its measurement
        assert first.is_alive()
        time.sleep(0.001)
    second = threading.Thread(target=start, args=("second",), name="second")
    second.start()
    first.join(60)
    second.join(60)
    assert measured == ["first"]
    assert (done["first"].source, done["second"].source) == ("measured", "cached")
    assert done["second"].linear == done["first"].linear


def test_onednn_is_a_candidate_only_where_it_runs(monkeypatch):
    """The oneDNN ops exist in every torch build but refuse bf16 at run time on CPUs without
    AVX-512 (AVX2-only): the probe keeps such a candidate out of the plan."""
    def refuse(w):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support "
                           "avx_ne_convert or avx512bw, avx512vl and avx512dq")

    monkeypatch.setattr(linear_mod, "_PACKS", {})
    monkeypatch.setattr(linear_mod, "onednn_pack", refuse)
    assert not linear_mod.can_pack(torch.bfloat16)
    assert "onednn" not in candidates.linear_candidates(torch.bfloat16, torch.device("cpu"),
                                                        (64, 64))
    with pytest.raises(ValueError, match="engine.kernels.linear = 'onednn' cannot run here"):
        build_model(SHAPE, random_weights(SHAPE, seed=1), dtype=torch.bfloat16,
                    kernels={"linear": "onednn"})


def test_onednn_runs_large_steps_as_few_shapes():
    """oneDNN builds and keeps a primitive per input shape: above 256 rows a step runs as
    the next multiple of 32 (64 above 1024), so 2048 possible token counts are 296 shapes."""
    rows = linear_mod.onednn_rows
    assert [rows(m) for m in (1, 17, 255, 256, 257, 288, 289, 1000, 1024, 1025, 2048)] == \
        [1, 17, 255, 256, 288, 288, 320, 1024, 1024, 1088, 2048]
    assert len({rows(m) for m in range(1, 2049)}) == 296
    assert all(rows(m) >= m for m in range(1, 4097))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_padded_onednn_rows_give_the_reference(dtype):
    """The padding rows are computed and dropped: each real row is the reference's."""
    if not linear_mod.can_pack(dtype):
        pytest.skip(f"no oneDNN packed linear here for {dtype}")
    g = torch.Generator().manual_seed(7)
    w = torch.randn(48, 32, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    packed = linear_mod.onednn_pack(w)
    for m in (256, 257, 300, 1030):
        x = torch.randn(m, 32, generator=g).to(dtype)
        got = linear_mod.onednn_linear(x, packed, b)
        want = torch.nn.functional.linear(x.float(), w.float(), b.float())
        assert got.shape == (m, 48) and got.is_contiguous()
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err <= TOL[dtype], (m, err)


def test_the_amx_linear_runs_the_native_layout_without_a_second_copy():
    w = (torch.randn(64, 96) * 0.05).to(torch.bfloat16)
    lin = Linear(w, [(1, "native"), (64, "amx"), (2048, "torch")], linear_mod.RUN)
    (_, _, native), (_, _, amx), (_, _, plain) = lin.table
    assert amx is native and native.shape == (4, 48, 16, 2) and plain is w
