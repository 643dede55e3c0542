"""The decode horizon, live: the latency knee admission finds, and the streams' TPOT with
and without the check at one offered load above it.

    scripts/run bench/knee [--knee 32] [--load 2] [--prompt 16] [--tokens 96]
        [--rate 20] [--tpot-ms T] [--runs with,without]

One class with a TPOT SLO and nothing else (no TTFT target; it may queue two minutes),
``scheduler.max_num_seqs`` 256 so the engine's own cap never binds. The SLO is sized to
this machine: a first engine is started only to read the step-cost model's decode rates
(from the executor's startup probe), and the SLO is set so that the decode step of
``--knee`` sequences of this workload is the SLO less admission's 20% headroom (or give
``--tpot-ms``). Then ``--load`` × ``--knee`` streams (``--prompt`` tokens in, ``--tokens``
out, EOS ignored) arrive ``--rate`` a second, on an engine with ``admission.decode_horizon``
on, then on one with it off, one after the other.

The prompts are short on purpose: stall-free chunking gives prefill at least 16 tokens a
step however late the streams are, so a prompt of P tokens joins the batch every P/16
steps, and a stream of T tokens leaves after T steps: without the check the batch grows
toward 16·T/P. At 32 in and 48 out that is 24, which may be under the knee, and then the
check has nothing to hold back; at 16 in and 96 out it is 96.

Prints the machine, the rates and the SLO, then per run: the knee admission reported while
requests queued for it (``horizon.knee_seqs``, median and range; it moves as the live
steps refine the rates), the most sequences the scheduler ran at once (sampled every
0.25 s), the requests' TPOT (decode time ÷ tokens after the first) p50/p99, the
inter-token gaps' p99, the TTFT p50/max (the wait the queue adds), and output tokens a
second.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from kernels.machine import summary_line
from weir.replay.local import LocalEngine

HEADROOM = 0.2                 # admission.tpot_headroom's default
CONFIG = """
[engine]
max_model_len = 1024
[gateway]
enabled = false
[scheduler]
max_num_seqs = 256
[admission]
policy = "deadline"
decode_horizon = {check}
classes = [{{ name = "stream", tpot_slo_ms = {tpot}, max_queue_ms = 120000, late = "keep" }}]
tenants = [{{ name = "default", max_queued = 256 }}]
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def engine(check: bool, tpot_ms: float) -> LocalEngine:
    cfg = Path(tempfile.mkdtemp(prefix="weir-knee-")) / "weir.toml"
    cfg.write_text(CONFIG.format(check=str(check).lower(), tpot=tpot_ms))
    return LocalEngine(str(cfg))


async def decode_rates(endpoint: str, key: str) -> dict[str, float] | None:
    """Admission's stats once a load report has brought the decode rates (None: none came
    in 5 s, the executor's startup probe gave the cost model no prior)."""
    from weir.client import AsyncClient

    async with AsyncClient(endpoint, api_key=key, max_retries=0) as c:
        for _ in range(50):
            report = await c.status()
            stats = {comp.name: comp.stats for comp in report.components}["admission"]
            if "horizon.decode_per_seq_ms" in stats:
                return stats
            await anyio.sleep(0.1)
    return None


async def offer(endpoint: str, key: str, requests: int, args: argparse.Namespace) -> dict:
    """Send the requests at the rate, sample admission's and the scheduler's stats while
    they run; what the run measured."""
    from weir.client import AsyncClient
    from weir.errors import RequestRejected

    tpot, gaps, ttft, rejected = [], [], [], []
    knees, running = [], []
    tokens = 0
    done = anyio.Event()
    async with AsyncClient(endpoint, api_key=key, max_retries=0, timeout=600) as c:

        async def one(i: int) -> None:
            nonlocal tokens
            try:
                s = await c.stream(prompt_token_ids=[1000 + (i * 37 + j) % 30000
                                                     for j in range(args.prompt)],
                                   max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
                first = last = None
                async for _ in s:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                        ttft.append(now - s.started)
                    else:
                        gaps.append(now - last)
                    last = now
                n = s.result.usage.completion_tokens
                tokens += n
                if n > 1:
                    tpot.append((last - first) / (n - 1))
            except RequestRejected as e:
                rejected.append(e.reason)

        async def sample() -> None:
            while not done.is_set():
                report = await c.status()
                stats = {comp.name: comp.stats for comp in report.components}
                adm = stats.get("admission", {})
                if adm.get("queued", 0) > 0 and "horizon.knee_seqs" in adm:
                    knees.append(int(adm["horizon.knee_seqs"]))    # while it binds
                running.append(int(stats.get("scheduler", {}).get("running", 0)))
                await anyio.sleep(0.25)

        started = time.perf_counter()
        async with anyio.create_task_group() as outer:
            outer.start_soon(sample)
            async with anyio.create_task_group() as tg:
                for i in range(requests):
                    tg.start_soon(one, i)
                    await anyio.sleep(1 / args.rate)
            done.set()
        wall = time.perf_counter() - started
    return {"tpot": tpot, "gaps": gaps, "ttft": ttft, "rejected": rejected,
            "knees": [k for k in knees if k >= 0], "running": running, "tokens": tokens,
            "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--knee", type=int, default=32)
    ap.add_argument("--load", type=float, default=2.0)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--tpot-ms", type=float, default=None)
    ap.add_argument("--runs", default="with,without",
                    help="which runs, in order: with (the check on), without (off)")
    args = ap.parse_args()
    print(f"machine: {summary_line()}")
    tpot_ms, stats = args.tpot_ms, None
    if tpot_ms is None:
        with engine(True, 1000.0) as e:
            stats = anyio.run(decode_rates, e.endpoint, e.service_key)
        if stats is None:
            tpot_ms = 150.0
            print("no decode rates at startup: TPOT SLO 150 ms")
    if stats is not None:
        base, per_seq = stats["horizon.decode_base_ms"], stats["horizon.decode_per_seq_ms"]
        per_position = stats["horizon.decode_per_position_us"] / 1e3
        context = args.prompt + args.tokens // 2
        step = base + args.knee * (per_seq + per_position * context)
        tpot_ms = round(step / (1 - HEADROOM))
        print(f"decode rates at startup: {base:.1f} ms + {per_seq:.3f} ms a sequence + "
              f"{per_position * 1e3:.2f} µs a KV position; {args.knee} sequences at "
              f"{context} positions: {step:.0f} ms")
    requests = round(args.load * args.knee)
    print(f"TPOT SLO {tpot_ms:g} ms (the horizon's limit {tpot_ms * (1 - HEADROOM):.0f} ms); "
          f"{requests} streams at {args.rate:g}/s ({args.prompt}-token prompts, {args.tokens} "
          f"out); max_num_seqs 256")
    for check in [{"with": True, "without": False}[r] for r in args.runs.split(",")]:
        with engine(check, tpot_ms) as e:
            run = anyio.run(offer, e.endpoint, e.service_key, requests, args)
        label = "with the check   " if check else "without the check"
        knee = f"knee {statistics.median_low(run['knees'])} sequences (reported " \
               f"{min(run['knees'])}-{max(run['knees'])}), " if run["knees"] else ""
        tpot_p99 = pct(run["tpot"], 0.99) * 1e3
        print(f"{label}: {knee}at most {max(run['running'])} running; TPOT p50 "
              f"{statistics.median(run['tpot']) * 1e3:.0f} ms, p99 {tpot_p99:.0f} ms "
              f"({'within' if tpot_p99 <= tpot_ms else 'OVER'} the SLO); gaps p99 "
              f"{pct(run['gaps'], 0.99) * 1e3:.0f} ms; TTFT p50 "
              f"{statistics.median(run['ttft']):.2f} s, max {max(run['ttft']):.2f} s; "
              f"{len(run['tpot'])} done, {len(run['rejected'])} rejected; "
              f"{run['tokens'] / run['wall']:.0f} output tokens/s over {run['wall']:.1f} s")


if __name__ == "__main__":
    main()
