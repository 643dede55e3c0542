"""The streamer's per-class latency and SLO counts: exact outcomes against each objective,
exact buckets, and keys a class name with dots cannot confuse."""
from components.streamer.slo import (
    LATENCY_EDGES_MS,
    TPOT_EDGES_MS,
    Histogram,
    RequestClock,
    SloStats,
    generated_tokens,
)
from schemas.client import ChoiceEnd, Finished, Usage
from schemas.config import ServiceClass

CLASSES = {"interactive": ServiceClass("interactive", ttft_slo_ms=250, tpot_slo_ms=62.5),
           "batch": ServiceClass("batch", tpot_slo_ms=100, may_degrade=True)}


def clock(cls="interactive", first=None, deadline_ms=None, degraded=False):
    c = RequestClock(10.0, deadline_ms, cls, degraded)
    if first is not None:
        c.token(10.0 + first)
        c.token(10.0 + first + 5.0)            # only the first delta counts
    return c


def test_configured_objectives_and_classes_start_at_zero():
    assert SloStats(CLASSES).stats() == {
        "slo.ttft.met.interactive": 0, "slo.ttft.missed.interactive": 0,
        "slo.tpot.met.interactive": 0, "slo.tpot.missed.interactive": 0,
        "slo.tpot.met.batch": 0, "slo.tpot.missed.batch": 0,
        "degraded.interactive": 0, "degraded.batch": 0}


def test_ttft_and_tpot_are_met_or_missed_per_class_objective():
    s = SloStats(CLASSES)
    s.finished(clock(first=0.25), 10.75, tokens=9)               # both exactly at the SLO
    s.finished(clock(first=0.251), 10.251 + 0.063, tokens=2)     # both just over
    s.finished(clock("batch", first=3.0), 13.0 + 0.1, tokens=2)  # batch: no TTFT objective
    out = s.stats()
    assert {k: v for k, v in out.items() if k.startswith("slo.")} == {
        "slo.ttft.met.interactive": 1, "slo.ttft.missed.interactive": 1,
        "slo.tpot.met.interactive": 1, "slo.tpot.missed.interactive": 1,
        "slo.tpot.met.batch": 1, "slo.tpot.missed.batch": 0}
    assert out["ttft_ms.count.interactive"] == 2 and out["ttft_ms.count.batch"] == 1


def test_a_requests_deadline_replaces_its_class_ttft_objective():
    s = SloStats(CLASSES)
    s.finished(clock(first=0.15, deadline_ms=100), 10.15, tokens=1)   # class would meet it
    s.finished(clock("batch", first=0.9, deadline_ms=1000), 10.9, tokens=1)
    out = s.stats()
    assert out["slo.ttft.missed.interactive"] == 1 and out["slo.ttft.met.interactive"] == 0
    assert out["slo.ttft.met.batch"] == 1 and "slo.ttft.missed.batch" not in out


def test_one_token_has_no_tpot_and_no_token_has_no_ttft():
    s = SloStats(CLASSES)
    s.finished(clock(first=0.1), 10.5, tokens=1)
    s.finished(clock(), 10.5, tokens=0)
    out = s.stats()
    assert out["e2e_ms.count.interactive"] == 2
    assert out["ttft_ms.count.interactive"] == 1 and "tpot_ms.count.interactive" not in out
    assert out["slo.tpot.met.interactive"] == out["slo.tpot.missed.interactive"] == 0
    assert out["slo.ttft.met.interactive"] == 1


def test_degraded_counts_by_class_even_unconfigured():
    s = SloStats(CLASSES)
    s.finished(clock("batch", first=0.1, degraded=True), 11.0, tokens=3)
    s.finished(clock("batch", first=0.1), 11.0, tokens=3)
    s.finished(clock("other", first=0.1, degraded=True), 11.0, tokens=3)
    out = s.stats()
    assert (out["degraded.batch"], out["degraded.interactive"], out["degraded.other"]) == (1, 0, 1)
    assert not any(k.endswith(".other") and k.startswith("slo.") for k in out)


def test_buckets_are_cumulative_with_the_edge_inclusive():
    h = Histogram((5, 10, 20))
    for ms in (0.0, 5.0, 5.001, 10.0, 19.0, 25.0, 1e9):
        h.observe(ms)
    assert h.counts == [2, 2, 1, 2]
    assert h.cumulative() == [2, 4, 5] and h.count == 7
    assert h.sum == 0.0 + 5.0 + 5.001 + 10.0 + 19.0 + 25.0 + 1e9


def test_stats_keys_put_the_class_last_and_measure_in_ms():
    s = SloStats({})
    s.finished(clock("a.b", first=0.03), 10.03 + 2 * 0.012, tokens=3)
    out = s.stats()
    assert out["ttft_ms.le.20.a.b"] == 0 and out["ttft_ms.le.40.a.b"] == 1
    assert out["tpot_ms.le.10.a.b"] == 0 and out["tpot_ms.le.15.a.b"] == 1
    assert out["e2e_ms.le.40.a.b"] == 0 and out["e2e_ms.le.60.a.b"] == 1
    assert abs(out["tpot_ms.sum.a.b"] - 12.0) < 1e-6 and out["tpot_ms.count.a.b"] == 1
    assert abs(out["e2e_ms.sum.a.b"] - 54.0) < 1e-6
    assert sum(k.startswith("ttft_ms.le.") for k in out) == len(LATENCY_EDGES_MS)
    assert sum(k.startswith("tpot_ms.le.") for k in out) == len(TPOT_EDGES_MS)
    assert out["degraded.a.b"] == 0


def test_edges_are_whole_milliseconds_in_order():
    for edges in (LATENCY_EDGES_MS, TPOT_EDGES_MS):
        assert all(isinstance(e, int) for e in edges) and list(edges) == sorted(set(edges))


def test_tpot_counts_the_longest_choice():
    many = Finished("r", "length", Usage(3, 12), choices=(ChoiceEnd(0, "length", 5),
                                                           ChoiceEnd(1, "stop", 7)))
    assert generated_tokens(many) == 7
    assert generated_tokens(Finished("r", "stop", Usage(3, 4))) == 4
