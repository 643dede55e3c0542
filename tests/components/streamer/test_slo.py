"""The streamer's per-class latency, SLO and goodput counts: exact outcomes against each
objective, every way a request ends counted once, exact buckets, and keys a class name with
dots cannot confuse."""
from components.streamer.slo import (
    LATENCY_EDGES_MS,
    MISSED,
    TPOT_EDGES_MS,
    Histogram,
    RequestClock,
    SloStats,
    generated_tokens,
)
from schemas.client import (
    STRUCTURED_OUTPUT_ERROR,
    Accepted,
    Cancelled,
    ChoiceEnd,
    Failed,
    Finished,
    Rejected,
    RequestTiming,
    Usage,
)
from schemas.config import AdmissionConfig, ServiceClass, TenantConfig
from schemas.resolve import resolve

CLASSES = {"interactive": ServiceClass("interactive", ttft_slo_ms=250, tpot_slo_ms=62.5),
           "batch": ServiceClass("batch", tpot_slo_ms=100, may_degrade=True)}


def clock(cls="interactive", first=None, deadline_ms=None, degraded=False):
    c = RequestClock(10.0, deadline_ms, cls, degraded)
    if first is not None:
        c.token(10.0 + first)
        c.token(10.0 + first + 5.0)            # only the first delta counts
    return c


def done(tokens, timing=None, choices=()):
    return Finished("r", "stop", Usage(3, tokens), timing=timing, choices=choices)


def test_configured_objectives_and_classes_start_at_zero():
    goodput = {f"goodput.{k}.{c}": 0 for c in CLASSES
               for k in ("requests", "tokens", "missed_tokens", *(f"missed.{w}" for w in MISSED))}
    assert SloStats(CLASSES).stats() == {
        "slo.ttft.met.interactive": 0, "slo.ttft.missed.interactive": 0,
        "slo.tpot.met.interactive": 0, "slo.tpot.missed.interactive": 0,
        "slo.tpot.met.batch": 0, "slo.tpot.missed.batch": 0,
        "degraded.interactive": 0, "degraded.batch": 0, **goodput}
    assert len(goodput) == 2 * 11


def test_ttft_and_tpot_are_met_or_missed_per_class_objective():
    s = SloStats(CLASSES)
    s.ended(clock(first=0.25), done(9), 10.75)               # both exactly at the SLO
    s.ended(clock(first=0.251), done(2), 10.251 + 0.063)     # both just over
    s.ended(clock("batch", first=3.0), done(2), 13.0 + 0.1)  # batch: no TTFT objective
    out = s.stats()
    assert {k: v for k, v in out.items() if k.startswith("slo.")} == {
        "slo.ttft.met.interactive": 1, "slo.ttft.missed.interactive": 1,
        "slo.tpot.met.interactive": 1, "slo.tpot.missed.interactive": 1,
        "slo.tpot.met.batch": 1, "slo.tpot.missed.batch": 0}
    assert out["ttft_ms.count.interactive"] == 2 and out["ttft_ms.count.batch"] == 1


def test_a_requests_deadline_replaces_its_class_ttft_objective():
    s = SloStats(CLASSES)
    s.ended(clock(first=0.15, deadline_ms=100), done(1), 10.15)   # class would meet it
    s.ended(clock("batch", first=0.9, deadline_ms=1000), done(1), 10.9)
    out = s.stats()
    assert out["slo.ttft.missed.interactive"] == 1 and out["slo.ttft.met.interactive"] == 0
    assert out["slo.ttft.met.batch"] == 1 and "slo.ttft.missed.batch" not in out


def test_one_token_has_no_tpot_and_no_token_has_no_ttft():
    s = SloStats(CLASSES)
    s.ended(clock(first=0.1), done(1), 10.5)
    s.ended(clock(), done(0), 10.5)
    out = s.stats()
    assert out["e2e_ms.count.interactive"] == 2
    assert out["ttft_ms.count.interactive"] == 1 and "tpot_ms.count.interactive" not in out
    assert out["slo.tpot.met.interactive"] == out["slo.tpot.missed.interactive"] == 0
    assert out["slo.ttft.met.interactive"] == 1


def test_degraded_counts_by_class_even_unconfigured():
    s = SloStats(CLASSES)
    s.ended(clock("batch", first=0.1, degraded=True), done(3), 11.0)
    s.ended(clock("batch", first=0.1), done(3), 11.0)
    s.ended(clock("other", first=0.1, degraded=True), done(3), 11.0)
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
    s.ended(clock("a.b", first=0.03), done(3), 10.03 + 2 * 0.012)
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


def goodput(s, cls="interactive"):
    out = s.stats()
    return {k.removeprefix("goodput.").removesuffix(f".{cls}"): v for k, v in out.items()
            if k.startswith("goodput.") and k.endswith(f".{cls}") and v}


def test_goodput_counts_each_finished_request_good_or_missed_by_which_objective():
    s = SloStats(CLASSES)
    s.ended(clock(first=0.25), done(9), 10.75)                   # both exactly at the SLO
    s.ended(clock(first=0.3), done(5), 10.3 + 4 * 0.05)          # TTFT late, TPOT in
    s.ended(clock(first=0.2), done(3), 10.2 + 2 * 0.07)          # TTFT in, TPOT late
    s.ended(clock(first=0.3), done(2), 10.3 + 0.07)              # both late
    s.ended(clock(first=0.2, deadline_ms=150), done(4), 10.25)   # its own deadline: late
    s.ended(clock(), done(7), 10.5)                              # no first token: a TTFT miss
    assert goodput(s) == {"requests": 1, "tokens": 9, "missed.ttft": 3, "missed.tpot": 1,
                          "missed.both": 1, "missed_tokens": 5 + 3 + 2 + 4 + 7}


def test_goodput_tokens_are_every_choices_and_a_class_without_objectives_is_all_good():
    s = SloStats(CLASSES)
    two = done(12, choices=(ChoiceEnd(0, "length", 5), ChoiceEnd(1, "stop", 7)))
    s.ended(clock("batch", first=9.0), two, 19.0 + 6 * 0.09)     # TPOT 90 ms over 7 tokens
    s.ended(clock("batch", first=9.0), done(3), 19.0 + 2 * 0.2)  # 200 ms: late
    s.ended(clock("default", first=50.0), done(4), 99.0)         # unconfigured: no objective
    assert goodput(s, "batch") == {"requests": 1, "tokens": 12, "missed.tpot": 1,
                                   "missed_tokens": 3}
    assert goodput(s, "default") == {"requests": 1, "tokens": 4}


def test_a_finish_at_the_end_to_end_deadline_is_missed_deadline_with_its_tokens():
    """Cut short at its end-to-end bound: missed for reason ``deadline``, its tokens missed
    tokens, even with its first token and TPOT within their objectives (both still
    counted met)."""
    s = SloStats(CLASSES)
    cut = Finished("r", "deadline", Usage(3, 6), choices=(ChoiceEnd(0, "deadline", 6),))
    s.ended(clock(first=0.1), cut, 10.1 + 5 * 0.05)              # TTFT 100 ms, TPOT 50 ms
    assert goodput(s) == {"missed.deadline": 1, "missed_tokens": 6}
    out = s.stats()
    assert out["slo.ttft.met.interactive"] == 1 and out["slo.tpot.met.interactive"] == 1
    assert out["e2e_ms.count.interactive"] == 1


def test_every_other_end_is_missed_by_reason_except_the_requests_own_errors():
    s = SloStats(CLASSES)
    ends = [Rejected("r", "overloaded", "", 1.0), Rejected("r", "deadline_unmeetable", ""),
            Rejected("r", "tenant_over_budget", ""), Rejected("r", "queue_full", ""),
            Rejected("r", "deadline_expired", ""), Rejected("r", "deadline_expired", ""),
            Failed("r", "engine component executor restarted"), Cancelled("r", "client"),
            # the request's own errors: a retry of the same fails the same way
            Rejected("r", "invalid_request", ""), Rejected("r", "prompt_too_long", ""),
            Rejected("r", "unauthenticated", ""), Rejected("r", "class_not_allowed", ""),
            Rejected("r", "unknown_tenant", ""), Rejected("r", "idempotency_key_reused", ""),
            Failed("r", f"{STRUCTURED_OUTPUT_ERROR}: lexer error")]
    for event in ends:
        s.ended(clock(first=0.1), event, 10.2)
    assert goodput(s) == {"missed.rejected": 4, "missed.expired": 2, "missed.failed": 1,
                          "missed.cancelled": 1}
    out = s.stats()
    assert "e2e_ms.count.interactive" not in out                 # only a finish is timed
    assert out["slo.ttft.met.interactive"] == 0


def test_before_admission_names_it_a_request_counts_under_the_class_it_would_get():
    adm = AdmissionConfig(classes=(ServiceClass("interactive", ttft_slo_ms=250),
                                   ServiceClass("batch")),
                          tenants=(TenantConfig("a"), TenantConfig("b", default_class="batch"),
                                   TenantConfig("c", classes=("batch",))))
    s = SloStats.for_config(adm)
    c = RequestClock(0.0, None, resolve(adm, "b", None, None).label)
    s.ended(c, Rejected("r", "overloaded", ""), 0.0)
    assert goodput(s, "batch") == {"missed.rejected": 1}


def test_accepted_names_the_class_and_times_admissions_queue_and_choice_zeros_gaps():
    s = SloStats(CLASSES)
    c = RequestClock(10.0, None, "interactive")
    c.token(10.1)                                   # before Accepted: no class, no gap kept
    s.accepted(c, Accepted("r", 3, service_class="batch", degraded=True, queued_s=0.03))
    assert (c.service_class, c.degraded) == ("batch", True)
    for t, index in ((10.2, 0), (10.212, 0), (10.213, 1), (10.3, 1), (10.26, 0), (10.5, 0)):
        c.token(t, index)
    out = s.stats()
    assert out["admission_queue_ms.le.20.batch"] == 0 and out["admission_queue_ms.le.40.batch"] == 1
    assert out["admission_queue_ms.count.batch"] == 1
    # choice 0's gaps: 100, 12, 48, 240 ms (choice 1's deltas are not among them)
    assert out["itl_ms.count.batch"] == 4
    assert abs(out["itl_ms.sum.batch"] - 400.0) < 1e-6
    assert [out[f"itl_ms.le.{e}.batch"] for e in (10, 15, 50, 100, 200, 300)] == [0, 1, 2, 3, 3, 4]
    assert "itl_ms.count.interactive" not in out


def test_queue_prefill_and_decode_come_from_the_schedulers_timing():
    s = SloStats(CLASSES)
    timing = RequestTiming(queue_s=0.03, prefill_s=0.2, decode_s=1.5, ingress_s=0.001)
    s.ended(clock(first=0.25), done(9, timing), 10.75)
    s.ended(clock(first=0.25), done(9), 10.75)                  # none sent: nothing observed
    out = s.stats()
    for kind, below, at, total in (("queue", 20, 40, 30.0), ("prefill", 100, 250, 200.0),
                                   ("decode", 1000, 2500, 1500.0)):
        assert out[f"{kind}_ms.le.{below}.interactive"] == 0
        assert out[f"{kind}_ms.le.{at}.interactive"] == 1
        assert out[f"{kind}_ms.count.interactive"] == 1
        assert abs(out[f"{kind}_ms.sum.interactive"] - total) < 1e-9
    assert out["e2e_ms.count.interactive"] == 2
