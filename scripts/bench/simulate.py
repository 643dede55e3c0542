"""How fast `weir simulate` is: 10,000 requests of the scaled Mooncake conversation trace
through the production admission policy, SchedulerCore and BlockPool on a virtual clock.

    scripts/run bench/simulate [--requests 10000] [--length-scale 0.0625]
        [--time-scale 12] [--profile P] [--repeats 3]

Prints the machine, the scaling, the profile, and per repeat: setup (trace load, tokenizer)
and simulation wall time, simulated seconds per wall second, and the run's outcome counts;
then the medians. The issue's target: the simulation of 10,000 requests under 10 s on 2 cores.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

from kernels.machine import summary_line
from schemas.config import load_config
from scripts import ROOT
from weir.replay import profile as profiles
from weir.replay.sim import Simulator, fast_block_hashes
from weir.replay.synth import PromptSynth, load_tokenizer, scale
from weir.replay.traces import load_trace
from weir.replay.types import Scaling

REFERENCE = ROOT / "weir" / "replay" / "profiles" / "reference-cpu.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" /
                                           "mooncake_conversation_trace.jsonl"))
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--length-scale", type=float, default=0.0625)
    ap.add_argument("--time-scale", type=float, default=12.0)
    ap.add_argument("--profile", default=None,
                    help="default: ~/.cache/weir/profiles/local.json, else the shipped "
                         "reference profile")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = Path(args.profile) if args.profile else profiles.default_path()
    if not path.exists():
        path = REFERENCE
    prof = profiles.load(path)
    scaling = Scaling(length=args.length_scale, time=args.time_scale, block_size=512)
    cfg = load_config(None, topology={"run_dir": "/nonexistent"},
                      engine={"max_model_len": 8192})
    print(f"machine: {summary_line()}")
    print(f"trace: {args.trace}, first {args.requests} requests; lengths ×{scaling.length:g}, "
          f"time ×{scaling.time:g}, block {scaling.block_size} → {scaling.scaled_block}")
    print(f"profile: {path}: {prof.describe()}")
    setups, walls = [], []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        requests = scale(load_trace(args.trace)[:args.requests], scaling)
        synth = PromptSynth.for_scaling(load_tokenizer(None), scaling)
        t1 = time.perf_counter()
        run = Simulator(cfg, prof, tokens=synth.token_ids,
                        hashes=fast_block_hashes(cfg.kv.block_size)).run(requests, scaling)
        t2 = time.perf_counter()
        setups.append(t1 - t0)
        walls.append(t2 - t1)
        counts = Counter(r.terminal for r in run.records)
        print(f"run {i + 1}: setup {t1 - t0:.2f} s, simulate {t2 - t1:.2f} s for "
              f"{len(requests)} requests ({len(requests) / (t2 - t1):.0f} req/s), "
              f"{run.duration_s:.0f} simulated s ({run.duration_s / (t2 - t1):.0f}× real "
              f"time), {run.meta['steps']} steps, {dict(counts)}")
    sim = statistics.median(walls)
    print(f"median: simulate {sim:.2f} s, setup {statistics.median(setups):.2f} s; "
          f"target < 10 s for 10,000 requests: {'met' if sim < 10 else 'NOT met'}")


if __name__ == "__main__":
    main()
