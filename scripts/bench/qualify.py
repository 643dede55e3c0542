"""Qualification's PASS/FAIL table: a set of candidate policies against the SLO-first
defaults, each through ``weir qualify`` (both configs simulated on one Mooncake slice), at
one or more time scales.

    scripts/run bench/qualify [--times 2,1] [--limit 600] [--profile .bench/profile-bf16.json]

The current config is the shipped defaults (deadline admission, the interactive and batch
classes) in bf16 with two tenants, ``a`` and ``b``; each candidate is a partial file laid
over it, as ``weir config apply`` lays one. Every candidate keeps the default ``[rollout]``
bars. The files are written to ``--out`` (a temporary directory by default) so that any
row can be rerun by hand with the command printed above the table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kernels.machine import summary_line

CURRENT = """\
[engine]
dtype = "bfloat16"
max_model_len = 8192

[[admission.tenants]]
name = "a"

[[admission.tenants]]
name = "b"
"""

BATCH_STARVED = """\
[[admission.classes]]
name = "interactive"
priority = 0
ttft_slo_ms = 3000.0
tpot_slo_ms = 300.0

[[admission.classes]]
name = "batch"
priority = 1
max_queue_ms = 600000.0
aging_per_s = 0.0
may_degrade = true
late = "keep"
"""

# name -> (what it changes, the partial TOML laid over CURRENT)
CANDIDATES: dict[str, tuple[str, str]] = {
    "same": ("the running policy restated", '[admission]\npolicy = "deadline"\n'
                                            "ttft_headroom = 0.2\n"),
    "starve-batch": ("batch never ages, queued up to 10 min", BATCH_STARVED),
    "headroom": ("ttft_headroom = 0.05", "[admission]\nttft_headroom = 0.05\n"),
    "fcfs": ('policy = "fcfs": admit what the caps allow', '[admission]\npolicy = "fcfs"\n'),
    "caps": ("each tenant max_running = 6",
             '[[admission.tenants]]\nname = "a"\nmax_running = 6\n\n'
             '[[admission.tenants]]\nname = "b"\nmax_running = 6\n'),
    "weighted": ("tenant a weight 4",
                 '[[admission.tenants]]\nname = "a"\nweight = 4.0\n\n'
                 '[[admission.tenants]]\nname = "b"\n'),
    "fixed-chunks": ('scheduler.chunking = "fixed" (the full budget every step)',
                     '[scheduler]\nchunking = "fixed"\n'),
}


def failed_bars(v: dict) -> str:
    out = []
    for c in v["checks"]:
        if not c["passed"]:
            cur, cand = c["current"], c["candidate"]
            fmt = (lambda x: "-" if x is None else f"{x:.3g}")
            out.append(f"{c['name']} {fmt(cur)} -> {fmt(cand)}")
    return "; ".join(out) or "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(Path(__file__).resolve().parents[3] / "shared"
                                           / "traces" / "mooncake_conversation_trace.jsonl"))
    ap.add_argument("--times", default="2,1", help="time scales, comma separated")
    ap.add_argument("--limit", type=int, default=600)
    ap.add_argument("--profile", default=".bench/profile-bf16.json",
                    help="a cost profile (`weir calibrate`); if this file is missing, "
                         "weir qualify's own choice")
    ap.add_argument("--only", default="", help="candidate names, comma separated")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="weir-qualify-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "current.toml").write_text(CURRENT)
    names = [n for n in (args.only.split(",") if args.only else CANDIDATES) if n]
    for n in names:
        (out / f"{n}.toml").write_text(CANDIDATES[n][1])
    print(summary_line())
    base = ["--against", str(out / "current.toml"), "--trace", args.trace,
            "--limit", str(args.limit), "--length-scale", "0.0625",
            "--class-mix", "interactive=0.7,batch=0.3", "--tenant-mix", "a=0.5,b=0.5",
            "--no-plots", "--json"]
    if args.profile and Path(args.profile).exists():
        base += ["--profile", args.profile]
    print(f"weir qualify {out}/CANDIDATE.toml {' '.join(base)} --time-scale T")
    rows = []
    for t in args.times.split(","):
        for n in names:
            cmd = [sys.executable, "-m", "weir.cli", "qualify", str(out / f"{n}.toml"),
                   *base, "--time-scale", t]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode not in (0, 1):
                print(f"{n} x{t}: weir qualify exited {p.returncode}:\n{p.stderr}",
                      file=sys.stderr)
                return 2
            v = json.loads(p.stdout.strip().splitlines()[-1])
            rows.append((n, t, v))
            print(f"  {n} x{t}: {v['verdict']}", file=sys.stderr)
    print("\n| candidate (its change) | time | goodput current -> candidate | verdict | "
          "bars failed (current -> candidate) |\n|---|---|---|---|---|")
    for n, t, v in rows:
        print(f"| {n} ({CANDIDATES[n][0]}) | x{t} | {v['current']['goodput'] * 100:.1f} % -> "
              f"{v['candidate']['goodput'] * 100:.1f} % | **{v['verdict']}** | "
              f"{failed_bars(v)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
