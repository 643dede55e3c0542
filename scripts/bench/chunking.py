"""Stall-free chunking, live: 16 streams are decoding when a burst of 32 prompts of 512
tokens arrives. Prints the streams' inter-token latency (p50/p99) against their class's TPOT
SLO with `scheduler.chunking = "slack"` and with a fixed 2048-token budget, one engine after
the other, and the burst's TTFT.

    scripts/run bench/chunking [--tpot-ms 300] [--stream-tokens 120]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import anyio

from kernels.machine import summary_line
from weir.replay.local import LocalEngine
from weir.replay.probes import decode_through_burst

CONFIG = """
[engine]
max_model_len = 1024
[gateway]
enabled = false
[scheduler]
chunking = "{chunking}"
[admission]
classes = [{{ name = "chat", tpot_slo_ms = {tpot} }}]
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tpot-ms", type=float, default=300.0)
    ap.add_argument("--stream-tokens", type=int, default=120)
    args = ap.parse_args()
    print(f"machine: {summary_line()}")
    print(f"16 streams (32-token prompts, {args.stream_tokens} tokens, TPOT SLO "
          f"{args.tpot_ms:g} ms) decoding when 32 prompts of 512 tokens arrive")
    for chunking in ("slack", "fixed"):
        cfg = Path(tempfile.mkdtemp(prefix="weir-chunking-")) / "weir.toml"
        cfg.write_text(CONFIG.format(chunking=chunking, tpot=args.tpot_ms))
        with LocalEngine(str(cfg)) as engine:
            gaps, ttft = anyio.run(lambda: decode_through_burst(
                engine.endpoint, engine.service_key, stream_tokens=args.stream_tokens))
        gaps.sort()
        p99 = gaps[int(len(gaps) * 0.99)]
        print(f"{chunking:5}: streams' ITL p50 {statistics.median(gaps) * 1e3:.0f} ms, p99 "
              f"{p99 * 1e3:.0f} ms ({'within' if p99 * 1e3 <= args.tpot_ms else 'OVER'} the "
              f"{args.tpot_ms:g} ms SLO); burst TTFT p50 {statistics.median(ttft):.2f} s, "
              f"max {max(ttft):.2f} s")


if __name__ == "__main__":
    main()
