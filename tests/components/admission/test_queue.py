"""Admission's queue (components/admission/queue.py), exact: the order across tenants by
their virtual counters and within one by aged priority, deadline and arrival; expiry in
arrival order; a tenant's first queued request lifted to the counters of those waiting."""
from __future__ import annotations

from dataclasses import dataclass

from components.admission.queue import AdmissionQueue
from components.scheduler.fairness import VirtualCounters
from tests.components.admission.policies import req


@dataclass
class Held:                       # what the queue reads of a policy's Decision
    priority: int
    service_class: str = "batch"


def ids(items) -> list[str]:
    return [q.request_id for q in items]


def test_within_a_tenant_priority_then_deadline_then_arrival():
    q = AdmissionQueue(VirtualCounters())
    q.add(req("late_deadline"), Held(5), 0.0, now=0.0, deadline_at=9.0)
    q.add(req("low"), Held(10), 0.0, now=0.1, deadline_at=1.0)
    q.add(req("early_deadline"), Held(5), 0.0, now=0.2, deadline_at=2.0)
    q.add(req("same_but_later"), Held(5), 0.0, now=0.3, deadline_at=2.0)
    assert ids(q.in_order(1.0)) == ["early_deadline", "same_but_later", "late_deadline", "low"]
    assert [q.position(r) for r in ("low", "early_deadline", "nope")] == [3, 0, -1]


def test_priority_ages_with_time_queued():
    q = AdmissionQueue(VirtualCounters())
    q.add(req("old"), Held(10), 1.0, now=0.0, deadline_at=99.0)     # +1 priority per second
    q.add(req("urgent"), Held(4), 0.0, now=5.0, deadline_at=99.0)
    assert ids(q.in_order(5.0)) == ["urgent", "old"]                # old at 10 - 5 = 5 > 4
    assert ids(q.in_order(6.5)) == ["old", "urgent"]                # 10 - 6.5 = 3.5 < 4
    assert q.position("old") == 0                                   # as last read


def test_across_tenants_the_least_served_first():
    vtc = VirtualCounters()
    q = AdmissionQueue(vtc)
    q.add(req("a1", "a"), Held(0), 0.0, now=0.0, deadline_at=99.0)
    q.add(req("b1", "b"), Held(10), 0.0, now=0.1, deadline_at=99.0)
    assert ids(q.in_order(1.0)) == ["a1", "b1"]                     # tied counters: priority
    vtc.charge("a", 100)
    assert ids(q.in_order(1.0)) == ["b1", "a1"]                     # a was served since


def test_a_tenants_first_queued_request_is_lifted_to_those_waiting():
    vtc = VirtualCounters()
    vtc.charge("a", 300)
    vtc.charge("c", 50)                  # c has admitted work but nothing queued
    q = AdmissionQueue(vtc)
    q.add(req("a1", "a"), Held(0), 0.0, now=0.0, deadline_at=99.0)
    q.add(req("b1", "b"), Held(0), 0.0, now=0.1, deadline_at=99.0)
    assert vtc.of("b") == 300            # idle time earns no credit
    vtc.charge("b", 10)
    q.add(req("b2", "b"), Held(0), 0.0, now=0.2, deadline_at=99.0)
    assert vtc.of("b") == 310            # already waiting: not lifted again
    q.add(req("c1", "c"), Held(0), 0.0, now=0.3, deadline_at=99.0)
    assert vtc.of("c") == 300            # the least of the waiting tenants' counters


def test_expired_leave_in_arrival_order_and_the_rest_stay():
    q = AdmissionQueue(VirtualCounters())
    q.add(req("x"), Held(0), 0.0, now=0.0, deadline_at=2.0)
    q.add(req("y", "b"), Held(0, "interactive"), 0.0, now=0.1, deadline_at=1.0)
    q.add(req("z"), Held(0), 0.0, now=0.2, deadline_at=5.0)
    assert ids(q.expired(0.99)) == []
    assert ids(q.expired(2.0)) == ["x", "y"]
    assert len(q) == 1 and q.count("a") == 1 and q.count("b") == 0
    assert q.depth() == {"batch": 1}
    assert q.remove("z").request_id == "z" and q.remove("z") is None and not q
