"""The replay report: SLO goodput counts every arrived request, percentiles are exact on known
lists, VTC's backlogged service gap is exact on hand-built event sequences, an invalid run prints
no goodput or throughput, and records survive a round trip through .jsonl and .csv."""
import csv
import re

import msgspec
import pytest

from weir.replay.fairness import (
    ADMIT,
    ARRIVE,
    LEAVE,
    SERVE,
    Event,
    backlog_end,
    backlog_intervals,
    backlog_span,
    max_backlogged_gap,
    overlap_s,
    service_events,
    time_grid,
)
from weir.replay.report import (
    Summary,
    Window,
    met_slo,
    pcts,
    percentile,
    read_records,
    render_table,
    summarize,
    worst_window,
    write_records,
    write_summary_json,
)
from weir.replay.types import CANCELLED, FAILED, REJECTED, RequestRecord, RunResult, Scaling, Slo

SLO = Slo(ttft_ms=200, tpot_ms=50)


def _rec(i, **kw):
    base = dict(index=i, request_id=f"r{i}", arrival_s=float(i), sent_s=float(i))
    return RequestRecord(**(base | kw))


def _done(i, ttft=0.1, out=10, tpot=0.04, **kw):
    """A completed request: first token after ``ttft``, then ``out - 1`` gaps of ``tpot``."""
    return _rec(i, ttft_s=ttft, itl_s=[tpot] * (out - 1), e2e_s=ttft + tpot * (out - 1),
                output_tokens=out, prompt_tokens=100, **kw)


def _ten():
    """6 completed (4 inside the SLO, one late first token, one slow stream), 2 rejected,
    1 failed and 1 cancelled, both of those fast."""
    return [
        _done(0), _done(1), _done(2), _done(3),
        _done(4, ttft=0.3),                                       # TTFT 300 ms > 200
        _done(5, out=3, tpot=0.06),                               # TPOT 60 ms > 50
        _rec(6, decision="reject", terminal=REJECTED, reason="overload"),
        _rec(7, decision="reject", terminal=REJECTED, reason="overload"),
        _rec(8, terminal=FAILED, ttft_s=0.05, itl_s=[0.01], e2e_s=0.06, output_tokens=2,
             prompt_tokens=100),
        _rec(9, terminal=CANCELLED, ttft_s=0.05, itl_s=[0.01] * 3, e2e_s=0.08,
             output_tokens=4, prompt_tokens=100),
    ]


def test_goodput_counts_rejected_failed_and_cancelled_against_it():
    s = summarize(RunResult(label="a", mode="simulated", records=_ten(), duration_s=20.0),
                  {}, SLO)
    assert (s.arrived, s.completed, s.rejected, s.failed, s.cancelled) == (10, 6, 2, 1, 1)
    assert s.slo_met == 4
    assert s.goodput == 0.4
    assert s.token_goodput_tok_s == 40 / 20.0                    # 4 × 10 tokens over 20 s
    assert s.token_goodput_frac == 40 / (5 * 10 + 3 + 2 + 4)    # of every token delivered
    assert s.achieved_rps == 6 / 20.0
    assert s.output_tok_s == 53 / 20.0                           # completed requests' tokens
    assert s.offered_rps == 10 / 9.0                             # arrivals 0 … 9 s


def test_class_slo_and_default():
    recs = [_done(0, ttft=0.15, service_class="chat"), _done(1, ttft=0.15)]
    s = summarize(RunResult(label="a", mode="live", records=recs, duration_s=2.0),
                  {"chat": Slo(100, 50)}, SLO)
    assert s.slo_met == 1 and s.goodput == 0.5
    assert s.slos == {"chat": Slo(100, 50), "default": SLO}


def test_own_deadline_replaces_the_class_ttft_bound():
    assert met_slo(_done(0, ttft=0.3, deadline_ms=400), SLO)      # looser than 200 ms
    assert not met_slo(_done(0, ttft=0.15, deadline_ms=100), SLO)  # tighter
    assert met_slo(_done(0, ttft=0.1 + 0.2, deadline_ms=300), SLO)  # 300.00000000000006 ms


def test_tpot_at_the_bound_meets_and_a_microsecond_over_misses():
    at = _rec(0, ttft_s=0.1, e2e_s=0.4, output_tokens=4)           # 100.00000000000001 ms
    assert met_slo(at, Slo(200, 100))
    over = _rec(0, ttft_s=0.1, e2e_s=0.4 + 3e-6, output_tokens=4)  # 100.001 ms
    assert not met_slo(over, Slo(200, 100))
    assert met_slo(_rec(0, ttft_s=0.2, e2e_s=9.0, output_tokens=1), SLO)  # one token: no TPOT
    assert not met_slo(_rec(0, ttft_s=0.2 + 2e-6, e2e_s=0.2, output_tokens=1), SLO)


def test_worst_window_by_send_time_counts_a_late_drop_as_accepted_and_not_a_refusal():
    recs = [_done(0), _done(1), _done(2, ttft=0.3), _done(3),             # 0-4 s: 3 of 4
            _done(4), _rec(5, decision="reject", terminal=REJECTED, reason="overload"),
            _rec(6, decision="reject", terminal=REJECTED, reason="deadline_expired"),
            _done(7, service_class="chat"),                                # 4-8 s: 2 of 3
            _done(8), _done(9)]                                            # 8-12 s: 2 of 2
    assert worst_window(recs, {}, SLO) == Window(4.0, accepted=3, met=2)
    # a tighter class's SLO is the one its requests are held to
    assert worst_window(recs, {"chat": Slo(50, 50)}, SLO) == Window(4.0, accepted=3, met=1)
    # equal shares: the earliest window
    assert worst_window([_done(1, ttft=0.3), _done(5, ttft=0.3)], {}, SLO) == Window(0.0, 1, 0)
    assert worst_window([_rec(0, decision="reject", terminal=REJECTED, reason="overload")],
                        {}, SLO) is None
    s = summarize(RunResult(label="a", mode="live", records=recs, duration_s=12.0), {}, SLO)
    assert s.worst_window == Window(4.0, 3, 2)
    table = render_table([s])
    assert _cells(table, "worst 4 s window (% of accepted in SLO)") == ["66.7% (2/3) at 4-8 s"]


def test_percentiles_interpolate_between_closest_ranks():
    values = [7, 3, 1, 10, 2, 9, 4, 8, 6, 5]
    assert percentile(values, 50) == 5.5
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 0) == 1 and percentile(values, 100) == 10
    assert percentile([4.0], 99) == 4.0
    p = pcts([0.001, 0.002, 0.003])
    assert (p.p50, p.p90) == (2.0, pytest.approx(2.8))
    assert pcts([]) is None
    with pytest.raises(ValueError):
        percentile([], 50)


def test_latency_percentiles_are_over_completed_requests_and_every_gap():
    recs = [_rec(0, ttft_s=0.1, itl_s=[0.01, 0.03], e2e_s=0.14, output_tokens=3),
            _rec(1, ttft_s=0.3, itl_s=[0.02], e2e_s=0.32, output_tokens=2, queue_s=0.2),
            _rec(2, terminal=CANCELLED, ttft_s=5.0, itl_s=[9.0], e2e_s=14.0, output_tokens=2,
                 queue_s=4.0)]
    s = summarize(RunResult(label="a", mode="live", records=recs, duration_s=14.0), {}, SLO)
    assert s.ttft_ms.p50 == pytest.approx(200.0)                  # 100 and 300, not 5000
    assert s.itl_ms.p50 == pytest.approx(20.0)                    # 10, 20, 30
    assert s.tpot_ms.p50 == pytest.approx(20.0)                   # 20 and 20
    assert s.e2e_ms.p99 == pytest.approx(140 + 0.99 * (320 - 140))
    assert s.queue_ms.p50 == pytest.approx(2100.0)                # every queue time: 0.2, 4.0


def test_single_request_rates_prefix_hits_and_wasted_tokens():
    recs = [_done(0, cached_tokens=60),
            _rec(1, terminal=REJECTED, prompt_tokens=1000, cached_tokens=0)]
    s = summarize(RunResult(label="a", mode="simulated", records=recs[:1], duration_s=0.0),
                  {}, SLO)
    assert s.offered_rps is None and s.achieved_rps is None and s.goodput == 1.0
    s = summarize(RunResult(label="a", mode="simulated", records=recs, duration_s=2.0,
                            meta={"wasted_tokens": 77}), {}, SLO)
    assert s.prefix_hit_rate == 0.6                               # the rejected one is out
    assert s.wasted_tokens == 77 and s.preemptions == 0
    empty = summarize(RunResult(label="e", mode="live", records=[]), {}, SLO)
    assert empty.goodput is None and empty.ttft_ms is None and empty.service_curves == {}


# --- VTC service and the backlogged gap -------------------------------------------------------

def _serve(t, u, amount):
    return Event(t, SERVE, u, amount)


def test_gap_lifts_a_tenant_that_comes_back_to_the_backlogged_minimum():
    events = [Event(0, ARRIVE, "A"), Event(0, ARRIVE, "B"),
              _serve(1, "A", 10),                          # A 10, B 0: gap 10
              _serve(2, "B", 4),                           # gap 6
              Event(3, LEAVE, "B"),
              _serve(4, "A", 20),                          # A alone: 30
              Event(5, ARRIVE, "B"),                       # B lifted 4 → 30, not 26 behind
              _serve(6, "B", 5),                           # gap 5
              Event(7, LEAVE, "A"), Event(7, LEAVE, "B")]
    assert max_backlogged_gap(reversed(events)) == 10.0      # any order in


def test_gap_with_three_tenants_lifts_into_an_empty_system_to_the_last_to_leave():
    events = [Event(0, ARRIVE, "A"), _serve(1, "A", 12), Event(2, LEAVE, "A"),   # A alone
              Event(3, ARRIVE, "C"), Event(3, ARRIVE, "B"),      # both lifted to 12, together
              _serve(4, "B", 6),                                 # B 18, C 12: gap 6
              Event(5, ARRIVE, "A"), _serve(5, "C", 3),          # A lifted to min 12; C 15
              _serve(6, "A", 10),                                # A 22, B 18, C 15: gap 7
              Event(7, LEAVE, "A"), Event(7, LEAVE, "B"), Event(7, LEAVE, "C")]
    assert max_backlogged_gap(events) == 7.0


def test_gap_is_zero_with_fewer_than_two_backlogged_and_counts_service_at_departure():
    assert max_backlogged_gap([Event(0, ARRIVE, "A"), _serve(1, "A", 50),
                               Event(2, LEAVE, "A"), Event(2, ARRIVE, "B")]) == 0.0
    # A's last tokens land at its terminal instant; B is still backlogged then
    assert max_backlogged_gap([Event(0, ARRIVE, "A"), Event(0, ARRIVE, "B"),
                               _serve(2, "A", 8), Event(2, LEAVE, "A"),
                               Event(3, LEAVE, "B")]) == 8.0


def test_prompts_charged_as_requests_start_count_from_the_next_instant():
    events = [Event(0, ARRIVE, "A"), Event(0, ARRIVE, "A"), Event(0, ARRIVE, "B"),
              Event(1, LEAVE, "A"), Event(1, ADMIT, "A", 10),    # A's first starts: 0 vs 0
              _serve(2, "A", 2),                                 # its token: A 12, B 0
              Event(2, LEAVE, "B"), Event(2, ADMIT, "B", 5),     # then both start: nobody
              Event(2, LEAVE, "A"), Event(2, ADMIT, "A", 100),   # waits to see A's 112
              Event(3, ARRIVE, "C"),                             # lifted to A's 112 (last out)
              Event(4, ARRIVE, "D"),                             # lifted to C's 112
              _serve(5, "D", 3), Event(6, LEAVE, "C"), Event(6, LEAVE, "D")]   # D 115, C 112
    assert max_backlogged_gap(events) == 12.0                 # at 2; D − C is 3 at 5


def test_one_instant_is_one_time_whatever_the_sum():
    # sent 0.1 + queue 0.2 is 0.30000000000000004 in floats; the other's token is at 0.3
    recs = [_rec(0, tenant="A", arrival_s=0.1, sent_s=0.1, queue_s=0.2, ttft_s=0.3,
                 e2e_s=0.3, prompt_tokens=4, output_tokens=1),
            _rec(1, tenant="B", arrival_s=0.0, sent_s=0.0, queue_s=0.2, ttft_s=0.3,
                 e2e_s=0.3, prompt_tokens=0, output_tokens=1)]
    times = {e[0] for e in service_events(recs)}
    assert 0.3 in times and 0.30000000000000004 not in times


def test_weighted_service_from_records_with_missing_gaps_at_the_terminal():
    recs = [  # A (weight 2): prompt 4 and token 1 at t=1, token 2 at t=2
        _rec(0, tenant="A", arrival_s=0.0, sent_s=0.0, ttft_s=1.0, itl_s=[1.0], e2e_s=2.0,
             prompt_tokens=4, output_tokens=2),
        # B: prompt 2 and token 1 at t=1; 2 tokens without gaps land at the terminal, t=3
        _rec(1, tenant="B", arrival_s=0.0, sent_s=0.0, ttft_s=1.0, itl_s=[], e2e_s=3.0,
             prompt_tokens=2, output_tokens=3, n=2),
        _rec(2, tenant="C", arrival_s=0.5, sent_s=0.5, terminal=REJECTED, decision="reject"),
    ]
    run = RunResult(label="w", mode="simulated", records=recs, duration_s=3.0)
    s = summarize(run, {}, SLO, weights={"A": 2.0}, bucket_s=1.0)
    assert s.service_curves == {"A": [(0.0, 0.0), (1.0, 3.0), (2.0, 4.0), (3.0, 4.0)],
                                "B": [(0.0, 0.0), (1.0, 4.0), (2.0, 4.0), (3.0, 8.0)],
                                "C": [(0.0, 0.0), (1.0, 0.0), (2.0, 0.0), (3.0, 0.0)]}
    # no queue times: each waits until its first token, t=1, and is compared then, served
    assert s.max_backlogged_gap == 1.0            # t=1: B 4 − A 3; C (rejected) never counts
    unweighted = summarize(run, {}, SLO, bucket_s=1.0)
    assert unweighted.max_backlogged_gap == 2.0   # t=1: A 6 − B 4; at t=2 neither waits
    assert not [e for e in service_events(recs) if Event(*e).tenant == "C"]
    with pytest.raises(ValueError):
        service_events(recs, {"A": 0.0})


def test_backlogged_is_waiting_from_send_to_first_scheduled():
    queued = _rec(0, sent_s=1.5, queue_s=0.25, ttft_s=0.5, e2e_s=2.0)
    assert backlog_end(queued) == 1.75                           # the engine's queue time
    assert backlog_end(_rec(0, ttft_s=0.5, e2e_s=2.0)) == 0.5    # none reported: first token
    expired = _rec(3, terminal=REJECTED, decision="reject", e2e_s=4.0)
    assert backlog_end(expired) == 7.0              # waited in admission's queue, then refused
    assert backlog_end(_rec(3, terminal=REJECTED, e2e_s=0.0)) == 3.0        # refused at once
    assert backlog_end(_rec(3, terminal=REJECTED)) == 3.0
    assert backlog_end(_rec(2, terminal=CANCELLED, e2e_s=1.0)) == 3.0       # never started
    recs = [_rec(0, tenant="A", queue_s=1.0, ttft_s=2.0, e2e_s=3.0),        # waits [0, 1)
            _rec(1, tenant="A", arrival_s=0.5, sent_s=0.5, queue_s=1.5),    # [0.5, 2)
            _rec(2, tenant="A", queue_s=0.5),                               # [2, 2.5)
            _rec(5, tenant="B", queue_s=0.0, ttft_s=1.0)]                   # never waits
    assert backlog_intervals(recs, "A") == [(0.0, 2.5)]
    assert backlog_intervals(recs, "B") == []
    assert overlap_s([(0.0, 2.5), (3.0, 4.0)], [(1.0, 3.5)]) == 2.0


def test_with_the_engines_prefill_time_the_wait_is_where_the_engine_had_it():
    # sent at 1.0, first token at 2.0 on the client's clock; the engine: 0.5 s queued, then
    # 0.25 s to the first token: first scheduled at 1.75, arrived at 1.25 (0.25 s in transit)
    late = _rec(1, queue_s=0.5, prefill_s=0.25, ttft_s=1.0, e2e_s=1.5)
    assert backlog_span(late) == (1.25, 1.75)
    assert backlog_end(late) == 1.75
    assert backlog_span(_rec(1, queue_s=0.5, ttft_s=1.0)) == (1.0, 1.5)       # no prefill time
    # a first token sooner than the engine's times allow: never before the send
    assert backlog_span(_rec(1, queue_s=0.5, prefill_s=0.75, ttft_s=0.5)) == (1.0, 1.0)
    assert backlog_span(_rec(1, queue_s=0.5, prefill_s=0.25, ttft_s=0.5)) == (1.0, 1.25)


def test_a_request_the_engine_had_not_received_yet_is_not_backlog():
    # B is sent at 0 but reaches the engine only at 0.3 (a busy client); A's prompt of 100
    # starts at 0.2, before the engine could know of B, and B starts at 0.3 at once. Timed
    # from its send B waited through A's start and A's first token at 0.3: gap 100 + 2.
    # Timed where the engine had it, it never waited: no gap.
    a = _rec(0, tenant="A", sent_s=0.0, queue_s=0.2, prefill_s=0.1, ttft_s=0.3, e2e_s=0.3,
             prompt_tokens=100, output_tokens=1)
    b = _rec(1, tenant="B", sent_s=0.0, queue_s=0.0, prefill_s=0.1, ttft_s=0.4, e2e_s=0.4,
             prompt_tokens=10, output_tokens=1)
    waiter = _rec(2, tenant="A", sent_s=0.0, queue_s=5.0, ttft_s=5.1, e2e_s=5.1,
                  prompt_tokens=1, output_tokens=1)       # keeps A backlogged throughout
    assert max_backlogged_gap(service_events([a, b, waiter])) == 0.0
    from_send = msgspec.structs.replace(b, prefill_s=None, queue_s=0.3)
    assert max_backlogged_gap(service_events([a, from_send, waiter])) == 102.0


def test_the_engines_ingress_is_not_backlog():
    # the engine had the request 0.5 s from arrival to first scheduled, 0.2 s of it in the
    # tokenizer, the cache lookup and the hops (no queue held it): it waited 0.3 s
    both = _rec(1, queue_s=0.5, ingress_s=0.2, prefill_s=0.25, ttft_s=1.0)
    assert backlog_span(both) == (1.25 + 0.2, 1.75)
    assert backlog_span(_rec(1, queue_s=0.5, ingress_s=0.2)) == (1.2, 1.5)   # queue time only
    assert backlog_span(_rec(1, queue_s=0.5, ingress_s=0.9)) == (1.5, 1.5)   # never past it
    # B reaches the scheduler 0.3 s after arriving (a busy tokenizer); A's prompt of 100
    # starts meanwhile. B never waited in a queue: no gap, where counting its ingress as
    # backlog charges the scheduler with A's start (the gap of the test above)
    a = _rec(0, tenant="A", sent_s=0.0, queue_s=0.2, prefill_s=0.1, ttft_s=0.3, e2e_s=0.3,
             prompt_tokens=100, output_tokens=1)
    b = _rec(1, tenant="B", sent_s=0.0, queue_s=0.3, ingress_s=0.3, prefill_s=0.1,
             ttft_s=0.4, e2e_s=0.4, prompt_tokens=10, output_tokens=1)
    waiter = _rec(2, tenant="A", sent_s=0.0, queue_s=5.0, ttft_s=5.1, e2e_s=5.1,
                  prompt_tokens=1, output_tokens=1)
    assert max_backlogged_gap(service_events([a, b, waiter])) == 0.0
    b_counted = msgspec.structs.replace(b, ingress_s=None)
    assert max_backlogged_gap(service_events([a, b_counted, waiter])) == 102.0


def test_a_tenant_whose_work_is_all_running_is_not_backlogged():
    # A's one request starts at once and streams 10 tokens over 1..10 s; B's requests each
    # wait 1 s and are served. A was never waiting, so however far ahead it gets, no gap
    # (the old rule, outstanding until the end, counted A at every instant and read 20).
    recs = [_rec(0, tenant="A", arrival_s=0.0, sent_s=0.0, queue_s=0.0, ttft_s=1.0,
                 itl_s=[1.0] * 9, e2e_s=10.0, prompt_tokens=0, output_tokens=10)]
    recs += [_rec(i, tenant="B", arrival_s=float(i), sent_s=float(i), queue_s=1.0, ttft_s=1.5,
                  e2e_s=1.5, prompt_tokens=0, output_tokens=1) for i in range(1, 9)]
    s = summarize(RunResult(label="r", mode="simulated", records=recs, duration_s=10.0),
                  {}, SLO)
    assert s.max_backlogged_gap == 0.0
    # A waiting too, 3 s behind its first request: compared while it waits, from its lift
    recs.append(_rec(9, tenant="A", arrival_s=3.0, sent_s=3.0, queue_s=4.0, ttft_s=4.5,
                     e2e_s=4.5, prompt_tokens=0, output_tokens=1))
    s = summarize(RunResult(label="r", mode="simulated", records=recs, duration_s=10.0),
                  {}, SLO)
    # at 3 s A (tokens at 1 and 2: 4) is not lowered to B's 2 (token at 2.5); then both
    # gain 2 a second, A on the whole seconds, B on the halves: A 6 − B 2 at 3 s, … A 14 −
    # B 10 at 7 s, when A's second request starts
    assert s.max_backlogged_gap == 4.0


def test_time_grid_ends_exactly_at_the_end():
    assert time_grid(0.0, 3.0, 1.0) == [0.0, 1.0, 2.0, 3.0]
    assert time_grid(0.0, 2.5, 1.0) == [0.0, 1.0, 2.0, 2.5]
    assert time_grid(1.0, 1.0, 0.001) == [1.0]


# --- the table --------------------------------------------------------------------------------

def _cells(table, metric):
    line = next(ln for ln in table.splitlines() if ln.startswith(metric))
    return re.split(r"\s{2,}", line[len(metric):].strip())


def test_table_marks_an_invalid_run_and_prints_none_of_its_goodput():
    good = RunResult(label="cfg-a", mode="simulated", records=_ten(), duration_s=20.0,
                     scaling=Scaling(length=0.5, time=2.0, block_size=256, seed=7))
    bad = RunResult(label="live-b", mode="live", records=_ten(), duration_s=20.0,
                    valid=False, invalid_reasons=["lag p99 812 ms > 50 ms"],
                    lag_p50_ms=300.0, lag_p99_ms=812.0)
    table = render_table([summarize(good, {"chat": Slo(100, 20)}, SLO), summarize(bad, {}, SLO)])
    assert _cells(table, "metric") == ["cfg-a", "live-b"]
    assert _cells(table, "goodput (% of arrived)") == ["40.0% (4/10)", "invalid"]
    for metric in ("token goodput (tok/s)", "token goodput (% of output)", "achieved (req/s)",
                   "output (tok/s)"):
        assert _cells(table, metric)[1] == "invalid"
        assert re.search(r"\d", _cells(table, metric)[0])
    assert _cells(table, "validity") == ["valid", "INVALID: lag p99 812 ms > 50 ms"]
    assert _cells(table, "scaling: length ×") == ["0.5", "1"]
    assert _cells(table, "scaling: time ×") == ["2", "1"]
    assert _cells(table, "scaling: block (tokens)") == ["256", "512"]
    assert _cells(table, "schedule lag p99 (ms)") == ["-", "812.0"]
    assert _cells(table, "TTFT p50 (ms)") == ["100.0", "100.0"]
    assert "SLO default: TTFT ≤ 200 ms, TPOT ≤ 50 ms" in table
    rows = table.split("\n\n")[0].splitlines()
    assert len({len(ln) for ln in rows}) == 1     # aligned: every row ends at the same column


# --- records on disk --------------------------------------------------------------------------

def _records():
    return [_done(0, tenant="t1", service_class="chat", session_id="s1", deadline_ms=250.0,
                  cached_tokens=64, preemptions=1, trace_id="abc", queue_s=0.012,
                  prefill_s=0.05),
            _rec(1, decision="reject", terminal=REJECTED, reason="tenant_quota"),
            _rec(2, terminal=CANCELLED, ttft_s=0.1 + 0.2, itl_s=[1 / 3], e2e_s=0.7,
                 output_tokens=2, finish_reason="", n=2)]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_records_round_trip(tmp_path, suffix):
    path = tmp_path / f"records{suffix}"
    write_records(_records(), path)
    assert read_records(path) == _records()


def test_csv_has_itl_in_one_cell_and_a_computed_tpot(tmp_path):
    path = tmp_path / "r.csv"
    write_records(_records(), path)
    rows = list(csv.DictReader(path.open(newline="")))
    assert rows[0]["itl_s"] == " ".join(["0.04"] * 9)
    assert float(rows[0]["tpot_s"]) == pytest.approx(0.04)
    assert rows[1]["tpot_s"] == "" and rows[1]["ttft_s"] == ""
    with pytest.raises(ValueError):
        write_records(_records(), tmp_path / "r.txt")


def test_summary_json_round_trips(tmp_path):
    s = summarize(RunResult(label="a", mode="simulated", records=_ten(), duration_s=20.0),
                  {}, SLO)
    write_summary_json(s, tmp_path / "one.json")
    assert msgspec.json.decode((tmp_path / "one.json").read_bytes(), type=Summary) == s
    write_summary_json([s, s], tmp_path / "two.json")
    assert msgspec.json.decode((tmp_path / "two.json").read_bytes(), type=list[Summary]) == [s, s]
