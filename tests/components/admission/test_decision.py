"""Admission's decision values, exact: the enums are the strings the wire, spans and stats
carry, what each blocker means for the queue, degrade and a rejection, a rejection's
retry-after, and the deadline rules in milliseconds."""
from __future__ import annotations

import typing

import msgspec

from components.admission.decision import (
    Blocker,
    Decision,
    Estimate,
    Grant,
    Kind,
    due_ns,
    e2e_deadline_ms,
    first_token_bound_ms,
    reject,
    ttft_deadline_ms,
)
from schemas.client import RejectReason
from schemas.config import ServiceClass
from schemas.wire import Rejected, SamplingParams, Tokenized
from tests import messages as msgs


def req(deadline=None, e2e=None, prompt=8, arrival_ns=0) -> Tokenized:
    return msgs.tokenized("r", "a", list(range(prompt)), [], SamplingParams(max_tokens=4),
                          arrival_ns, (), deadline, 0, e2e_deadline_ms=e2e)


def test_the_enums_are_todays_strings():
    assert [str(k) for k in Kind] == ["accept", "degrade", "queue", "reject"]
    assert [str(b) for b in Blocker] == ["engine_cap", "tenant_cap", "tenant_running",
                                         "tenant_kv", "tpot", "kv", "kv_pressure", "queue"]
    assert Kind.QUEUE == "queue" and f"waiting_for_{Blocker.TENANT_KV}" == \
        "waiting_for_tenant_kv"
    assert f"decisions.{Kind.DEGRADE}.batch" == "decisions.degrade.batch"
    # on the wire a member is its string, byte for byte
    assert msgspec.msgpack.encode(Rejected("r", Blocker.KV_PRESSURE, "m")) == \
        msgspec.msgpack.encode(Rejected("r", "kv_pressure", "m"))


def test_what_each_blocker_means():
    own = {b for b in Blocker if b.tenants_own}
    assert own == {Blocker.TENANT_CAP, Blocker.TENANT_RUNNING, Blocker.TENANT_KV}
    assert {b for b in Blocker if b.kv_bound} == {Blocker.KV, Blocker.TENANT_KV,
                                                  Blocker.KV_PRESSURE}
    assert {b: b.rejected_as for b in Blocker} == {
        Blocker.ENGINE_CAP: "overloaded", Blocker.TENANT_CAP: "tenant_over_budget",
        Blocker.TENANT_RUNNING: "tenant_over_budget", Blocker.TENANT_KV: "tenant_over_budget",
        Blocker.TPOT: "tpot_slo_at_risk", Blocker.KV: "overloaded",
        Blocker.KV_PRESSURE: "kv_pressure", Blocker.QUEUE: "overloaded"}
    reasons = set(typing.get_args(RejectReason))
    assert {b.rejected_as for b in Blocker} <= reasons


def test_a_rejection_keeps_its_retry_after_within_bounds_in_tenths():
    assert [reject(req(), "overloaded", "m", after).rejected.retry_after_s
            for after in (None, -3.0, 0.04, 0.26, 12.34, 60.0, 75.0)] == \
        [None, 0.1, 0.1, 0.3, 12.3, 60.0, 60.0]
    d = reject(req(deadline=900, prompt=12), "queue_full", "full", 2.0)
    assert (d.kind, d.reason, d.service_class, d.priority, d.max_tokens) == \
        (Kind.REJECT, "queue_full", "", 0, None)
    assert d.estimate == Estimate(12, 0, 0, None, 900)
    assert d.rejected == Rejected("r", "queue_full", "full", 2.0)
    est = Estimate(4, 16, 2, 0.5, 1000.0)
    d = reject(req(), "tenant_kv_budget", "m", grant=Grant("batch", 10, 64, est))
    assert (d.service_class, d.priority, d.max_tokens, d.estimate) == ("batch", 10, 64, est)
    assert Grant("batch", 10, 64, est).decision(Kind.QUEUE, "waiting_for_kv") == \
        Decision(Kind.QUEUE, "waiting_for_kv", "batch", 10, 64, est)


def test_the_ttft_deadline_is_the_clients_else_its_class_stretched_for_a_long_prompt():
    slo = ServiceClass("interactive", ttft_slo_ms=3000)
    none = ServiceClass("batch")
    assert ttft_deadline_ms(250.0, slo, 10.0) == 250.0          # the client's own, as set
    assert ttft_deadline_ms(None, none, 10.0) is None           # no target: no deadline
    assert ttft_deadline_ms(None, slo, None) == 3000            # no rates yet: the target
    assert ttft_deadline_ms(None, slo, 1.2) == 3000             # 1200 ms < half of 3000
    assert ttft_deadline_ms(None, slo, 1.5) == 3000             # exactly half: no stretch
    assert ttft_deadline_ms(None, slo, 4.0) == 1500 + 4000      # its prefill + half


def test_the_end_to_end_bound_is_the_tighter_and_the_first_token_bound_the_sooner():
    cls = ServiceClass("c", e2e_slo_ms=20_000)
    assert e2e_deadline_ms(req(e2e=5_000), cls) == 5_000          # tightened
    assert e2e_deadline_ms(req(e2e=30_000), cls) == 20_000        # never loosened
    assert e2e_deadline_ms(req(), cls) == 20_000
    assert e2e_deadline_ms(req(), ServiceClass("d")) is None
    assert e2e_deadline_ms(req(e2e=7_000), ServiceClass("d")) == 7_000
    bound = [first_token_bound_ms(Estimate(1, 1, 1, None, ttft, e2e_deadline_ms=e2e))
             for ttft, e2e in ((1000.0, None), (None, 800.0), (1000.0, 800.0),
                               (600.0, 800.0), (None, None))]
    assert bound == [1000.0, 800.0, 800.0, 600.0, None]


def test_the_first_token_is_due_on_the_arrivals_clock_in_whole_milliseconds():
    at = req(arrival_ns=5_000_000_000)
    assert due_ns(at, None) == 0                                  # no deadline
    assert due_ns(at, 1400.0) == 6_400_000_000
    assert due_ns(at, 999.6) == 6_000_000_000                     # rounded to the ms
    assert due_ns(req(), 250.0) == 250_000_000
