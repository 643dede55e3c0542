"""Fairness between tenants: a noisy neighbour, VTC against FCFS, simulated (and live).

    scripts/run bench/fairness [--duration 60] [--flood-rate 6] [--seed 1]
        [--profile P] [--out DIR] [--live] [--max-lag-ms 250]

Tenant A floods prefill-heavy requests (prompts of 1500-1900 tokens, 8-16 tokens out) far
past capacity; tenant B sends one short request a second (32-64 tokens in, 16-32 out). The
trace is written as Weir JSONL (``trace.jsonl`` in the output directory), so ``weir replay``
and ``weir simulate`` take it as is. Two configs:

- vtc: scheduler.fairness = "vtc" and what an operator would run for a shared engine with a
  bulk tenant: admission.policy = "deadline" (KV reserved for admitted work, the rest
  queued), A's "bulk" class may queue for ten minutes, its queue holds the flood (1000), and
  A's reservations are capped at 75% of the KV pool so its backlog cannot hold every block
  B's next request needs. B's class, "interactive", queues for at most 5 s.
- fcfs: the baseline, scheduler.fairness = "fcfs" and admission.policy = "fcfs".

Prints the machine (CPU model and flags) first, then one table, a column per run: the
largest service gap between backlogged tenants (VTC's measure: prompt ×1 + output ×2,
backlogged while a request waits to be scheduled), each tenant's TTFT p99 and TPOT p99,
goodput (requests inside their class's SLO over all that arrived), and for simulated runs
the seconds the engine sat idle while A had work waiting. Simulated runs use the cost
profile (default: the shipped reference CPU profile). ``--live`` also runs the same trace
against a local engine per config (``weir serve`` in a child process, replayed through the
SDK, as ``weir replay`` does); that takes minutes per config on a CPU (shorten
``--duration`` or lower ``--flood-rate``). The full report (records, summary.json, the
comparison table and plots) goes to ``--out``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kernels.machine import describe, summary_line
from schemas.config import load_config
from scripts import ROOT
from weir.replay import profile as profiles
from weir.replay.commands import parse_slo, write_outputs
from weir.replay.fairness import backlog_intervals, overlap_s
from weir.replay.report import percentile, summarize
from weir.replay.traces import load_trace, write_weir
from weir.replay.types import RunResult, Scaling, Slo
from weir.replay.workloads import noisy_neighbour

CONFIG = """
[engine]
max_model_len = 4096
[gateway]
enabled = false
[scheduler]
fairness = "{fairness}"
[admission]
policy = "{policy}"
max_queued = 1000
classes = [
  {{ name = "interactive", priority = 0, max_queue_ms = 5000 }},
  {{ name = "bulk", priority = 0, max_queue_ms = 600000 }},
]
tenants = [
  {{ name = "A", classes = ["bulk"], max_queued = 1000, kv_blocks = 1536 }},
  {{ name = "B", classes = ["interactive"] }},
]
"""
POLICIES = {"vtc": ("vtc", "deadline"), "fcfs": ("fcfs", "fcfs")}


def write_configs(tmp: Path) -> dict[str, Path]:
    paths = {}
    for name, (fairness, policy) in POLICIES.items():
        paths[name] = tmp / f"{name}.toml"
        paths[name].write_text(CONFIG.format(fairness=fairness, policy=policy))
    return paths


def tenant_row(run: RunResult, tenant: str, what: str) -> str:
    recs = [r for r in run.records if r.tenant == tenant and r.terminal == "completed"]
    values = [r.ttft_s for r in recs if r.ttft_s is not None] if what == "ttft" else \
        [r.tpot_s for r in recs if r.tpot_s is not None]
    return f"{percentile(values, 99) * 1e3:.0f}" if values else "-"


def table(runs: list[RunResult], slos: dict[str, Slo], default: Slo) -> str:
    summaries = [summarize(run, slos, default, weights=run.meta.get("weights") or {})
                 for run in runs]
    rows = [["", *(run.label for run in runs)]]
    rows.append(["largest service gap (weighted)",
                 *(f"{s.max_backlogged_gap:.0f}" for s in summaries)])
    for tenant in ("A", "B"):
        rows.append([f"{tenant} TTFT p99 (ms)", *(tenant_row(r, tenant, "ttft") for r in runs)])
        rows.append([f"{tenant} TPOT p99 (ms)", *(tenant_row(r, tenant, "tpot") for r in runs)])
        rows.append([f"{tenant} completed / arrived", *(
            f"{sum(x.tenant == tenant and x.terminal == 'completed' for x in r.records)}/"
            f"{sum(x.tenant == tenant for x in r.records)}" for r in runs)])
    rows.append(["goodput (% of arrived)", *(
        "invalid" if not s.valid else f"{s.goodput * 100:.1f}%" if s.goodput is not None
        else "-" for s in summaries)])
    rows.append(["engine idle while A waited (s)", *(
        f"{overlap_s(backlog_intervals(r.records, 'A'), r.meta['idle_intervals']):.3f}"
        if "idle_intervals" in r.meta else "-" for r in runs)])
    widths = [max(len(row[j]) for row in rows) for j in range(len(rows[0]))]
    lines = ["  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in
                                                     zip(row[1:], widths[1:])]).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of trace")
    ap.add_argument("--flood-rate", type=float, default=6.0, help="A's requests per second")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", default=str(ROOT / "weir" / "replay" / "profiles" /
                                             "reference-cpu.json"))
    ap.add_argument("--slo-interactive", default="ttft=10000,tpot=4000",
                    help="B's class SLO (ms); the reference CPU profile's full-budget step "
                         "is ~3.8 s, so a TPOT under it cannot be met beside the flood")
    ap.add_argument("--slo-bulk", default="ttft=600000,tpot=4000", help="A's class SLO (ms)")
    ap.add_argument("--live", action="store_true",
                    help="also replay the trace against a local engine per config")
    ap.add_argument("--max-lag-ms", type=float, default=250.0,
                    help="live: a run whose client fell this far behind is invalid")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    info = describe()
    print(f"machine: {summary_line(info)}")
    print(f"cpu: {info['cpu']}; flags: {' '.join(info['flags']) or '(none of interest)'}")
    tmp = Path(tempfile.mkdtemp(prefix="weir-bench-fairness-"))
    out = Path(args.out or tmp / "report")
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.jsonl"
    write_weir(noisy_neighbour(args.duration, flood_rate=args.flood_rate, seed=args.seed,
                               flood_class="bulk", light_class="interactive"), trace)
    requests = load_trace(trace)                # as `weir replay` / `weir simulate` read it
    flood = sum(r.tenant == "A" for r in requests)
    print(f"trace: {trace} ({len(requests)} requests: A {flood} at {args.flood_rate:g}/s, "
          f"prompts 1500-1900, outputs 8-16; B {len(requests) - flood} at 1/s, prompts "
          f"32-64, outputs 16-32; {args.duration:g} s, seed {args.seed})")
    slos = {"interactive": parse_slo(args.slo_interactive), "bulk": parse_slo(args.slo_bulk)}
    print("SLOs: " + "; ".join(f"{c} TTFT ≤ {s.ttft_ms:g} ms, TPOT ≤ {s.tpot_ms:g} ms"
                               for c, s in slos.items()))
    configs = write_configs(tmp)

    from weir.replay.sim import Simulator, fast_block_hashes
    from weir.replay.synth import PromptSynth, load_tokenizer

    scaling = Scaling(seed=args.seed)
    synth = PromptSynth.for_scaling(load_tokenizer(None), scaling)
    prof = profiles.load(args.profile)
    print(f"profile: {prof.describe()}")
    runs = []
    for name, path in configs.items():
        cfg = load_config(path, topology={"run_dir": "/nonexistent"})
        runs.append(Simulator(cfg, prof, label=f"sim {name}", tokens=synth.token_ids,
                              hashes=fast_block_hashes(cfg.kv.block_size)).run(requests,
                                                                                scaling))
        print(f"simulated {name}: {runs[-1].meta['sim_wall_s']:.1f} s", file=sys.stderr)
    if args.live:
        runs += live_runs(requests, configs, synth, scaling, args.max_lag_ms)
    print(table(runs, slos, slos["interactive"]))
    ns = argparse.Namespace(slo=args.slo_interactive, no_plots=False, slo_class=[
        f"{c}:ttft={s.ttft_ms:g},tpot={s.tpot_ms:g}" for c, s in slos.items()])
    write_outputs(runs, ns, out)
    print(f"wrote {out}/")


def live_runs(requests, configs: dict[str, Path], synth, scaling: Scaling,
              max_lag_ms: float) -> list[RunResult]:
    """The trace against a local engine per config, one after the other, through the SDK
    (the service key acts for both tenants), as ``weir replay`` sends it. The weights of
    the config's tenants go with the run, for the service gap."""
    import anyio

    from weir.replay.live import SdkTarget, replay
    from weir.replay.local import LocalEngine

    runs = []
    for name, path in configs.items():
        print(f"live {name}: starting a local engine ...", file=sys.stderr)
        cfg = load_config(path, topology={"run_dir": "/nonexistent"})
        with LocalEngine(str(path)) as engine:
            run = anyio.run(lambda e=engine, name=name: replay(
                requests, SdkTarget(e.endpoint, e.service_key),
                lambda r: (synth.token_ids(r), ""), scaling=scaling, label=f"live {name}",
                progress=None, max_lag_ms=max_lag_ms))
        run.meta["weights"] = {t.name: t.weight for t in cfg.admission.tenants}
        runs.append(run)
    return runs


if __name__ == "__main__":
    main()
