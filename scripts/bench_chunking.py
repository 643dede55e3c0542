"""Stall-free chunking, live: 16 streams are decoding when a burst of 32 prompts of 512
tokens arrives. Prints the streams' inter-token latency (p50/p99) against their class's TPOT
SLO with `scheduler.chunking = "slack"` and with a fixed 2048-token budget, one engine after
the other, and the burst's TTFT.

    python scripts/bench_chunking.py [--tpot-ms 300] [--stream-tokens 120]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from weir.machine import summary_line  # noqa: E402
from weir.replay.local import LocalEngine  # noqa: E402

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


async def measure(endpoint: str, key: str, stream_tokens: int) -> tuple[list[float], list[float]]:
    from weir.client import AsyncClient

    rng = random.Random(0)
    gaps: list[float] = []
    burst_ttft: list[float] = []
    async with AsyncClient(endpoint, api_key=key, max_retries=0, timeout=600) as c:
        started = anyio.Event()
        decoding = [0]

        async def stream(i: int) -> None:
            s = await c.stream(prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(32)],
                               max_tokens=stream_tokens, ignore_eos=True, temperature=0.0)
            last = None
            async for _ in s:
                now = time.perf_counter()
                if last is None:
                    decoding[0] += 1
                    if decoding[0] == 16:
                        started.set()
                elif started.is_set():
                    gaps.append(now - last)
                last = now

        async def burst_one() -> None:
            r = await c.generate(prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(512)],
                                 max_tokens=2, ignore_eos=True, temperature=0.0)
            burst_ttft.append(r.ttft_ms / 1e3)

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(stream, i)
            await started.wait()
            await anyio.sleep(1.0)
            for _ in range(32):
                tg.start_soon(burst_one)
    return gaps, burst_ttft


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
            gaps, ttft = anyio.run(measure, engine.endpoint, engine.service_key,
                                   args.stream_tokens)
        gaps.sort()
        p99 = gaps[int(len(gaps) * 0.99)]
        print(f"{chunking:5}: streams' ITL p50 {statistics.median(gaps) * 1e3:.0f} ms, p99 "
              f"{p99 * 1e3:.0f} ms ({'within' if p99 * 1e3 <= args.tpot_ms else 'OVER'} the "
              f"{args.tpot_ms:g} ms SLO); burst TTFT p50 {statistics.median(ttft):.2f} s, "
              f"max {max(ttft):.2f} s")


if __name__ == "__main__":
    main()
