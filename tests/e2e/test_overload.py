"""Overload, live, as a new user meets it: ``weir serve`` with no config (the SLO-first
defaults: policy "deadline", the default class ``interactive``, TTFT 3 s, TPOT 300 ms,
never queued, late work dropped: ``schemas.config.SLO_CLASSES``), driven over the
OpenAI-compatible HTTP gateway with streamed completions, scaled to this CPU.

1. Capacity: the rate of completions within the SLO when far more is offered.
2. At capacity for 10 s: the SLO-meeting completions per second (goodput).
3. At 3x capacity for 30 s: refusals (429/503 with Retry-After) return fast (p99 < 50
   ms); at least 95% of the accepted requests meet their TTFT SLO, and at least 90% in
   every 4-second window by send time (misses that cluster in time are the second seed's
   oscillation); goodput is at least 80% of goodput at capacity. A request the engine
   accepted and then dropped for its deadline (a 503 ``deadline_expired``: the interactive
   class never queues, so only a late drop ends so) counts as accepted and missed.
4. After the burst, TTFT is back to normal within 5 s.

What made 3 hold: the TTFT prediction counts what admission let in since the scheduler's
last report, and adds a bias learned from observed TTFTs. Before the bias only 54-60% of the
accepted met the SLO: on two cores most of a request's wait at 3x is in the processes before
the scheduler, which the backlog model cannot see."""
from __future__ import annotations

import json
import math
import random
import statistics
import time
import warnings

import anyio
import httpx
import pytest

from schemas.config import SLO_CLASSES
from tests.e2e.conftest import GATEWAY_MODEL, free_port
from tests.e2e.engine import Engine

INTERACTIVE = SLO_CLASSES[0]                 # the default class of a config that names none
SLO_MS = INTERACTIVE.ttft_slo_ms
WINDOW_S = 4.0
PROMPT, OUTPUT = 96, 8


class RetriedScenario(UserWarning):
    """The first attempt broke a condition and the scenario ran again (the warnings summary
    shows it, with the first attempt's report, even where the retry passed)."""


def default_engine(run_dir) -> Engine:
    """``weir serve`` as shipped: no config beyond the gateway's port."""
    return Engine(run_dir, "", http_port=free_port())


@pytest.fixture(scope="module")
def engine(tmp_path_factory, model_path):
    e = default_engine(tmp_path_factory.mktemp("overload"))
    yield e
    e.stop()


class Phase:
    def __init__(self) -> None:
        self.ttft: list[float] = []          # accepted: seconds (inf: dropped late)
        self.rejected: list[float] = []      # seconds to the refusal
        self.reasons: list[str] = []
        self.no_retry_after: int = 0         # refusals without a Retry-After header
        self.missed: list[tuple[float, float]] = []   # (sent, after the phase's start; TTFT)
        self.sent: list[float] = []          # accepted: sent at, in the phase
        self.dropped = 0                     # accepted, then ended deadline_expired
        self.views: dict[str, float | None] = {}   # the engine's own mean TTFTs (ttft_sums)

    @property
    def met(self) -> int:
        """Accepted and answered within the SLO."""
        return len(self.ttft) - len(self.missed)

    def worst_window(self, seconds: float) -> tuple[float, int]:
        """The lowest share of the accepted that met the SLO in any ``seconds``-long window
        of send times (and how many were accepted in it)."""
        windows: dict[int, list[bool]] = {}
        for sent, ttft in zip(self.sent, self.ttft):
            windows.setdefault(int(sent // seconds), []).append(ttft * 1e3 <= SLO_MS)
        return min(((sum(w) / len(w), len(w)) for w in windows.values()), default=(1.0, 0))


async def first_token(http: httpx.AsyncClient, ids: list[int]) -> tuple[int, str, bool, float]:
    """Send one streamed completion: the status, the refusal's code (or ""), whether a
    refusal carried Retry-After, and the seconds to its first text chunk (or to its
    refusal). The rest of the stream is read to its end, as a client would, after the
    time is taken."""
    body = {"model": GATEWAY_MODEL, "prompt": ids, "max_tokens": OUTPUT, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            err = json.loads(await r.aread()).get("error", {})
            return r.status_code, str(err.get("code") or err.get("type")), \
                "retry-after" in r.headers, time.perf_counter() - t0
        took, code = math.inf, ""
        lines = r.aiter_lines()
        async for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                took = time.perf_counter() - t0
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    code = str(chunk["error"].get("code"))
                break
        async for _ in lines:
            pass
        return 200, code, False, took


async def offer(http: httpx.AsyncClient, rate: float, seconds: float, seed: int) -> Phase:
    """Open loop at ``rate`` requests/s for ``seconds``."""
    phase, rng = Phase(), random.Random(seed)

    async def one(i: int) -> None:
        ids = [rng.randrange(1000, 40000) for _ in range(PROMPT)]
        t0 = time.perf_counter()
        status, code, retry_after, took = await first_token(http, ids)
        if status != 200 or code:
            if code == "deadline_expired":       # admitted, then dropped past its deadline
                phase.dropped += 1
                took = float("inf")
            else:
                assert status in (429, 503), (status, code)
                phase.rejected.append(took)
                phase.reasons.append(code)
                phase.no_retry_after += not retry_after
                return
        phase.ttft.append(took)
        phase.sent.append(t0 - start)
        if took * 1e3 > SLO_MS:
            phase.missed.append((round(t0 - start, 2), round(took, 2)))

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(int(rate * seconds)):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await anyio.sleep(delay)
            tg.start_soon(one, i)
    return phase


async def ttft_sums(http: httpx.AsyncClient) -> dict[str, tuple[float, float]]:
    """(count, sum) of the engine's TTFT histograms: the streamer's, from the engine's
    arrival to the first token it sent (weir:request_ttft_seconds), and the gateway's, from
    its handler's start to the first event (weir:time_to_first_token_seconds). Beside the
    client's TTFT they say where an accepted request's time went."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    text = (await http.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name in ("weir:request_ttft_seconds", "weir:time_to_first_token_seconds"):
            count = sum(x.value for x in family.samples if x.name.endswith("_count"))
            total = sum(x.value for x in family.samples if x.name.endswith("_sum"))
            out[family.name] = (count, total)
    return out


def mean_between(before: dict, after: dict, name: str) -> float | None:
    (c0, s0), (c1, s1) = before.get(name, (0, 0)), after.get(name, (0, 0))
    return (s1 - s0) / (c1 - c0) if c1 > c0 else None


def p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * 0.99))]


async def scenario(c) -> tuple[float, Phase, Phase, float, float | None]:
    """Capacity under a flood, 10 s at capacity, 30 s at 3x, then probe until normal."""
    await offer(c, 4.0, 3.0, 0)                                 # warm up, and rates
    flood = await offer(c, 40.0, 6.0, 1)                        # far past capacity
    capacity = flood.met / 6.0                # SLO-meeting completions/s it sustains
    await anyio.sleep(3.0)
    at_capacity = await offer(c, capacity, 10.0, 2)
    await anyio.sleep(3.0)
    baseline = statistics.median(at_capacity.ttft)
    before = await ttft_sums(c)
    burst = await offer(c, 3 * capacity, 30.0, 3)
    after = await ttft_sums(c)
    burst.views = {name.split(":")[1]: mean_between(before, after, name) for name in after}
    recovered_after = None
    end = time.perf_counter()
    while time.perf_counter() - end < 10.0:                     # probe until normal
        t0 = time.perf_counter()
        status, code, _, took = await first_token(c, [1000 + i for i in range(PROMPT)])
        if status == 200 and not code and took <= 1.5 * baseline + 0.1:
            recovered_after = t0 - end
            break
        await anyio.sleep(0.25)
    return capacity, at_capacity, burst, baseline, recovered_after


def judge(capacity: float, at_cap: Phase, burst: Phase, baseline: float,
          recovered: float | None) -> tuple[str, list[str]]:
    """The run's report, and which of the issue's conditions it broke."""
    report = (f"capacity {capacity:.2f} req/s; at capacity: {len(at_cap.ttft)} done, "
              f"{at_cap.met} met, {len(at_cap.rejected)} rejected; 3x: {len(burst.ttft)} done, "
              f"{burst.met} met, {len(burst.rejected)} rejected "
              f"(p99 {p99(burst.rejected) * 1e3 if burst.rejected else 0:.1f} ms, "
              f"{sorted(set(burst.reasons))}); baseline TTFT {baseline * 1e3:.0f} ms; "
              f"recovered after {recovered}; missed at 3x (sent s, TTFT s): {burst.missed}; "
              f"worst {WINDOW_S:g} s window at 3x {burst.worst_window(WINDOW_S)}; "
              f"3x TTFT p50 {statistics.median(burst.ttft) if burst.ttft else 0:.3f} s; "
              f"dropped late at 3x {burst.dropped}; refusals without Retry-After "
              f"{burst.no_retry_after}; 3x mean TTFT client "
              f"{statistics.mean(t for t in burst.ttft if t < math.inf) if burst.ttft else 0:.3f}"
              f" s, engine's views {burst.views}")
    checks = {
        "capacity > 0.5 req/s": capacity > 0.5,
        "the burst is refused in part": bool(burst.rejected),
        "rejections return in < 50 ms (p99)": bool(burst.rejected)
        and p99(burst.rejected) < 0.050,
        "at capacity >= 95% meet the SLO": at_cap.met >= 0.95 * len(at_cap.ttft),
        "at 3x >= 95% of the accepted meet the SLO": burst.met >= 0.95 * len(burst.ttft),
        "at 3x >= 90% in every 4 s window": burst.worst_window(WINDOW_S)[0] >= 0.90,
        "every refusal carries Retry-After": burst.no_retry_after == 0,

        "goodput at 3x >= 80% of it at capacity": burst.met / 30.0 >= 0.8 * at_cap.met / 10.0,
        "TTFT normal within 5 s after": recovered is not None and recovered <= 5.0,
    }
    return report, [name for name, ok in checks.items() if not ok]


def test_overload_at_3x_capacity(engine, tmp_path_factory):
    """Runs the scenario a second time, and only then fails, when the first run breaks a
    condition: the conditions are about SLOs on a live engine, and a CI machine shared with
    other jobs can halve this engine's speed for seconds without warning (CI's one failure
    here: 83 of 89 met; here, with a process busy 0.3-2 s of every 1-5 s beside it, 50 of 57
    met, the misses in pairs at the noise's bursts). What the policy promises is for the
    machine it measured; two noisy 60 s windows in a row fail the test. Both reports print.

    The second run gets a fresh engine, and the first stops before it starts (stop is
    idempotent; the fixture's is then a no-op): a second flood on the engine that saw the 3x
    burst measured a third of the first's capacity (2.83 against 12.67 req/s), and 3x of that
    was no overload. A fresh engine is a fresh draw, not a cure: the flood's estimate is noisy
    (met/6 s on nine floods, three fresh engines: 7.7-15.2 req/s; one fresh second run also
    drew 2.83; at 14.83 the 10 s at "capacity" was overload, 87 of 102 met)."""
    async def attempt_on(eng):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=eng.base_url, timeout=120,
                                     limits=limits) as c:
            return judge(*await scenario(c))

    report, broken = anyio.run(attempt_on, engine)
    print(f"attempt 1: {report}")
    if broken:
        # a passing retry prints nothing under -q: say why it ran
        warnings.warn(f"overload attempt 1 broke: {'; '.join(broken)}: {report}",
                      RetriedScenario, stacklevel=1)
        engine.stop()                # its processes would share the two cores with the next
        fresh = default_engine(tmp_path_factory.mktemp("overload-again"))
        try:
            report, broken = anyio.run(attempt_on, fresh)
        finally:
            fresh.stop()
        print(f"attempt 2: {report}")
    assert not broken, f"{'; '.join(broken)}: {report}"
