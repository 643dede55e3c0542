"""The deterministic mode's served cost: the same Mooncake slice replayed (`weir replay`,
the SDK) against engines where none, a share, or all of the requests run batch-invariantly
(an ``eval`` class with ``deterministic = true`` drawn for that share; the rest
``interactive``). Prints each run's TTFT, TPOT and output tok/s and the ratio to "none",
with the CPU model, medians over ``--repeats`` interleaved runs.

``--ttft-prompts 512,2048``: instead, the time to first token of one prompt of each length
alone on an idle engine, deterministic (its fixed 512-token chunks, the invariant kernels)
against not, alternating, ``--repeats`` of each.

    scripts/run bench/deterministic_mix --shares 0,0.1,1 --repeats 3
    scripts/run bench/deterministic_mix --ttft-prompts 512,2048 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kernels import machine
from scripts import ROOT
from scripts.bench.serving import start_weir, stop, wait_http

CLASSES = """
[admission]
policy = "fcfs"
classes = [
  { name = "interactive", ttft_slo_ms = 3000, tpot_slo_ms = 300 },
  { name = "eval", ttft_slo_ms = 3000, tpot_slo_ms = 300, deterministic = true },
]
"""


def replay(endpoint: str, trace: str, share: float, args, out: Path) -> dict:
    mix = ("interactive=1" if share <= 0 else "eval=1" if share >= 1
           else f"interactive={1 - share:g},eval={share:g}")
    cmd = [sys.executable, "-m", "weir.cli", "replay", trace, "--limit", str(args.limit),
           "--length-scale", str(args.length_scale), "--time-scale", str(args.time_scale),
           "--class-mix", mix, "--slo", "ttft=3000,tpot=300", "--no-plots",
           "--target", endpoint, "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads((out / "summary.json").read_text())


def pick(summary: list) -> dict:
    """The numbers this bench prints, from a replay summary (one target)."""
    s = summary[0]
    return {"output_tok_s": s["output_tok_s"], "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_p99_ms": s["ttft_ms"]["p99"], "tpot_p50_ms": s["tpot_ms"]["p50"],
            "tpot_p99_ms": s["tpot_ms"]["p99"], "e2e_p50_ms": s["e2e_ms"]["p50"],
            "completed": s["completed"]}


def ttft_alone(args) -> None:
    from weir.client import Client
    lengths = [int(x) for x in args.ttft_prompts.split(",")]
    weir = start_weir(args.port, "bfloat16", max_model_len=8192)
    got: dict[tuple[int, bool], list[float]] = {}
    try:
        wait_http(f"http://127.0.0.1:{args.port}/ready", weir)
        with Client(f"ipc://{weir.run_dir}/client.sock") as c:
            for rep in range(args.repeats + 1):           # the first round warms up
                for n in lengths:
                    for det in (False, True):
                        ids = [1000 + (7 * i + 13 * rep + n) % 30000 for i in range(n)]
                        out = c.generate(prompt_token_ids=ids, max_tokens=1, deterministic=det)
                        if rep:
                            got.setdefault((n, det), []).append(out.ttft_ms or 0.0)
    finally:
        stop(weir)
    print(f"machine: {machine.summary_line()}; one prompt alone, bf16, medians of "
          f"{args.repeats} (each a new prompt: no prefix hit)")
    for n in lengths:
        off, on = (statistics.median(got[n, d]) for d in (False, True))
        print(f"{n:>5} tokens: TTFT {off:.0f} ms, deterministic {on:.0f} ms ({on / off:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shares", default="0,0.1,1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces"
                                           / "mooncake_conversation_trace.jsonl"))
    ap.add_argument("--limit", type=int, default=116)
    ap.add_argument("--length-scale", type=float, default=0.0625)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--port", type=int, default=8150)
    ap.add_argument("--ttft-prompts", default="")
    args = ap.parse_args()
    if args.ttft_prompts:
        return ttft_alone(args)
    shares = [float(x) for x in args.shares.split(",")]
    rows: dict[float, list[dict]] = {s: [] for s in shares}
    for rep in range(args.repeats):
        for share in shares:
            weir = start_weir(args.port, "bfloat16", max_model_len=8192,
                              extra_toml=CLASSES)
            try:
                wait_http(f"http://127.0.0.1:{args.port}/ready", weir)
                with tempfile.TemporaryDirectory() as out:
                    got = pick(replay(f"ipc://{weir.run_dir}/client.sock", args.trace, share,
                                      args, Path(out)))
            finally:
                stop(weir)
            rows[share].append(got)
            print(f"run {rep + 1} deterministic {share:>4.0%}: {got}", flush=True)
    print(f"\nmachine: {machine.summary_line()}; {args.limit} requests of "
          f"{Path(args.trace).name}, lengths x{args.length_scale:g}, time x{args.time_scale:g}, "
          f"bf16, fcfs; medians of {args.repeats}")
    base = None
    for share in shares:
        med = {k: statistics.median(r[k] for r in rows[share] if r[k] is not None)
               for k in rows[share][0] if k != "completed"}
        base = base or med
        print(f"deterministic {share:>4.0%}: out tok/s {med['output_tok_s']:.1f} "
              f"({med['output_tok_s'] / base['output_tok_s']:.2f}x), TTFT p50/p99 "
              f"{med['ttft_p50_ms']:.0f}/{med['ttft_p99_ms']:.0f} ms, TPOT p50/p99 "
              f"{med['tpot_p50_ms']:.1f}/{med['tpot_p99_ms']:.1f} ms, e2e p50 "
              f"{med['e2e_p50_ms']:.0f} ms")


if __name__ == "__main__":
    main()
