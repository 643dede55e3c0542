"""The engine-wide request metrics the gateway renders from the streamer's counts: SLO
outcomes, goodput and degraded requests by class, and latency histograms of all traffic, read
back through prometheus_client's own parser."""
from prometheus_client.parser import text_string_to_metric_families

from components.gateway.metrics import GatewayMetrics
from components.streamer.slo import LATENCY_EDGES_MS, MISSED, RequestClock, SloStats
from schemas.client import Accepted, Cancelled, Finished, Rejected, RequestTiming, Usage
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
    s.ended(first, Finished("a", "stop", Usage(3, 9)), 0.75)   # TTFT 250, TPOT 62.5 ms: met
    late = RequestClock(0.0, None, "interactive")
    late.token(0.5)
    s.ended(late, Finished("b", "stop", Usage(3, 2)), 1.0)     # 500 ms, 500 ms: missed
    cut = RequestClock(0.0, None, "batch", degraded=True)
    cut.token(2.0)
    s.ended(cut, Finished("c", "length", Usage(3, 1)), 2.0)
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
    s.ended(c, Finished("d", "stop", Usage(3, 2)), 0.1)
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


def test_goodput_and_misses_by_class_and_reason_add_up_to_every_request_that_ended():
    s = SloStats(CLASSES)
    # first token at, finished at, tokens: met; both late (500 ms TTFT and TPOT); batch met
    for cls, first, end, tokens in (("interactive", 0.25, 0.25, 9), ("interactive", 0.5, 1.0, 2),
                                    ("batch", 2.0, 2.05, 2)):
        c = RequestClock(0.0, None, cls)
        c.token(first)
        s.ended(c, Finished("r", "stop", Usage(3, tokens)), end)
    for event in (Rejected("e", "overloaded", "", 1.0), Rejected("f", "deadline_expired", ""),
                  Cancelled("g", "client"), Rejected("h", "invalid_request", "")):
        s.ended(RequestClock(0.0, None, "interactive"), event, 0.1)
    m = _engine(s.stats())
    good = _samples(m, "weir:goodput_requests")
    assert good == {("weir:goodput_requests_total", ("class", "batch")): 1,
                    ("weir:goodput_requests_total", ("class", "interactive")): 1}
    assert _samples(m, "weir:goodput_tokens") == {
        ("weir:goodput_tokens_total", ("class", "batch")): 2,
        ("weir:goodput_tokens_total", ("class", "interactive")): 9}
    missed = _samples(m, "weir:slo_missed_requests")
    assert len(missed) == 2 * len(MISSED)              # every class and reason from the start
    assert {k[2][1]: v for k, v in missed.items() if v and k[1] == ("class", "interactive")} \
        == {"both": 1, "rejected": 1, "expired": 1, "cancelled": 1}
    assert not any(v for k, v in missed.items() if k[1] == ("class", "batch"))
    assert _samples(m, "weir:slo_missed_tokens") == {
        ("weir:slo_missed_tokens_total", ("class", "batch")): 0,
        ("weir:slo_missed_tokens_total", ("class", "interactive")): 2}
    # the invalid request is in neither: 6 of the 7 that ended are counted, each once
    assert sum(good.values()) + sum(missed.values()) == 6


def test_queue_prefill_decode_itl_and_admission_queue_histograms_by_class_in_seconds():
    s = SloStats(CLASSES)
    c = RequestClock(0.0, None)
    s.accepted(c, Accepted("a", 3, service_class="batch", queued_s=0.07))
    for t in (0.3, 0.317, 0.336):                    # gaps of 17 and 19 ms
        c.token(t)
    s.ended(c, Finished("a", "stop", Usage(3, 3),
                        timing=RequestTiming(queue_s=0.09, prefill_s=0.2, decode_s=0.03)), 0.336)
    m = _engine(s.stats())
    for kind, le_below, le_at, total in (("queue", "0.08", "0.1", 0.09),
                                         ("admission_queue", "0.06", "0.08", 0.07),
                                         ("prefill", "0.1", "0.25", 0.2),
                                         ("decode", "0.02", "0.04", 0.03),
                                         ("itl", "0.015", "0.02", 0.036)):
        name = f"weir:request_{kind}_seconds"
        got = _samples(m, name)
        cls = ("class", "batch")
        assert got[f"{name}_bucket", cls, ("le", le_below)] == 0, kind
        assert got[f"{name}_bucket", cls, ("le", le_at)] == (2 if kind == "itl" else 1), kind
        assert got[f"{name}_count", cls] == (2 if kind == "itl" else 1), kind
        assert abs(got[f"{name}_sum", cls] - total) < 1e-9, kind
        assert not any(k[1] == ("class", "interactive") for k in got)


def test_each_http_only_histogram_names_its_all_traffic_twin():
    text = GatewayMetrics("m").render().decode()
    for http, every in (("inter_token_latency_seconds", "request_itl_seconds"),
                        ("request_queue_time_seconds", "request_queue_seconds"),
                        ("request_prefill_time_seconds", "request_prefill_seconds"),
                        ("request_decode_time_seconds", "request_decode_seconds")):
        help_line = next(line for line in text.splitlines()
                         if line.startswith(f"# HELP weir:{http} "))
        assert "HTTP requests only" in help_line and f"(all traffic: weir:{every})" in help_line
        assert f"# TYPE weir:{every} histogram" in text
    assert "# HELP weir:request_queue_seconds " in text and \
        "All traffic, SDK and HTTP." in next(line for line in text.splitlines()
                                            if line.startswith("# HELP weir:request_queue_seconds"))


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


def test_a_gateway_in_front_of_a_router_exports_its_fleet_queue():
    m = GatewayMetrics("m")
    m.engine.stats = {"router": {
        "fleetq.depth": 3, "fleetq.depth.acme": 1, "fleetq.depth.flood": 2,
        "fleetq.counter.acme": 40.0, "fleetq.counter.flood": 900.0,
        "fleetq.wait_ms.p50": 250.0, "fleetq.wait_ms.p99": 1500.0, "fleetq.oldest_ms": 9.0,
        "fleetq.held": 12, "fleetq.released": 8, "fleetq.refused.expiring": 1}}
    assert _samples(m, "weir:router_fleet_queue_depth") == {
        ("weir:router_fleet_queue_depth", ("tenant", "acme")): 1.0,
        ("weir:router_fleet_queue_depth", ("tenant", "flood")): 2.0}
    assert _samples(m, "weir:router_fleet_virtual_counter") == {
        ("weir:router_fleet_virtual_counter", ("tenant", "acme")): 40.0,
        ("weir:router_fleet_virtual_counter", ("tenant", "flood")): 900.0}
    assert _samples(m, "weir:router_fleet_queue_wait_seconds") == {
        ("weir:router_fleet_queue_wait_seconds", ("quantile", "0.5")): 0.25,
        ("weir:router_fleet_queue_wait_seconds", ("quantile", "0.99")): 1.5}
    assert _samples(m, "weir:router_fleet_queue_events") == {
        ("weir:router_fleet_queue_events_total", ("event", "held")): 12.0,
        ("weir:router_fleet_queue_events_total", ("event", "refused.expiring")): 1.0,
        ("weir:router_fleet_queue_events_total", ("event", "released")): 8.0}


def test_an_engine_behind_no_router_exports_no_router_families():
    assert _samples(_engine({}), "weir:router_decisions") == {}


def _spec_engine() -> GatewayMetrics:
    """Speculation's counts as the scheduler reports them (``SchedulerCore.spec_stats``):
    two interactive verifies (4 drafted, 3 accepted; 2 drafted, 2 accepted), one batch
    verify (2 drafted, 0 accepted), planned rows at k 0, 2 and 4, steps without drafts."""
    from types import SimpleNamespace

    from components.scheduler.core import SchedulerCore
    from components.scheduler.speculation import Speculation
    from schemas.config import SpeculativeConfig

    spec = Speculation(SpeculativeConfig(method="ngram", max_k=4))
    for cls, drafted, accepted in (("interactive", 4, 3), ("interactive", 2, 2),
                                   ("tier.1", 2, 0)):
        seq = SimpleNamespace(service_class=cls, spec_idle=0, spec_hits=0, spec_misses=0)
        spec.verified(seq, drafted, accepted)
    spec.stats.k_hist.update({0: 5, 2: 2, 4: 1})
    spec.stats.reasons.update({"no_gain": 3, "budget": 1})
    m = GatewayMetrics("m")
    m.engine.stats = {"scheduler": {"running": 1, **SchedulerCore.spec_stats(
        SimpleNamespace(spec=spec))}, "executor": {"spec.draft_s": 0.25}}
    return m


def test_speculation_counters_by_class_and_reason():
    m = _spec_engine()
    assert _samples(m, "weir:spec_draft_tokens") == {
        ("weir:spec_draft_tokens_total", ("class", "interactive")): 6,
        ("weir:spec_draft_tokens_total", ("class", "tier.1")): 2}
    assert _samples(m, "weir:spec_accepted_tokens") == {
        ("weir:spec_accepted_tokens_total", ("class", "interactive")): 5,
        ("weir:spec_accepted_tokens_total", ("class", "tier.1")): 0}
    assert _samples(m, "weir:spec_verifies") == {("weir:spec_verifies_total",): 3}
    # each verify emits its accepted drafts and the target's own token: 4 + 3 + 1
    assert _samples(m, "weir:spec_emitted_tokens") == {("weir:spec_emitted_tokens_total",): 8}
    assert _samples(m, "weir:spec_skipped_steps") == {
        ("weir:spec_skipped_steps_total", ("reason", "budget")): 1,
        ("weir:spec_skipped_steps_total", ("reason", "no_gain")): 3}
    assert _samples(m, "weir:spec_draft_seconds") == {("weir:spec_draft_seconds_total",): 0.25}


def test_speculation_k_is_a_cumulative_histogram_of_planned_rows():
    k = _samples(_spec_engine(), "weir:spec_k")
    b = "weir:spec_k_bucket"
    assert [k[b, ("le", le)] for le in ("0", "1", "2", "3", "4", "16", "+Inf")] \
        == [5, 5, 7, 7, 8, 8, 8]
    assert k["weir:spec_k_count",] == 8
    assert k["weir:spec_k_sum",] == 2 * 2 + 4


def test_speculation_help_names_the_vllm_equivalents_and_off_renders_empty():
    text = _spec_engine().render().decode()
    for theirs in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                   "vllm:spec_decode_num_drafts"):
        assert theirs in text
    off = GatewayMetrics("m")
    off.engine.stats = {"scheduler": {"running": 0}}
    for name in ("weir:spec_draft_tokens", "weir:spec_accepted_tokens", "weir:spec_k",
                 "weir:spec_skipped_steps"):
        assert _samples(off, name) == {}
    assert _samples(off, "weir:spec_verifies") == {("weir:spec_verifies_total",): 0}
    assert b"# TYPE weir:spec_k histogram" in off.render()


def test_a_gateway_in_front_of_a_router_exports_the_autoscaling_signals():
    """Per replica (label replica) and fleet-wide, as the router computes them
    (components/router/signals.py): the families an HPA reads through the adapter."""
    m = GatewayMetrics("m")
    m.engine.stats = {"router": {
        "signal/weir-replica-0/queue_s": 1.5, "signal/weir-replica-0/kv_used": 0.25,
        "signal/weir-replica-0/kv_total_blocks": 100,
        "signal/weir-replica-0/prefill_backlog_tokens": 3000,
        "signal/weir-replica-0/decode_backlog_tokens": 9000,
        "signal/weir-replica-0/load_rejections": 4,
        "signal/weir-replica-0/headroom/interactive": 0.5,
        "signal/weir-replica-0/headroom/tier.1": 0.9,
        "fleet/replicas": 1, "fleet/queue_s": 1.5, "fleet/kv_used": 0.25,
        "fleet/prefill_backlog_tokens": 3000, "fleet/decode_backlog_tokens": 9000,
        "fleet/load_rejections": 2, "fleet/headroom/interactive": 0.5,
        "fleet/headroom/tier.1": 0.9}}
    r0 = ("replica", "weir-replica-0")
    assert _samples(m, "weir:replica_predicted_queue_seconds") == {
        ("weir:replica_predicted_queue_seconds", r0): 1.5}
    assert _samples(m, "weir:replica_slo_headroom_ratio") == {
        ("weir:replica_slo_headroom_ratio", ("class", "interactive"), r0): 0.5,
        ("weir:replica_slo_headroom_ratio", ("class", "tier.1"), r0): 0.9}
    assert _samples(m, "weir:replica_kv_pressure_ratio") == {
        ("weir:replica_kv_pressure_ratio", r0): 0.25}
    assert _samples(m, "weir:replica_prefill_backlog_tokens") == {
        ("weir:replica_prefill_backlog_tokens", r0): 3000}
    assert _samples(m, "weir:replica_decode_backlog_tokens") == {
        ("weir:replica_decode_backlog_tokens", r0): 9000}
    assert _samples(m, "weir:replica_load_rejections") == {
        ("weir:replica_load_rejections_total", r0): 4}
    assert _samples(m, "weir:predicted_queue_seconds") == {
        ("weir:predicted_queue_seconds",): 1.5}
    assert _samples(m, "weir:slo_headroom_ratio") == {
        ("weir:slo_headroom_ratio", ("class", "interactive")): 0.5,
        ("weir:slo_headroom_ratio", ("class", "tier.1")): 0.9}
    assert _samples(m, "weir:kv_pressure_ratio") == {("weir:kv_pressure_ratio",): 0.25}
    assert _samples(m, "weir:prefill_backlog_tokens") == {
        ("weir:prefill_backlog_tokens",): 3000}
    assert _samples(m, "weir:decode_backlog_tokens") == {("weir:decode_backlog_tokens",): 9000}
    assert _samples(m, "weir:load_rejections") == {("weir:load_rejections_total",): 2}
    assert _samples(m, "weir:serving_replicas") == {("weir:serving_replicas",): 1}
    text = m.render().decode()
    assert "# TYPE weir:load_rejections_total counter" in text
    assert 'weir:replica_slo_headroom_ratio{class="interactive",model_name="m",' \
           'replica="weir-replica-0"} 0.5' in text

