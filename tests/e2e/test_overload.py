"""Overload, live, scaled to this CPU (policy "deadline", one interactive class).

1. Capacity: the rate of completions within the SLO when far more is offered.
2. At capacity for 10 s: the SLO-meeting completions per second (goodput).
3. At 3x capacity for 30 s: rejections return fast (p99 < 50 ms), at least 95% of the
   accepted requests meet their TTFT SLO, and goodput is at least 80% of goodput at capacity.
4. After the burst, TTFT is back to normal within 5 s.

What made 3 hold: the TTFT prediction counts what admission let in since the scheduler's
last report, and adds a bias learned from observed TTFTs. Before the bias only 54-60% of the
accepted met the SLO: on two cores most of a request's wait at 3x is in the processes before
the scheduler, which the backlog model cannot see."""
from __future__ import annotations

import random
import statistics
import time

import anyio
import pytest

from tests.e2e.engine import Engine
from weir.errors import RequestRejected

pytestmark = pytest.mark.slow

SLO_MS = 2000
CONFIG = f"""
[engine]
max_model_len = 1024
[admission]
policy = "deadline"
classes = [{{ name = "interactive", priority = 0, ttft_slo_ms = {SLO_MS}, tpot_slo_ms = 1000 }}]
"""
PROMPT, OUTPUT = 96, 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory, model_path):
    e = Engine(tmp_path_factory.mktemp("overload"), CONFIG)
    yield e
    e.stop()


class Phase:
    def __init__(self) -> None:
        self.ttft: list[float] = []          # accepted and completed: seconds
        self.rejected: list[float] = []      # seconds to the rejection
        self.reasons: list[str] = []
        self.met = 0
        self.engine: list[float] = []        # the engine's own arrival → first token


async def offer(c, rate: float, seconds: float, seed: int) -> Phase:
    """Open loop at ``rate`` requests/s for ``seconds``."""
    phase, rng = Phase(), random.Random(seed)

    async def one(i: int) -> None:
        ids = [rng.randrange(1000, 40000) for _ in range(PROMPT)]
        t0 = time.perf_counter()
        try:
            r = await c.generate(prompt_token_ids=ids, max_tokens=OUTPUT, ignore_eos=True,
                                 temperature=0.0)
        except RequestRejected as err:
            phase.rejected.append(time.perf_counter() - t0)
            phase.reasons.append(err.reason)
            return
        phase.ttft.append(r.ttft_ms / 1e3)
        phase.met += r.ttft_ms <= SLO_MS
        if r.timing is not None:
            phase.engine.append(r.timing.queue_s + r.timing.prefill_s)

    async with anyio.create_task_group() as tg:
        start = time.perf_counter()
        for i in range(int(rate * seconds)):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await anyio.sleep(delay)
            tg.start_soon(one, i)
    return phase


def p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * 0.99))]


def test_overload_at_3x_capacity(engine):
    async def main():
        async with engine.async_client(max_retries=0) as c:
            await offer(c, 4.0, 3.0, 0)                                 # warm up, and rates
            flood = await offer(c, 40.0, 6.0, 1)                         # far past capacity
            capacity = flood.met / 6.0            # SLO-meeting completions/s it sustains
            await anyio.sleep(3.0)
            at_capacity = await offer(c, capacity, 10.0, 2)
            await anyio.sleep(3.0)
            baseline = statistics.median(at_capacity.ttft)
            burst = await offer(c, 3 * capacity, 30.0, 3)
            recovered_after = None
            end = time.perf_counter()
            while time.perf_counter() - end < 10.0:                     # probe until normal
                t0 = time.perf_counter()
                r = await c.generate(prompt_token_ids=[1000 + i for i in range(PROMPT)],
                                     max_tokens=OUTPUT, ignore_eos=True, temperature=0.0)
                if r.ttft_ms / 1e3 <= 1.5 * baseline + 0.1:
                    recovered_after = t0 - end
                    break
                await anyio.sleep(0.25)
            return capacity, at_capacity, burst, baseline, recovered_after

    capacity, at_cap, burst, baseline, recovered = anyio.run(main)
    report = (f"capacity {capacity:.2f} req/s; at capacity: {len(at_cap.ttft)} done, "
              f"{at_cap.met} met, {len(at_cap.rejected)} rejected; 3x: {len(burst.ttft)} done, "
              f"{burst.met} met, {len(burst.rejected)} rejected "
              f"(p99 {p99(burst.rejected) * 1e3 if burst.rejected else 0:.1f} ms, "
              f"{sorted(set(burst.reasons))}); baseline TTFT {baseline * 1e3:.0f} ms; "
              f"recovered after {recovered}")
    print(report)
    print(f"3x TTFT p50 {statistics.median(burst.ttft):.3f} s (engine's own "
          f"{statistics.median(burst.engine):.3f} s)")
    assert capacity > 0.5, report
    assert burst.rejected, report
    assert p99(burst.rejected) < 0.050, report
    assert at_cap.met >= 0.95 * len(at_cap.ttft), report     # at capacity the SLO holds
    assert burst.met >= 0.95 * len(burst.ttft), report
    assert burst.met / 30.0 >= 0.8 * at_cap.met / 10.0, report
    assert recovered is not None and recovered <= 5.0, report
