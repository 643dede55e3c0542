"""The engine-wide request metrics the gateway renders from the streamer's counts: SLO
outcomes and degraded requests by class, and latency histograms of all traffic, read back
through prometheus_client's own parser."""
from prometheus_client.parser import text_string_to_metric_families

from components.gateway.metrics import GatewayMetrics
from components.streamer.slo import LATENCY_EDGES_MS, RequestClock, SloStats
from schemas.config import ServiceClass

CLASSES = {"interactive": ServiceClass("interactive", ttft_slo_ms=250, tpot_slo_ms=62.5),
           "batch": ServiceClass("batch", may_degrade=True)}


def _samples(metrics: GatewayMetrics, name: str) -> dict[tuple, float]:
    return {(s.name, *sorted((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
            for fam in text_string_to_metric_families(metrics.render().decode())
            for s in fam.samples if fam.name == name}


def _engine(streamer: dict[str, float]) -> GatewayMetrics:
    m = GatewayMetrics("m")
    m.engine.stats = {"streamer": streamer}
    return m


def _streamer() -> dict[str, float]:
    s = SloStats(CLASSES)
    first = RequestClock(0.0, None, "interactive")
    first.token(0.25)
    s.finished(first, 0.75, tokens=9)                   # TTFT 250 ms, TPOT 62.5 ms: met
    late = RequestClock(0.0, None, "interactive")
    late.token(0.5)
    s.finished(late, 1.0, tokens=2)                     # 500 ms, 500 ms: missed
    cut = RequestClock(0.0, None, "batch", degraded=True)
    cut.token(2.0)
    s.finished(cut, 2.0, tokens=1)
    return {"requests.finished": 3, "active_requests": 0, **s.stats()}


def test_slo_outcomes_by_class_kind_and_outcome():
    got = _samples(_engine(_streamer()), "weir:slo_requests")
    total = "weir:slo_requests_total"
    assert got == {
        (total, ("class", "interactive"), ("kind", "ttft"), ("outcome", "met")): 1,
        (total, ("class", "interactive"), ("kind", "ttft"), ("outcome", "missed")): 1,
        (total, ("class", "interactive"), ("kind", "tpot"), ("outcome", "met")): 1,
        (total, ("class", "interactive"), ("kind", "tpot"), ("outcome", "missed")): 1}


def test_degraded_requests_by_class():
    got = _samples(_engine(_streamer()), "weir:degraded_requests")
    assert got == {("weir:degraded_requests_total", ("class", "batch")): 1,
                   ("weir:degraded_requests_total", ("class", "interactive")): 0}


def test_request_histograms_cover_every_class_in_seconds():
    m = _engine(_streamer())
    ttft = _samples(m, "weir:request_ttft_seconds")
    b = "weir:request_ttft_seconds_bucket"
    assert ttft[b, ("class", "interactive"), ("le", "0.1")] == 0
    assert ttft[b, ("class", "interactive"), ("le", "0.25")] == 1
    assert ttft[b, ("class", "interactive"), ("le", "0.5")] == 2
    assert ttft[b, ("class", "interactive"), ("le", "+Inf")] == 2
    assert ttft[b, ("class", "batch"), ("le", "1.0")] == 0
    assert ttft[b, ("class", "batch"), ("le", "2.5")] == 1
    assert ttft["weir:request_ttft_seconds_count", ("class", "interactive")] == 2
    assert ttft["weir:request_ttft_seconds_sum", ("class", "interactive")] == 0.75
    assert sum(k[0] == b and k[1] == ("class", "batch") for k in ttft) == len(LATENCY_EDGES_MS) + 1
    tpot = _samples(m, "weir:request_tpot_seconds")
    assert tpot["weir:request_tpot_seconds_count", ("class", "interactive")] == 2
    assert tpot["weir:request_tpot_seconds_bucket", ("class", "interactive"), ("le", "0.075")] == 1
    assert ("weir:request_tpot_seconds_count", ("class", "batch")) not in tpot   # one token
    e2e = _samples(m, "weir:request_e2e_seconds")
    assert e2e["weir:request_e2e_seconds_count", ("class", "batch")] == 1
    assert e2e["weir:request_e2e_seconds_sum", ("class", "interactive")] == 1.75


def test_a_class_name_with_dots_keeps_its_dots():
    s = SloStats({"tier.1": ServiceClass("tier.1", ttft_slo_ms=100)})
    c = RequestClock(0.0, None, "tier.1", degraded=True)
    c.token(0.05)
    s.finished(c, 0.1, tokens=2)
    m = _engine(s.stats())
    assert _samples(m, "weir:slo_requests")[
        "weir:slo_requests_total", ("class", "tier.1"), ("kind", "ttft"), ("outcome", "met")] == 1
    assert _samples(m, "weir:degraded_requests") == {
        ("weir:degraded_requests_total", ("class", "tier.1")): 1}
    assert _samples(m, "weir:request_e2e_seconds")[
        "weir:request_e2e_seconds_bucket", ("class", "tier.1"), ("le", "0.1")] == 1


def test_no_streamer_report_renders_empty_families():
    m = GatewayMetrics("m")
    for name in ("weir:slo_requests", "weir:degraded_requests", "weir:request_ttft_seconds",
                 "weir:request_tpot_seconds", "weir:request_e2e_seconds"):
        assert _samples(m, name) == {}
    assert b"# TYPE weir:request_ttft_seconds histogram" in m.render()


def test_the_gateway_histograms_say_they_are_http_only():
    text = GatewayMetrics("m").render().decode()
    assert ("# HELP weir:time_to_first_token_seconds Time to first token of HTTP requests "
            "only") in text
    assert "(all traffic: weir:request_e2e_seconds)" in text


def test_a_gateway_in_front_of_a_router_exports_its_decisions_by_reason():
    m = GatewayMetrics("m")
    m.engine.stats = {"router": {
        "requests.reason.prefix": 7, "requests.reason.load": 3, "requests.rerouted": 2,
        "replica.r0.healthy": 1, "replica.r0.lost": 0, "replica.r0.rerouted.overloaded": 2,
        "replica.r1.healthy": 0, "replica.r1.lost": 1, "replica.r1.index_gaps": 4}}
    assert _samples(m, "weir:router_decisions") == {
        ("weir:router_decisions_total", ("reason", "load")): 3.0,
        ("weir:router_decisions_total", ("reason", "prefix")): 7.0}
    assert _samples(m, "weir:router_reroutes") == {
        ("weir:router_reroutes_total", ("reason", "overloaded"), ("replica", "r0")): 2.0}
    assert _samples(m, "weir:router_replica_healthy") == {
        ("weir:router_replica_healthy", ("replica", "r0")): 1.0,
        ("weir:router_replica_healthy", ("replica", "r1")): 0.0}
    assert _samples(m, "weir:router_replica_lost") == {
        ("weir:router_replica_lost_total", ("replica", "r0")): 0.0,
        ("weir:router_replica_lost_total", ("replica", "r1")): 1.0}


def test_an_engine_behind_no_router_exports_no_router_families():
    assert _samples(_engine({}), "weir:router_decisions") == {}
