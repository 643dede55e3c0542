"""The live replay driver's own bookkeeping: schedule lag, and a run that fell behind its
schedule is marked invalid (its numbers are not printed). The engine-backed replay is in
tests/e2e/test_replay.py; here a target that blocks the event loop makes the client late
on purpose."""
from __future__ import annotations

import time

import anyio

from weir.replay.live import replay
from weir.replay.report import render_table, summarize
from weir.replay.types import Slo, TraceRequest


class BlockingTarget:
    """Answers each request at once with one token, but holds the event loop ``stall_s``."""

    label = "blocking"

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def send(self, item, rec, t0) -> None:
        time.sleep(self.stall_s)                       # the client's own loop falls behind
        rec.ttft_s = rec.e2e_s = time.perf_counter() - t0 - rec.sent_s
        rec.output_tokens = 1

    async def sample(self, t):
        return None


def run(stall_s: float):
    reqs = [TraceRequest(index=i, arrival_s=i * 0.01, input_tokens=4, output_tokens=1)
            for i in range(12)]
    return anyio.run(lambda: replay(reqs, BlockingTarget(stall_s), lambda r: ([1] * 4, ""),
                                    progress=False, max_lag_ms=100, sample_every_s=10))


def test_on_schedule_is_valid():
    result = run(0.0)
    assert result.valid and result.lag_p99_ms < 100
    assert all(r.sent_s >= r.arrival_s for r in result.records)


def test_a_client_behind_its_schedule_is_invalid():
    result = run(0.05)          # 12 requests 10 ms apart, each holding the loop 50 ms
    assert not result.valid
    assert result.lag_p99_ms > 100
    assert "fell behind" in result.invalid_reasons[0]
    table = render_table([summarize(result, {}, Slo(1000, 100))])
    goodput_row = next(line for line in table.splitlines() if line.startswith("goodput"))
    assert goodput_row.split()[-1] == "invalid"


class RecordingTarget(BlockingTarget):
    """Notes the order in which requests reach it."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.order: list[int] = []

    async def send(self, item, rec, t0) -> None:
        self.order.append(rec.index)
        await super().send(item, rec, t0)


def test_requests_of_one_instant_go_out_in_trace_order():
    """A trace's burst (many requests at one arrival time) reaches the engine in the
    trace's order, as the simulator orders it: which prompt the first step takes decides
    the burst's TTFTs. Before, each request slept to its own arrival and the timers of one
    instant fired in no fixed order (a 20-request replay's second burst went out reversed)."""
    reqs = [TraceRequest(index=i, arrival_s=0.02 * (i // 10), input_tokens=4, output_tokens=1)
            for i in range(40)]
    target = RecordingTarget()
    result = anyio.run(lambda: replay(reqs, target, lambda r: ([1] * 4, ""), progress=False,
                                      sample_every_s=10))
    assert target.order == list(range(40))
    assert [r.sent_s for r in result.records] == sorted(r.sent_s for r in result.records)


def test_prometheus_gauges_read_vllm_and_weir_names():
    from weir.replay.live import prometheus_gauges

    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests running",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
        'vllm:kv_cache_usage_perc{engine="0"} 0.25',
        "weir:num_requests_waiting 7",
        "not a metric line",
    ])
    assert prometheus_gauges(text) == {"num_requests_running": 5.0, "kv_cache_usage_perc": 0.25,
                                       "num_requests_waiting": 7.0}
