"""scripts/gpu_check (scripts/gpu/check.py) on the CPU: --help, the no-CUDA exit, the
--cpu-dry-run pass (Triton checks under the interpreter, deterministic steps' attention
row by row, the fused RoPE + KV write,
static-buffer decode, piecewise prefill and mixed steps in every token bucket, speculative
verify steps, prefill timed eager against piecewise, the timing table, verify steps timed
against decode, the step grid), the byte accounting behind its roofline numbers, and the
step grid's step log (shapes as the scheduler counts them, fitted by weir calibrate,
written without msgspec)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from components.executor.synthetic import (
    LLAMA_1B,
    SMOLLM2_135M,
    ModelShape,
    decode_bytes,
    kv_read_bytes,
    random_weights,
    weight_bytes,
)
from scripts.gpu import check as gpu_check

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    """The entry point the GPU machine runs, on this interpreter (no venv, as there)."""
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHON=sys.executable))


def test_help():
    r = _run("--help")
    assert r.returncode == 0 and "--cpu-dry-run" in r.stdout and "Exit status" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_no_cuda_is_a_distinct_exit():
    r = _run()
    assert r.returncode == gpu_check.EXIT_NO_CUDA == 3
    assert "no CUDA device" in r.stdout


def test_cpu_dry_run(tmp_path):
    r = _run("--cpu-dry-run", "--steps-out", str(tmp_path / "steps.jsonl"))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "FAIL" not in out and " 0 failed" in out
    if importlib.util.find_spec("triton") is not None:
        assert "ok   triton static-decode" in out and "stray KV writes 0" in out
        for kind in ("decode ", "prefill", "mixed  "):  # a deterministic step's attention
            assert f"ok   triton invariant {kind} bfloat16" in out
        for fp8 in ("float8_e4m3fn", "float8_e5m2"):       # fp8 caches under a bf16 model
            assert f"ok   triton decode  bfloat16 kv {fp8}" in out
        for k in (1, 2, 4):     # speculative verify rows through the model on Triton
            assert f"ok   tiny fp32 verify k={k}: triton == torch reference" in out
        assert out.count("ok   fused rope+kv write") == 2          # fp32 and bf16
        assert "same bytes as rope_ + write_kv: True" in out
        # piecewise graphs: a full and a padded mixed step in every bucket (16, 32, 48)
        pieced = [line.split() for line in out.splitlines()
                  if line.startswith("  ok   tiny fp32 piecewise == eager")]
        assert [int(row[row.index("eager,") + 1]) for row in pieced][::2] == [16, 32, 48]
        assert len(pieced) == 6 and all("stray KV writes 0" in " ".join(row) for row in pieced)
        assert [int(row[row.index("bucket") + 1].rstrip(",")) for row in pieced] == \
            [16, 16, 32, 32, 48, 48]
        timed = [line for line in out.splitlines() if line.startswith("  tiny: ")
                 and " piecewise " in line]
        assert [line.split(" (")[0].split(": ")[1] for line in timed] == [
            "prefill 16", "prefill 40", "mixed 4 + 16"]
        for line in timed:  # "... eager E ms, piecewise P ms, Rx (...)"
            words = line.replace(",", "").split()
            eager, piece = float(words[words.index("eager") + 1]), \
                float(words[words.index("piecewise") + 1])
            slack = 0.005 + eager / piece * (0.0005 / eager + 0.0005 / piece)  # as below
            assert float(words[words.index("piecewise") + 3].rstrip("x")) == pytest.approx(
                eager / piece, abs=slack + 1e-9)
    verify = [line.split() for line in out.splitlines() if "tiny: verify k=4 batch" in line]
    assert [int(row[row.index("batch") + 1]) for row in verify] == [1, 4, 16]
    for row in verify:      # "... eager decode D ms, eager verify V ms (...) ... R x"
        at = row.index("decode")
        decode, ver = float(row[at + 1]), float(row[row.index("verify", at) + 1])
        # the ratio is printed from the unrounded times, the times to 3 decimals: a ratio
        # of 34 over a 0.3 ms decode moves 0.06 with the decode's last digit
        slack = 0.005 + ver / decode * (0.0005 / decode + 0.0005 / ver)
        assert float(row[-1].rstrip("x")) == pytest.approx(ver / decode, abs=slack + 1e-9)
    table = [line.split() for line in out.splitlines() if line.startswith("tiny ")]
    assert [(row[1], row[2]) for row in table] == [("1", "eager"), ("2", "eager")]
    fp8_rows = [line.split() for line in out.splitlines() if line.startswith("tiny-kv-e4m3 ")]
    assert [(row[1], row[2]) for row in fp8_rows] == [("1", "eager"), ("2", "eager")]
    for row in table:  # tokens/s == batch / (ms / 1000)
        assert float(row[4]) == pytest.approx(int(row[1]) / float(row[3]) * 1e3, rel=1e-2)
    assert "[5] step grid" in out
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == len(
        gpu_check.TINY_GRID.cases())


def test_weight_bytes_are_the_parameter_counts():
    # the published sizes: SmolLM2-135M 134,515,008 parameters, Llama-3.2-1B 1,235,814,400
    assert weight_bytes(SMOLLM2_135M, 1, batch=0) == 134_515_008
    assert weight_bytes(LLAMA_1B, 1, batch=0) == 1_235_814_400
    tiny = ModelShape("t", num_layers=2, hidden_size=8, intermediate_size=12, num_heads=2,
                      num_kv_heads=1, head_dim=4, vocab_size=10)
    unique = {id(t): t.numel() for t in random_weights(tiny).values()}
    assert weight_bytes(tiny, 2, batch=0) == 2 * sum(unique.values())
    untied = tiny.scaled(tie_word_embeddings=False)
    unique = {id(t): t.numel() for t in random_weights(untied).values()}
    # untied: the embedding table is not read, only the batch's rows
    assert weight_bytes(untied, 2, batch=3) == 2 * (sum(unique.values()) - 10 * 8 + 3 * 8)


def test_decode_bytes():
    # 8 sequences of 513 tokens, 30 layers, K and V, 3 kv heads of 64, bf16
    assert kv_read_bytes(SMOLLM2_135M, [513] * 8, 2) == 8 * 513 * 30 * 2 * 3 * 64 * 2
    assert decode_bytes(SMOLLM2_135M, [513] * 8, 2) == (
        2 * (134_515_008 + 8 * 576) + 8 * 513 * 30 * 2 * 3 * 64 * 2)


def test_table_arithmetic():
    rows = [gpu_check.Row("m", 4, "graph", 2.0, 6_000_000_000)]
    line = gpu_check.format_table(rows, peak_bps=4.8e12, copy_bps=4.0e12).splitlines()[-1]
    model, batch, mode, ms, tps, mb, gbps, peak, copy = line.split()
    assert (model, batch, mode) == ("m", "4", "graph")
    assert float(ms) == 2.0 and float(tps) == 2000.0 and float(mb) == 6000.0
    assert float(gbps) == 3000.0 and float(peak) == 62.5 and float(copy) == 75.0


def _plan_shape(case):
    from components.costs.cost_model import plan_shape
    from schemas.wire import SeqStep, StepPlan
    plan = StepPlan(0, [], [SeqStep(i, n, [], True) for i, (n, _) in enumerate(case.seqs)], [])
    return plan_shape(plan, lambda seq_id: case.seqs[seq_id][1])._asdict()


def test_step_case_shape_is_plan_shape():
    case = gpu_check.StepCase("mixed", ((1, 512),) * 3 + ((128, 256),))
    assert case.shape() == {"tokens": 131, "context": 3 * 513 + 384, "seqs": 4,
                            "pairs": 3 * 513 + 128 * 256 + 128 * 129 // 2}
    assert case.shape() == _plan_shape(case)
    assert case.blocks(16) == 3 * 33 + 24


def test_gpu_grid_fits_the_engine_defaults():
    cases = gpu_check.GPU_GRID.cases()
    kinds = [c.kind for c in cases]
    assert kinds.count("prefill") == 11 and kinds.count("decode") == 27
    assert kinds.count("mixed") == 6
    prefill = sorted(c.shape()["tokens"] for c in cases if c.kind == "prefill" and
                     c.seqs[0][1] == 0)
    assert prefill == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert {c.seqs[0][1] for c in cases if c.kind == "prefill"} == {0, 768, 1024}
    decode = [c for c in cases if c.kind == "decode"]
    assert {c.shape()["seqs"] for c in decode} == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert {c.seqs[0][1] for c in decode} == {64, 512, 1536}
    for c in cases:  # within the step budget and max_model_len (2048): graphs cover decode
        assert c.shape()["tokens"] <= 2048 and max(n + done for n, done in c.seqs) <= 2048
    assert gpu_check.GPU_GRID.blocks(16) == 256 * 97


def test_dry_run_step_grid_is_a_step_log_calibrate_fits(tmp_path):
    from weir.replay.profile import fit, read_step_log
    path = tmp_path / "gpu_steps.jsonl"
    timings = gpu_check.dry_run_step_grid(path)
    cases = gpu_check.TINY_GRID.cases()
    assert len(cases) >= 12 and [t.case for t in timings] == cases
    steps = read_step_log(path)
    assert len(steps) == len(cases)
    for step, t in zip(steps, timings):
        assert {k: step[k] for k in ("tokens", "context", "seqs", "pairs")} == _plan_shape(t.case)
        assert step["measured_s"] == step["executor_s"] == round(t.seconds, 7) > 0
        assert step["kind"] == t.case.kind and step["graph"] is False
    assert {s["kind"] for s in steps} == {"prefill", "decode", "mixed"}
    profile = fit(steps, source="test")
    assert profile.samples == len(cases) and all(c >= 0 for c in profile.coef)


def test_calibrate_stamps_the_profile_with_the_machine_the_steps_ran_on(tmp_path):
    from kernels.machine import describe
    from weir.replay.calibrate import from_steps
    path = tmp_path / "gpu_steps.jsonl"
    gpu_check.dry_run_step_grid(path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(line.replace('"device": "cpu"', '"device": "NVIDIA H200"')
                              for line in lines) + "\n")
    prof = from_steps(str(path), tmp_path / "p.json")
    assert prof.machine["device"] == "NVIDIA H200" and prof.machine["torch"]
    assert set(describe()) <= set(prof.machine)          # the keys summaries read
    # a log that names no machine: this one's
    path.write_text("".join(line.split(', "machine"')[0] + "}\n" for line in lines))
    assert from_steps(str(path), tmp_path / "q.json").machine == describe()


def test_step_grid_needs_no_msgspec_zmq_or_weir(tmp_path):
    """The GPU machine's python3 may lack msgspec and zmq: the grid and its writer must not
    import them (nor weir, which does)."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "for name in ('msgspec', 'zmq', 'weir'):\n"
        "    sys.modules[name] = None\n"
        "from scripts.gpu import check as m\n"
        f"m.dry_run_step_grid(Path({str(tmp_path / 's.jsonl')!r}))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == len(
        gpu_check.TINY_GRID.cases())
