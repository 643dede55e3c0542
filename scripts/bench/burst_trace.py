"""A bursty slice of a real Mooncake trace, for the autoscaler comparison (issue 47).

    scripts/run bench/burst_trace SOURCE.jsonl OUT.jsonl [--start-s 0] \
        [--segments 300:1,300:3,1200:1]
    scripts/run bench/burst_trace SOURCE.jsonl --check      # only measure SOURCE

Neither Mooncake trace here (conversation, synthetic) has a burst of 3x or more, and the
release's toolagent trace was not obtainable. This lays real rows out by ``--segments``
(``SECONDS:COPIES``; COPIES stretches of the source over each other: ``weir.replay.burst``),
so the default is 300 s at the source's rate, 300 s at three times it, 1,200 s at it again.
The rows are the source's (Mooncake FAST'25 release, kvcache-ai/Mooncake,
``FAST25-release/traces/``, Apache-2.0); the timeline is constructed. It prints the
burstiness of the source and of the result (arrivals in 10-120 s windows: the largest jump
from one window to the next, and peak over mean).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from weir.replay.burst import burstiness, splice


def describe(name: str, rows: list[dict]) -> None:
    ts = [r["timestamp"] / 1e3 for r in rows]
    print(f"{name}: {len(rows)} requests over {max(ts) - min(ts):.0f} s")
    for w in (10, 30, 60, 120):
        j = burstiness(ts, w)
        print(f"  {w:>3} s windows: largest jump {j.ratio:.2f}x ({j.before} -> {j.after} "
              f"at {j.at_s:.0f} s), peak/mean {j.peak_over_mean:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source")
    p.add_argument("out", nargs="?")
    p.add_argument("--start-s", type=float, default=0.0)
    p.add_argument("--segments", default="300:1,300:3,1200:1")
    p.add_argument("--check", action="store_true", help="measure SOURCE only")
    args = p.parse_args()
    rows = [json.loads(line) for line in Path(args.source).read_text().splitlines() if line]
    describe(args.source, rows)
    if args.check:
        return
    if not args.out:
        p.error("OUT is needed unless --check")
    segments = [(float(s), int(c)) for s, c in
                (part.split(":") for part in args.segments.split(","))]
    out = splice(rows, segments, args.start_s)
    Path(args.out).write_text("".join(json.dumps(r, separators=(",", ":")) + "\n"
                                      for r in out))
    describe(args.out, out)


if __name__ == "__main__":
    main()
