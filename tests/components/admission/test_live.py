"""Admission against the live engine (components/admission/live.py), exact: the KV room by
the kv_manager's free blocks, the first seed's worked decision (a nearly full pool with
slow streams refuses or degrades a long prompt before its prefill, with the reason on the
decision's span), the decode horizon and the latency knee it finds (n counting n), and
the ledger's cross-check with the pool. The SLO-first classes (interactive: TTFT 3 s,
TPOT 300 ms, never queued; batch: queued, degradable) are the engine's own."""
from __future__ import annotations

import anyio
import msgspec
import pytest

from components.admission.decision import Kind
from components.admission.live import MIN_DECODE_STEPS, Horizon, knee
from components.admission.policy import AdmissionPolicy
from schemas.config import SLO_CLASSES, load_config
from schemas.wire import DecodeRates, EventBatch, HeldRequest, SchedulerLoad
from tests.components.admission.policies import req, traced_service

BS = 16
# a decode step: 20 ms + 4 ms a sequence (+ 1 µs per KV position where a test says so);
# interactive's 300 ms TPOT less 20% headroom is 240 ms: (240 − 20) / 4 = 55 sequences
RATES = DecodeRates(0.020, 0.004, 0.0)


def policy(num_blocks=1000, watermark=0.0, max_num_seqs=128, **admission) -> AdmissionPolicy:
    cfg = load_config(None, topology={"run_dir": "/x"},
                      scheduler={"max_num_seqs": max_num_seqs},
                      kv={"num_blocks": num_blocks, "block_size": BS, "watermark": watermark},
                      engine={"max_model_len": 8192},
                      admission={"policy": "deadline", "kv_safety": 0.0,
                                 "classes": [msgspec.to_builtins(c) for c in SLO_CLASSES],
                                 "tenants": [{"name": "a"}], **admission})
    return AdmissionPolicy(cfg)


def report(**live) -> SchedulerLoad:
    """A load report with measured rates (20,000 prefill tokens/s: a prompt's TTFT is never
    what decides here) and the live fields given."""
    return SchedulerLoad(**{"running": 0, "waiting": 0, "queued_prefill_tokens": 0,
                            "prefill_tokens_per_s": 20_000.0, "decode_step_s": 0.02, **live})


def running(p: AdmissionPolicy, seqs: int, blocks: int = 0, cls: str = "interactive") -> None:
    """Streams already admitted (as a restarted admission takes them back: ``holding``)."""
    p.holding([HeldRequest(f"s{cls}{seqs}", "a", cls, seqs, blocks)])


# ------------------------------------------------------------------ the KV room
def test_the_live_room_is_the_ledgers_while_the_pool_holds_no_more_than_reserved():
    p = policy()
    running(p, 4, blocks=300)
    assert p.live.kv_room(p.ledger.reserved_blocks) is None       # nothing reported: the ledger
    p.on_load(report(running=4, kv_free_blocks=800))        # 200 used of 300 reserved
    reserved = p.ledger.reserved_blocks
    assert p.live.kv_room(reserved) == 700 == p.capacity.kv_capacity - reserved
    p.on_load(report(running=4, kv_free_blocks=200))        # 800 used: prefix hits, growth
    assert p.live.kv_room(p.ledger.reserved_blocks) == 200
    assert p.live_stats()["kv.unreserved_blocks"] == 500


def test_the_watermark_is_kept_by_the_live_room_too():
    p = policy(watermark=0.01)                              # 10 blocks
    p.on_load(report(kv_free_blocks=50, kv_evictable_blocks=20))
    assert p.live.kv_room(0) == 40 and p.capacity.kv_capacity == 990


# ------------------------------------------------------------------ the worked decision
# The engine of the first seed's worked decision: interactive streams decoding, the pool 5%
# free (50 of 1000 blocks) though the ledger reserved 300 (the rest pinned by prefix hits
# and growth past reservations), and their measured TPOT 420 ms, over the 300 ms SLO.
# A long prompt: 640 tokens and 512 out, 72 blocks; the ledger alone would take it (700).
def worked(tpot_s: float) -> AdmissionPolicy:
    p = policy()
    running(p, 40, blocks=300)
    p.on_load(report(running=40, running_context=40 * 1000, decode_rates=RATES,
                     kv_free_blocks=50, kv_evictable_blocks=10,
                     tpot_s={"interactive": tpot_s}))
    return p


LONG = dict(prompt=640, max_tokens=512)


def test_worked_decision_slow_streams_and_a_full_pool_reject_a_long_prompt_before_prefill():
    p = worked(tpot_s=0.420)
    d = p.decide(req("long", **LONG), 0, 1.0)
    assert (d.kind, d.reason) == (Kind.REJECT, "tpot_slo_at_risk")
    assert "'interactive' streams are late: measured TPOT 420 ms" in d.rejected.message
    assert d.rejected.retry_after_s == 2.0                  # one release at 0.5/s, nothing seen
    assert "long" not in p.ledger and p.queued == 0           # no KV, no prefill spent on it
    assert p.ledger.reserved_blocks == 300


def test_worked_decision_a_batch_request_waits_for_the_streams_to_recover():
    p = worked(tpot_s=0.420)
    d = p.decide(req("long", cls="batch", **LONG), 0, 1.0)
    assert (d.kind, d.reason) == (Kind.QUEUE, "waiting_for_tpot")
    assert p.release(1.1) == []
    p.on_load(report(running=40, running_context=40 * 1000, decode_rates=RATES,
                     kv_free_blocks=500, tpot_s={"interactive": 0.150}))
    (_, released, _), = p.release(1.2)
    assert (released.kind, released.max_tokens) == (Kind.ACCEPT, 512)


def test_worked_decision_with_healthy_streams_the_pool_alone_refuses_or_degrades():
    p = worked(tpot_s=0.150)
    d = p.decide(req("long", **LONG), 0, 1.0)               # interactive may not degrade
    assert (d.kind, d.reason) == (Kind.REJECT, "kv_pressure")
    assert "needs 72 KV blocks; the pool has 50 free" in d.rejected.message
    d = p.decide(req("long-batch", cls="batch", **LONG), 0, 1.0)
    assert (d.kind, d.reason, d.max_tokens) == (Kind.DEGRADE, "kv_pressure", 160)  # 50 x 16 − 640
    assert p.ledger.entry("long-batch").kv_blocks == 50


def test_late_streams_with_room_in_the_pool_are_the_schedulers_to_fix():
    """Both halves of the worked decision, not either: streams over their TPOT with the pool
    roomy (a long prefill step beside them, under fixed chunking) do not refuse work."""
    p = worked(tpot_s=0.420)
    p.on_load(report(running=40, running_context=40 * 1000, decode_rates=RATES,
                     kv_free_blocks=500, tpot_s={"interactive": 0.420}))
    assert p.decide(req("long", **LONG), 0, 1.0).kind == Kind.ACCEPT


def test_the_horizon_waits_for_measured_decode_steps():
    """Rates a fresh scheduler scaled by its first, slow steps are not extrapolated: below
    MIN_DECODE_STEPS decode steps in the report's window nothing is checked (an engine's
    first request of two sequences was refused for a 937 ms step: the startup fit scaled
    by a first step 20x its prediction)."""
    slow = DecodeRates(0.900, 0.004, 0.0)
    for steps, kind in ((0, Kind.ACCEPT), (MIN_DECODE_STEPS - 1, Kind.ACCEPT),
                        (MIN_DECODE_STEPS, Kind.REJECT)):
        p = policy()
        running(p, 1)
        p.on_load(report(running=1, decode_rates=slow, decode_steps=steps))
        assert p.decide(req("new", prompt=16, max_tokens=16), 0, 1.0).kind == kind, steps


def test_the_new_reasons_cross_the_wire():
    for tpot_s, reason in ((0.420, "tpot_slo_at_risk"), (0.150, "kv_pressure")):
        rejected = worked(tpot_s).decide(req("long", **LONG), 0, 1.0).rejected
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(EventBatch([rejected])),
                                      type=EventBatch)
        assert wire.events == [rejected] and rejected.reason == reason


def test_worked_decision_control_a_roomy_pool_and_healthy_streams_accept_it():
    p = worked(tpot_s=0.150)
    p.on_load(report(running=40, running_context=40 * 1000, decode_rates=RATES,
                     kv_free_blocks=500, tpot_s={"interactive": 0.150}))
    d = p.decide(req("long", **LONG), 0, 1.0)
    assert (d.kind, d.reason) == (Kind.ACCEPT, "fits")
    # 41 sequences reading 40,000 + 640 + 256 positions (no per-position cost here)
    assert d.estimate.decode_step_s == pytest.approx(0.020 + 41 * 0.004)


def test_the_reason_and_the_live_engine_are_on_the_decision_span(monkeypatch):
    svc, exporter, sent = traced_service(monkeypatch, worked(tpot_s=0.420))
    anyio.run(svc._admit, req("long", **LONG), None, 0)
    span, = exporter.get_finished_spans()
    attrs = span.attributes
    assert (span.name, attrs["weir.admission.decision"], attrs["weir.admission.reason"]) == \
        ("admission.decide", "reject", "tpot_slo_at_risk")
    assert attrs["weir.admission.retry_after_s"] == 2.0
    assert (attrs["weir.kv.free_blocks"], attrs["weir.kv.evictable_blocks"],
            attrs["weir.admission.kv_live_room_blocks"]) == (50, 10, 50)
    assert attrs["weir.scheduler.tpot_ms.interactive"] == 420.0
    assert attrs["weir.admission.predicted_decode_step_ms"] == pytest.approx(184.0)
    assert attrs["weir.admission.admitted_seqs"] == 40
    assert sent[0].events[0].reason == "tpot_slo_at_risk"


# ------------------------------------------------------------------ the decode horizon
@pytest.mark.parametrize("rates, context, error, expect", [
    (RATES, 0, 1.0, 55),                                   # (240 − 20) / 4
    (DecodeRates(0.020, 0.004, 1e-6), 1000, 1.0, 44),      # 5 ms a sequence at 1000 positions
    (RATES, 0, 1.1, 49),                                   # steps 10% slower than predicted
    (DecodeRates(0.300, 0.004, 0.0), 0, 1.0, 0),           # the step alone is past it
    (DecodeRates(0.020, 0.0, 0.0), 0, 1.0, None),          # sequences cost nothing: no knee
])
def test_the_knee_for_given_step_costs(rates, context, error, expect):
    assert knee(rates, 0.240, context, error) == expect


def at_knee(p: AdmissionPolicy, seqs: int, **live) -> None:
    running(p, seqs)
    p.on_load(report(running=seqs, decode_rates=RATES, **live))


@pytest.mark.parametrize("before, n, kind", [
    (54, 1, Kind.ACCEPT),             # 55 sequences: 240 ms, at the limit
    (55, 1, Kind.REJECT),             # 56: 244 ms
    (53, 2, Kind.ACCEPT),             # n counts n
    (53, 3, Kind.REJECT),
])
def test_accept_below_the_knee_reject_above_n_counting_n(before, n, kind):
    p = policy()
    at_knee(p, before)
    d = p.decide(req("new", prompt=16, max_tokens=16, n=n), 0, 1.0)
    assert d.kind == kind
    if kind == Kind.REJECT:
        assert d.reason == "tpot_slo_at_risk" and d.rejected.retry_after_s > 0
        assert f"would be {(20 + 4 * (before + n))} ms ({before + n} sequences" in \
            d.rejected.message and "past 240 ms" in d.rejected.message
    assert p.live_stats()["horizon.knee_seqs"] == 55


def test_n_counts_n_beside_a_running_stream_and_an_idle_engine_checks_nothing():
    p = policy()
    p.on_load(report(decode_rates=DecodeRates(0.020, 0.050, 0.0)))   # knee: 4 sequences
    assert p.decide(req("one", prompt=16, max_tokens=16), 0, 1.0).kind == Kind.ACCEPT
    assert p.decide(req("three", prompt=16, max_tokens=16, n=3), 0, 1.0).kind == Kind.ACCEPT
    p.released(["three"], 1.0)
    d = p.decide(req("four", prompt=16, max_tokens=16, n=4), 0, 1.0)    # 1 + 4 > 4
    assert (d.kind, d.reason) == (Kind.REJECT, "tpot_slo_at_risk")
    # alone, even past the knee by its own n: no stream to slow, and waiting would not
    # make its steps shorter (its steps are also what correct rates learned on a machine
    # slowed for a while: refusing every request on an idle engine kept them stale)
    p.released(["one"], 1.0)
    assert p.decide(req("five", prompt=16, max_tokens=16, n=5), 0, 1.0).kind == Kind.ACCEPT


def test_the_stats_show_the_rates_the_knee_and_the_live_steps():
    p = policy()
    at_knee(p, 20, running_context=20 * 500, decode_measured_s=0.1, decode_error=1.25,
            tpot_s={"interactive": 0.1})
    stats = p.live_stats()
    assert {k: v for k, v in stats.items() if k.startswith("horizon.")} == {
        "horizon.knee_seqs": 43,                 # (240 / 1.25 − 20) / 4
        "horizon.decode_base_ms": 20.0, "horizon.decode_per_seq_ms": 4.0,
        "horizon.decode_per_position_us": 0.0, "horizon.decode_measured_ms": 100.0,
        "horizon.decode_error": 1.25, "horizon.tpot_ms.interactive": 100.0}


def test_admitted_sequences_not_running_yet_count_and_so_does_context():
    p = policy()
    running(p, 50)
    # the scheduler has only 10 of the ledger's 50 running; each reads 1000 positions at 1 µs
    p.on_load(report(running=10, running_context=10_000,
                     decode_rates=DecodeRates(0.020, 0.003, 1e-6)))
    # a 1000-token prompt and 16 out reads 1008 positions decoding; 51 sequences:
    # 20 + 51 x 3 + (10,000 + 41 x 1008) / 1000 = 224.3 ms, within 240
    d = p.decide(req("in", prompt=1000, max_tokens=16), 0, 1.0)
    assert d.kind == Kind.ACCEPT and d.estimate.decode_step_s == pytest.approx(0.2243, abs=1e-4)
    d = p.decide(req("long", prompt=7000, max_tokens=16), 0, 1.0)   # its context: 7008
    assert (d.kind, d.reason) == (Kind.REJECT, "tpot_slo_at_risk")


def test_the_knee_binds_below_max_num_seqs_not_above_it():
    p = policy(max_num_seqs=40)                 # the batch never passes 40: 180 ms
    at_knee(p, 60)
    assert p.decide(req("new", prompt=16, max_tokens=16), 0, 1.0).kind == Kind.ACCEPT


def test_a_batch_request_at_the_knee_queues_and_starts_when_a_stream_ends():
    p = policy()
    at_knee(p, 55)
    d = p.decide(req("b1", cls="batch", prompt=16, max_tokens=16), 0, 1.0)
    assert (d.kind, d.reason) == (Kind.QUEUE, "waiting_for_tpot")
    assert p.release(1.1) == []
    p.holding([HeldRequest("short", "a", "interactive", 1, 0)])
    p.released(["short"], 1.2)
    p.released([f"sinteractive{55}"], 1.3)      # the 55 streams end
    assert [r.request_id for r, _, _ in p.release(1.4)] == ["b1"]


def test_moderate_load_is_never_refused_by_the_horizon():
    """Two CPU cores' decode rates (30 ms + 1.5 ms a sequence + 0.2 µs a position) with 16
    streams at 600 positions and a measured TPOT of 80 ms: nothing bites."""
    p = policy()
    at_knee(p, 16)
    p.on_load(report(running=16, running_context=16 * 600, decode_measured_s=0.08,
                     decode_rates=DecodeRates(0.030, 0.0015, 2e-7), kv_free_blocks=700,
                     tpot_s={"interactive": 0.08}))
    for i in range(8):
        assert p.decide(req(f"r{i}", prompt=500, max_tokens=128), 0, 1.0).reason == "fits"


@pytest.mark.parametrize("settings", [{"policy": "fcfs"}, {"decode_horizon": False}])
def test_without_the_check_the_knee_and_late_streams_do_not_refuse(settings):
    p = policy(**settings)
    at_knee(p, 80, tpot_s={"interactive": 0.5})
    assert p.decide(req("new", prompt=16, max_tokens=16), 0, 1.0).kind == Kind.ACCEPT


def test_no_rates_or_no_tpot_target_in_play_checks_nothing():
    p = policy()
    running(p, 80, cls="batch")                 # batch has no TPOT target
    p.on_load(report(running=80, decode_rates=RATES))
    assert p.decide(req("b", cls="batch", prompt=16, max_tokens=16), 0, 1.0).kind == Kind.ACCEPT
    p = policy()
    at_knee(p, 80)
    p.on_load(report(running=80))               # rates not reported
    assert p.decide(req("i", prompt=16, max_tokens=16), 0, 1.0).kind == Kind.ACCEPT


def test_a_horizon_is_at_the_limit_give_or_take_rounding():
    assert not Horizon(0.24000000000000002, 0.24, "interactive").at_risk
    assert Horizon(0.2401, 0.24, "interactive").at_risk
    assert Horizon(0.1, 0.24, "interactive", late="interactive").at_risk


# ------------------------------------------------------------------ the cross-check
IDLE = dict(running=0, waiting=0)


def test_an_idle_engine_with_a_ledger_entry_left_is_a_ledger_leak_once():
    p = policy()
    running(p, 1, blocks=5)                     # its Released never came
    assert p.on_load(report(**IDLE, kv_free_blocks=1000)) == ""    # one report: too soon
    assert p.on_load(report(**IDLE, kv_free_blocks=1000)) == "ledger_leak"
    assert p.on_load(report(**IDLE, kv_free_blocks=1000)) == ""    # said once a spell
    assert p.live_stats()["kv.crosscheck_mismatches"] == 1


def test_an_idle_engine_whose_pool_holds_blocks_is_a_kv_leak():
    p = policy()
    p.on_load(report(**IDLE, kv_free_blocks=997))
    assert p.on_load(report(**IDLE, kv_free_blocks=997)) == "kv_leak"


def test_an_agreeing_idle_engine_and_one_still_taking_work_say_nothing():
    p = policy()
    p.on_load(report(**IDLE, kv_free_blocks=1000, kv_evictable_blocks=300))  # cached: free
    assert p.on_load(report(**IDLE, kv_free_blocks=1000)) == ""
    p.decide(req("r"), 0, 1.0)                  # admitted between two idle reports: in flight
    assert p.on_load(report(**IDLE, kv_free_blocks=1000)) == ""
    assert p.on_load(report(running=1, kv_free_blocks=990)) == ""        # busy
