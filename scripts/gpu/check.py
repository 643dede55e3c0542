#!/usr/bin/env python3
"""Check and time the executor's GPU paths in one call (run as ``bash scripts/gpu_check``).

On a CUDA device, within a hard time budget (default 270 s):

1. device-to-device copy bandwidth (the practical memory roofline);
2. Triton write_kv / prefill / decode against the torch reference (fp32 at 1e-4, bf16 at
   2e-2 against an fp32 reference): block sizes 16 and 32, GQA 1 and 3, contexts straddling
   block edges up to ~2000, mixed prefill + decode batches, and decode from static buffers
   with padding rows (the CUDA-graph path);
   and the fused RoPE + KV write (``rope_write_kv``, [1b]) against ``rope_`` then
   ``write_kv`` (the same bytes) and torch's float32 RoPE, padding rows storing nothing;
3. the flash-attn adapter the same way (block size 256), or "skipped: not installed";
4. CUDA-graph replay against eager logits for every batch bucket (SmolLM2-135M-shaped model,
   fp32, random weights or ``--model-path`` GGUF), padding rows writing no KV; the model on
   Triton's fused elementwise ops (the GPU's default) against torch's ops; speculative
   decoding's verify steps (rows of 1 + k tokens, k 1, 2 and 4, beside a plain decode row,
   logits at every token, eager) against the torch reference and against the same tokens
   decoded one at a time;
   piecewise graphs ([3c]): a full and a padded mixed step (decode rows, chunks after a
   cached prefix, fresh chunks) in every token bucket up to 2048, logits at every row and
   the KV against the eager forward, padding rows writing no KV;
5. decode-step timing at batch 1, 8, 64, 256 with ~512 tokens of context each, eager and
   graph, bf16: SmolLM2-135M-shaped, then Llama-1B-shaped while time remains; a table of
   ms/step, tokens/s, bytes moved (weights + KV read), GB/s and fractions of the HBM peak
   and of the measured copy bandwidth. Verify steps (k=4, eager) at batch 1, 4 and 16
   against plain decode steps of the same batch: ms and the ratio. For SmolLM2 also
   (``--no-profile`` skips them): where a step's time goes (wall, device busy, kernels per
   step and the top kernels, from torch's profiler), graph steps by FlashDecoding partition
   size, and the same steps on torch's elementwise ops (an A/B);
   prefill and mixed steps eager against piecewise graphs ([4f]): one-sequence prefill of
   128, 512 and 2048 tokens, and 64 decode rows at 512 tokens of context beside a
   512-token chunk (ms and the speedup);
6. a step grid for a cost profile (44 shapes, cut off after ``--grid-s``, default 60 s):
   SmolLM2-135M-shaped bf16 steps run as the executor's ModelRunner.step runs them
   (decode-only batches replay their CUDA graph, other steps their piecewise graphs, every
   sequence samples greedily), median of 5 runs after 2 warm-ups: one-sequence prefill
   chunks of 16..2048 tokens from empty and after a computed prefix, decode batches of
   1..256 at contexts 64, 512 and 1536, and decode batches with one prefill chunk. Each is
   written as a step-log line to ``--steps-out`` (default ``$OUT/gpu_steps.jsonl``).

After a GPU run, ``weir calibrate --from-steps <files_at>/gpu_steps.jsonl --out
gpu-h200.json`` fits the GPU profile for ``weir simulate --profile gpu-h200.json``.
``measured_s`` there is the executor's step alone: unlike the live scheduler's step log it
includes no bus round trip (plan sent to result read between the scheduler's and the
executor's processes), so its const term is lower than a live engine's; add that round trip
to the profile's ``const`` coefficient (``coef[0]``, seconds) to simulate the whole engine.

Exit status: 0 all checks passed, 1 a correctness check failed, 3 no CUDA device.
``--cpu-dry-run`` exercises the same code on the CPU at tiny sizes (Triton under
TRITON_INTERPRET=1, timing and a 14-shape step grid with the torch backend; the grid is
written only to an explicit ``--steps-out``). Needs only torch, triton and numpy: nothing
here imports msgspec, zmq or weir. The checks, the timing and the step grid live beside
this file (``checks.py``, ``timing.py``, ``steps.py``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from scripts.gpu.checks import (
    check_flash_attn,
    check_fused_elementwise,
    check_graphs,
    check_logit_processing,
    check_triton,
    check_triton_invariant,
    check_verify,
)
from scripts.gpu.prefill import (
    GPU_PREFILL_CASES,
    TINY_PREFILL_CASES,
    check_piecewise,
    check_rope_kv,
    time_prefill,
)
from scripts.gpu.steps import (  # noqa: F401 - re-exported: the tests import them from here
    GPU_GRID,
    TINY_GRID,
    StepCase,
    StepTiming,
    time_step_grid,
    write_step_log,
)
from scripts.gpu.timing import (
    Row,
    _free,
    build_timed,
    copy_bandwidth,
    decode_blocks,
    format_table,
    profile_decode,
    sweep_decode_partitions,
    time_decode,
    time_verify,
)

EXIT_FAILED, EXIT_NO_CUDA = 1, 3
DEFAULT_GGUF = Path.home() / ".cache/weir/models/SmolLM2-135M-Instruct.Q4_1.gguf"


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.t0 = seconds, time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()


class Report:
    """Correctness results, printed as they come."""

    def __init__(self) -> None:
        self.passed = 0
        self.failures: list[str] = []

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}  {detail}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failures.append(name)
        return ok


def _load_gguf(path: Path):
    """(spec, fp32 weights) from a GGUF file, or None when it or the loader is missing."""
    if not path.is_file():
        return None
    try:
        from components.executor.loader import load_model
    except ImportError as e:
        print(f"  {path.name}: loader unavailable ({e}); random weights instead", flush=True)
        return None
    return load_model(path)


# ---------------------------------------------------------------- entry points

def gpu_main(args) -> int:
    import torch
    import triton

    import kernels
    from components.executor.build import build_model
    from components.executor.piecewise_graphs import PiecewiseGraphs, token_buckets
    from components.executor.synthetic import LLAMA_1B, SMOLLM2_135M, random_weights
    budget = Budget(args.budget_s)
    device = torch.device("cuda")
    report = Report()
    print(f"gpu_check: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"triton {triton.__version__}, budget {args.budget_s:.0f} s", flush=True)
    copy_bps = copy_bandwidth(device, 2 << 30)
    print(f"device-to-device copy: {copy_bps / 1e12:.2f} TB/s (read + write); peak assumed "
          f"{args.peak_tbs} TB/s", flush=True)

    print("[1] Triton kernels vs torch reference", flush=True)
    check_triton(report, device, [torch.float32, torch.bfloat16])
    print("[1c] Triton attention of deterministic steps: each row alone == in the step",
          flush=True)
    check_triton_invariant(report, device, [torch.float32, torch.bfloat16])
    print("[1b] fused RoPE + KV write vs rope_ + write_kv and torch", flush=True)
    check_rope_kv(report, device, [torch.float32, torch.bfloat16])
    print("[2] flash-attn adapter", flush=True)
    check_flash_attn(report, device)

    print("[2b] sampling penalties and logprobs vs the CPU", flush=True)
    check_logit_processing(report, device)

    print("[3] CUDA graphs vs eager, every bucket (fp32)", flush=True)
    real = _load_gguf(Path(args.model_path)) if args.model_path else None
    shape, label = (real[0], "smollm2-135m") if real else (SMOLLM2_135M, "smollm2-135m-rand")
    weights = real[1] if real else random_weights(shape, torch.float32, device)
    model = build_model(shape, weights, dtype=torch.float32, device=device, backend="triton")
    check_graphs(report, label + " fp32", model, max_len=1024, max_batch=args.max_batch,
                 block_size=16, tol=1e-3)
    del model
    _free(device)
    check_fused_elementwise(report, label + " fp32", device, shape, weights, 1e-3)
    _free(device)
    print("[3b] speculative verify steps (1 + k tokens a row) vs the torch reference and "
          "vs one token at a time (fp32)", flush=True)
    check_verify(report, label + " fp32", device, shape, weights, 1e-3, max_len=1024)
    _free(device)
    print("[3c] piecewise graphs (prefill and mixed steps) vs eager, every token bucket "
          "(fp32)", flush=True)
    model = build_model(shape, weights, dtype=torch.float32, device=device, backend="triton")
    check_piecewise(report, label + " fp32", model, token_buckets(2048), max_len=1024,
                    block_size=16, tol=1e-3)
    del model
    _free(device)
    if "flash_attn" in kernels._REGISTRY and budget.left() > 120:
        from kernels.flash_attn_backend import FlashAttnBackend
        fa = FlashAttnBackend(block_size=256, dtype=torch.bfloat16, device=device)
        model = build_model(shape, random_weights(shape, torch.bfloat16, device),
                            dtype=torch.bfloat16, device=device, backend=fa)
        check_graphs(report, label + " flash-attn bf16", model, max_len=1024, max_batch=16,
                     block_size=256, tol=5e-2)
        del model
        _free(device)

    print("[4] decode timing (bf16)", flush=True)
    rows: list[Row] = []
    weights = real[1] if real else random_weights(shape, torch.bfloat16, device)
    blocks = decode_blocks(args.batches, args.context)
    if args.grid_s > 0:
        blocks = max(blocks, GPU_GRID.blocks(16))
    model, kv, graphs = build_timed(label, shape, weights, torch.bfloat16, device, blocks, 2048,
                                    max(args.batches + list(GPU_GRID.batches)))
    del weights
    rows += time_decode(report, label, model, shape, kv, graphs, args.batches, args.context, 2,
                        args.steps, budget, 25)
    if budget.left() > 40:
        print(f"[4a] speculative verify steps (k=4, eager) vs plain decode steps ({label} "
              f"bf16, context {args.context})", flush=True)
        time_verify(label, model, shape, kv, graphs, [1, 4, 16], 4, args.context, args.steps,
                    budget, 30)
    print(f"[4f] prefill and mixed steps, eager vs piecewise graphs ({label} bf16)", flush=True)
    pieces = None
    if model.rope_kv:
        pieces = PiecewiseGraphs(model, kv, max_tokens=2048)
        info = pieces.capture()
        print(f"  {label}: captured {len(info['buckets'])} buckets x {info['pieces']} pieces "
              f"in {info['seconds']} s, pool reserved {info['pool_reserved_bytes'] / 2**20:.1f}"
              f" MiB, static buffers {info['static_bytes'] / 2**20:.1f} MiB", flush=True)
        time_prefill(label, model, kv, pieces, GPU_PREFILL_CASES, args.steps, budget, 20)
    else:
        print(f"  {label}: skipped: backend {model.backend.name} has no fused RoPE + KV "
              "write", flush=True)
    if args.profile and budget.left() > 60:
        print(f"[4b] where a decode step's time goes ({label} bf16, context "
              f"{args.context})", flush=True)
        profile_decode(label, model, shape, kv, graphs, [1, 64], args.context)
        print(f"[4c] graph decode steps by FlashDecoding partition size ({label} bf16, "
              f"grids for 2048 tokens)", flush=True)
        sweep_decode_partitions(label, model, shape, kv, [1, 8, 64, 256], args.context, 2048,
                                args.steps)
        print(f"[4d] A/B: the same decode steps with torch's elementwise ops "
              f"({label} bf16)", flush=True)
        ab, _, ab_graphs = build_timed(
            label + " torch-ew", shape,
            real[1] if real else random_weights(shape, torch.bfloat16, device),
            torch.bfloat16, device, 0, 2048, 64, kernels={"elementwise": "torch"}, kv=kv)
        time_decode(None, label + " torch-ew", ab, shape, kv, ab_graphs, [1, 8, 64],
                    args.context, 2, args.steps, budget, 0)
        del ab, ab_graphs
        _free(device)
    if args.profile and budget.left() > 90:
        print(f"[4e] A/B: the same graph decode steps over fp8 KV caches ({label} bf16, "
              f"kv.dtype fp8_e4m3 / fp8_e5m2)", flush=True)
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            tag = label + "-kv-" + str(fp8).replace("torch.float8_", "")
            ab, ab_kv, ab_graphs = build_timed(
                tag, shape, real[1] if real else random_weights(shape, torch.bfloat16, device),
                torch.bfloat16, device, decode_blocks(args.batches, args.context), 2048,
                max(args.batches), kv_dtype=fp8)
            rows += time_decode(report, tag, ab, shape, ab_kv, ab_graphs, args.batches,
                                args.context, 2, args.steps, budget, 45)
            del ab, ab_kv, ab_graphs
            _free(device)
    if args.grid_s > 0:
        print(f"[5] step grid for a cost profile ({label} bf16, at most {args.grid_s:.0f} s)",
              flush=True)
        timings = time_step_grid(model, kv, graphs, GPU_GRID,
                                 Budget(min(args.grid_s, budget.left() - 20)), pieces)
        path = steps_path(args)
        if path is None:
            print("  step grid: not written (pass --steps-out or set $OUT)", flush=True)
        elif timings:
            write_step_log(path, timings, f"{label} bfloat16")
    del model, kv, graphs, pieces
    _free(device)
    if not args.skip_1b and budget.left() > 60:
        print("[6] decode timing (bf16), 1B-shaped", flush=True)
        model, kv, graphs = build_timed("llama-1b-rand", LLAMA_1B,
                                        random_weights(LLAMA_1B, torch.bfloat16, device),
                                        torch.bfloat16, device,
                                        decode_blocks(args.batches, args.context), 2048,
                                        max(args.batches))
        rows += time_decode(report, "llama-1b-rand", model, LLAMA_1B, kv, graphs, args.batches,
                            args.context, 2, args.steps, budget, 20)
        del model, kv, graphs
    elif not args.skip_1b:
        print("  llama-1b-rand: skipped (time budget)", flush=True)
    print()
    print(format_table(rows, args.peak_tbs * 1e12, copy_bps))
    print("bytes/step = every weight once + K/V of every cached token in every layer "
          "(logits and activations not counted)")
    return summary(report, budget)


def summary(report: Report, budget: Budget) -> int:
    print(f"\n{report.passed} checks passed, {len(report.failures)} failed, "
          f"{budget.elapsed():.0f} s")
    for name in report.failures:
        print(f"  FAILED: {name}")
    return EXIT_FAILED if report.failures else 0


def tiny_shape():
    """The dry run's model shape."""
    from components.executor.synthetic import ModelShape
    return ModelShape("tiny", num_layers=2, hidden_size=64, intermediate_size=96, num_heads=6,
                      num_kv_heads=2, head_dim=16, vocab_size=101, max_position=256)


def dry_run_step_grid(path: Path | None) -> list[StepTiming]:
    """TINY_GRID through the tiny model (torch backend) on the CPU, written to ``path``."""
    from components.executor.build import build_model
    from components.executor.synthetic import random_weights
    tiny = tiny_shape()
    model = build_model(tiny, random_weights(tiny), backend="torch")
    kv = model.new_kv_cache(TINY_GRID.blocks(16), 16)
    kv.data.normal_()
    timings = time_step_grid(model, kv, None, TINY_GRID, Budget(60))
    if path is not None:
        write_step_log(path, timings, f"{tiny.name} float32 cpu")
    return timings


def cpu_dry_run(args) -> int:
    """The same code at tiny sizes on the CPU: Triton checks under the interpreter, the
    static-buffer graph path without graphs, timing and the step grid with the torch
    backend (the grid written only to an explicit ``--steps-out``)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import importlib.util

    import torch

    from components.executor.build import build_model
    from components.executor.synthetic import random_weights
    budget = Budget(args.budget_s)
    report = Report()
    tiny = tiny_shape()
    if importlib.util.find_spec("triton") is not None:
        print("[1] Triton kernels vs torch reference (interpreter)", flush=True)
        check_triton(report, "cpu", [torch.float32, torch.bfloat16], tiny=True)
        print("[1c] Triton attention of deterministic steps: each row alone == in the step "
              "(interpreter)", flush=True)
        check_triton_invariant(report, "cpu", [torch.float32, torch.bfloat16], tiny=True)
        print("[1b] fused RoPE + KV write vs rope_ + write_kv and torch (interpreter)",
              flush=True)
        check_rope_kv(report, "cpu", [torch.float32, torch.bfloat16], tiny=True)
        print("[2] flash-attn adapter", flush=True)
        check_flash_attn(report, "cpu", tiny=True)
        print("[3] static-buffer decode vs eager (no graphs on the CPU)", flush=True)
        model = build_model(tiny, random_weights(tiny), backend="triton")
        check_graphs(report, "tiny fp32", model, max_len=64, max_batch=4, block_size=16,
                     tol=1e-4, partials=(3,))
        check_fused_elementwise(report, "tiny fp32", "cpu", tiny, random_weights(tiny), 1e-4)
        print("[3b] speculative verify steps vs the torch reference and one token at a time",
              flush=True)
        check_verify(report, "tiny fp32", "cpu", tiny, random_weights(tiny), 1e-4, rows=3,
                     max_len=64)
        print("[3c] piecewise prefill and mixed steps vs eager, every token bucket (no graphs "
              "on the CPU)", flush=True)
        tri = build_model(tiny, random_weights(tiny), backend="triton",
                          kernels={"elementwise": "triton"})
        pieces, pieces_kv = check_piecewise(report, "tiny fp32", tri, [16, 32, 48], max_len=64,
                                            block_size=16, tol=1e-4)
        print("[4f] prefill and mixed steps, eager vs piecewise (no graphs on the CPU)",
              flush=True)
        time_prefill("tiny", tri, pieces_kv, pieces, TINY_PREFILL_CASES, 2, budget, 0)
    print("[2b] sampling penalties and logprobs: torch vs native", flush=True)
    check_logit_processing(report, "cpu")
    print("[4] decode timing (torch backend, eager)", flush=True)
    model = build_model(tiny, random_weights(tiny), backend="torch")
    kv = model.new_kv_cache(2 * 3 + 1, 16)
    rows = time_decode(None, "tiny", model, tiny, kv, None, [1, 2], 24, 4, 2, budget, 0)
    fp8, fp8_kv, _ = build_timed("tiny-kv-e4m3", tiny, random_weights(tiny), torch.float32,
                                 "cpu", 2 * 3 + 1, 64, 2, kv_dtype=torch.float8_e4m3fn)
    rows += time_decode(None, "tiny-kv-e4m3", fp8, tiny, fp8_kv, None, [1, 2], 24, 4, 2,
                        budget, 0)
    print("[4a] verify steps (k=4) vs plain decode steps (torch backend, eager)", flush=True)
    time_verify("tiny", model, tiny, model.new_kv_cache(16 * 3 + 1, 16), None, [1, 4, 16], 4,
                24, 2, budget, 0)
    if args.profile:
        print("[4b] where a decode step's time goes (torch backend, eager)", flush=True)
        profile_decode("tiny", model, tiny, kv, None, [2], 24, steps=2, top=4)
        if importlib.util.find_spec("triton") is not None:
            tri = build_model(tiny, random_weights(tiny), backend="triton")
            sweep_decode_partitions("tiny", tri, tiny, tri.new_kv_cache(2 * 3 + 1, 16), [2],
                                    24, 64, 2, sizes=(None, 2))
    if args.grid_s > 0:
        print("[5] step grid (torch backend, eager)", flush=True)
        dry_run_step_grid(Path(args.steps_out) if args.steps_out else None)
    copy_bps = copy_bandwidth("cpu", 16 << 20, iters=3)
    print()
    print(format_table(rows, args.peak_tbs * 1e12, copy_bps))
    return summary(report, budget)


def steps_path(args) -> Path | None:
    """Where the GPU step grid goes: ``--steps-out``, else ``$OUT/gpu_steps.jsonl``."""
    if args.steps_out:
        return Path(args.steps_out)
    return Path(os.environ["OUT"]) / "gpu_steps.jsonl" if os.environ.get("OUT") else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="After a GPU run, `weir calibrate --from-steps "
                                "<files_at>/gpu_steps.jsonl --out gpu-h200.json` writes the GPU "
                                "profile for `weir simulate --profile gpu-h200.json`.\n"
                                "Exit status: 0 passed, 1 a check failed, 3 no CUDA.")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="run the script's logic on the CPU at tiny sizes")
    p.add_argument("--model-path", default=str(DEFAULT_GGUF) if DEFAULT_GGUF.is_file() else None,
                   help="SmolLM2 GGUF for real weights (default: random weights unless "
                        f"{DEFAULT_GGUF} exists and the loader's packages are installed)")
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="hard time budget; larger timing configs are skipped near it")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 8, 64, 256], help="decode batch sizes to time (comma list)")
    p.add_argument("--context", type=int, default=512, help="context tokens per sequence")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--max-batch", type=int, default=256, help="largest captured bucket")
    p.add_argument("--peak-tbs", type=float, default=4.8, help="HBM peak, TB/s (H200: 4.8)")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the profile of decode steps (wall, device busy, top kernels)")
    p.add_argument("--skip-1b", action="store_true", help="do not time the 1B-shaped model")
    p.add_argument("--grid-s", type=float, default=60.0,
                   help="time budget of the step grid for a cost profile (0 skips it)")
    p.add_argument("--steps-out", default=None,
                   help="the step grid's step log (default $OUT/gpu_steps.jsonl; the CPU dry "
                        "run writes one only when given)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_dry_run:
        return cpu_dry_run(args)
    import torch
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}); nothing checked. "
              "Use --cpu-dry-run to exercise the script on the CPU.")
        return EXIT_NO_CUDA
    return gpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
