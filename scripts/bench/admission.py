"""Deadline-aware admission against the fcfs baseline, live and simulated, in one report.

    scripts/run bench/admission [--live-requests 60] [--sim-requests 3000]
        [--time-scale 3.7] [--profile P] [--out DIR]

The same Mooncake conversation slice (lengths ÷16, an interactive and a batch class drawn
60/40 by the seed), offered at ``--time-scale``: the default offers about 1.5x the engine's
capacity as the simulator measures it with the shipped reference profile
(tests/weir/replay/test_policies.py derives it). Live: a local engine per policy, one after
the other, replayed through the SDK. Simulated: a longer slice under both configs. Prints the
machine, the scaling and the SLOs, then one comparison table of the four runs.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import anyio

from kernels.machine import summary_line
from schemas.config import load_config
from scripts import ROOT
from weir.replay import profile as profiles
from weir.replay.commands import _assign, write_outputs
from weir.replay.live import SdkTarget, replay
from weir.replay.local import LocalEngine
from weir.replay.sim import Simulator, fast_block_hashes
from weir.replay.synth import PromptSynth, load_tokenizer, scale
from weir.replay.traces import load_trace
from weir.replay.types import Scaling

CONFIG = """
[engine]
max_model_len = 8192
[gateway]
enabled = false
[admission]
policy = "{policy}"
classes = [
  {{ name = "interactive", priority = 0, ttft_slo_ms = 3000, tpot_slo_ms = 400, max_queue_ms = 2000 }},
  {{ name = "batch", priority = 10, ttft_slo_ms = 30000, tpot_slo_ms = 1000, max_queue_ms = 25000, aging_per_s = 0.2, may_degrade = true, min_max_tokens = 8 }},
]
tenants = [{{ name = "default", classes = ["interactive", "batch"] }}]
"""  # noqa: E501 - a TOML inline table is one line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" /
                                           "mooncake_conversation_trace.jsonl"))
    ap.add_argument("--live-requests", type=int, default=60)
    ap.add_argument("--sim-requests", type=int, default=3000)
    ap.add_argument("--time-scale", type=float, default=3.7)
    ap.add_argument("--profile", default=str(ROOT / "weir" / "replay" / "profiles" /
                                             "reference-cpu.json"))
    ap.add_argument("--skip-live", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    scaling = Scaling(length=1 / 16, time=args.time_scale, block_size=512, seed=0)
    trace = _assign(load_trace(args.trace), "service_class", "interactive=0.6,batch=0.4", 0)
    tokenizer = load_tokenizer(None)
    synth = PromptSynth.for_scaling(tokenizer, scaling)
    configs = {}
    tmp = Path(tempfile.mkdtemp(prefix="weir-bench-admission-"))
    for policy in ("fcfs", "deadline"):
        configs[policy] = tmp / f"{policy}.toml"
        configs[policy].write_text(CONFIG.format(policy=policy))
    print(f"machine: {summary_line()}")
    print(f"trace: {args.trace}; live: first {args.live_requests} requests, simulated: first "
          f"{args.sim_requests}; lengths ×1/16, time ×{args.time_scale:g}, block 512 → "
          f"{scaling.scaled_block}; classes interactive 60% / batch 40% (seed 0)")
    print("SLOs: interactive TTFT ≤ 3000 ms, TPOT ≤ 400 ms; batch TTFT ≤ 30000 ms, "
          "TPOT ≤ 1000 ms")
    runs = []
    if not args.skip_live:
        live = scale(trace[:args.live_requests], scaling)
        for policy, path in configs.items():
            print(f"live: {policy} ...", file=sys.stderr)
            with LocalEngine(str(path)) as engine:
                run = anyio.run(lambda e=engine, policy=policy: replay(
                    live, SdkTarget(e.endpoint, e.service_key),
                    lambda r: (synth.token_ids(r), ""), scaling=scaling,
                    label=f"live {policy}", progress=False, max_lag_ms=250))
            runs.append(run)
    prof = profiles.load(args.profile)
    simulated = scale(trace[:args.sim_requests], scaling)
    for policy, path in configs.items():
        cfg = load_config(path, topology={"run_dir": "/nonexistent"})
        run = Simulator(cfg, prof, label=f"simulated {policy}", tokens=synth.token_ids,
                        hashes=fast_block_hashes(cfg.kv.block_size)).run(simulated, scaling)
        runs.append(run)
    out = Path(args.out or tmp / "report")
    out.mkdir(parents=True, exist_ok=True)
    ns = argparse.Namespace(slo="ttft=3000,tpot=400", slo_class=[
        "interactive:ttft=3000,tpot=400", "batch:ttft=30000,tpot=1000"], no_plots=False)
    print(write_outputs(runs, ns, out))
    print(f"wrote {out}/")


if __name__ == "__main__":
    main()
