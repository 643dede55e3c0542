"""scripts/gpu_check on the CPU: --help, the no-CUDA exit, the --cpu-dry-run pass (Triton
checks under the interpreter, static-buffer decode, timing table), and the byte accounting
behind its roofline numbers."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from components.executor.synthetic import (LLAMA_1B, SMOLLM2_135M, ModelShape, decode_bytes,
                                           kv_read_bytes, random_weights, weight_bytes)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
if "gpu_check" not in sys.modules:  # the script, imported by path (dataclasses need it named)
    _spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["gpu_check"])
gpu_check = sys.modules["gpu_check"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)


def test_help():
    r = _run("--help")
    assert r.returncode == 0 and "--cpu-dry-run" in r.stdout and "Exit status" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_no_cuda_is_a_distinct_exit():
    r = _run()
    assert r.returncode == gpu_check.EXIT_NO_CUDA == 3
    assert "no CUDA device" in r.stdout


def test_cpu_dry_run():
    r = _run("--cpu-dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "FAIL" not in out and " 0 failed" in out
    if importlib.util.find_spec("triton") is not None:
        assert "ok   triton static-decode" in out and "stray KV writes 0" in out
    table = [line.split() for line in out.splitlines() if line.startswith("tiny ")]
    assert [(row[1], row[2]) for row in table] == [("1", "eager"), ("2", "eager")]
    for row in table:  # tokens/s == batch / (ms / 1000)
        assert float(row[4]) == pytest.approx(int(row[1]) / float(row[3]) * 1e3, rel=1e-2)


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
