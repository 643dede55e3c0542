"""Admission's queue (components/admission/queue.py), exact: the scheduler's order, class
(aged in whole units) first across tenants, then the tenants' virtual counters within a
class, each pick charging its tenant; within a tenant aged class, deadline and arrival;
expiry in arrival order; a tenant's first queued request lifted to the counters of those
waiting."""
from __future__ import annotations

from dataclasses import dataclass

from components.admission.queue import AdmissionQueue
from components.tenancy.fairness import VirtualCounters
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
    assert ids(q.in_order(5.9)) == ["urgent", "old"]                # whole units: 10 - 5
    assert ids(q.in_order(6.5)) == ["old", "urgent"]                # 10 - 6 = 4: queued first
    assert q.position("old") == 0                                   # as last read


def test_across_tenants_class_first_then_the_least_served():
    vtc = VirtualCounters()
    q = AdmissionQueue(vtc)
    q.add(req("a1", "a"), Held(0), 0.0, now=0.0, deadline_at=99.0)
    q.add(req("b1", "b"), Held(10), 0.0, now=0.1, deadline_at=99.0)
    assert ids(q.in_order(1.0)) == ["a1", "b1"]
    vtc.charge("a", 100)
    assert ids(q.in_order(1.0)) == ["a1", "b1"]          # a served more: its class still first
    q.add(req("b2", "b"), Held(0), 0.0, now=0.2, deadline_at=99.0)
    assert ids(q.in_order(1.0)) == ["b2", "a1", "b1"]    # within the class, b is less served


def test_each_pick_charges_its_tenant():
    """a's three requests and b's one, tied counters: read at once, the order alternates
    as the counters would move with each admission (a's 40-token prompt and 10 output
    tokens cost 60), not all of a's first because a was first when the order was read."""
    vtc = VirtualCounters()
    q = AdmissionQueue(vtc)
    for i in range(3):
        q.add(req(f"a{i}", "a"), Held(5), 0.0, now=0.1 * i, deadline_at=99.0, charge=(40, 10))
    q.add(req("b0", "b"), Held(5), 0.0, now=0.5, deadline_at=99.0, charge=(100, 0))
    assert ids(q.in_order(1.0)) == ["a0", "b0", "a1", "a2"]    # b at 100 after its pick
    vtc.charge("b", 70)                                       # b was served meanwhile
    assert ids(q.in_order(1.0)) == ["a0", "a1", "b0", "a2"]   # a at 60, then 120: b (70)
    assert vtc.of("a") == 0                                   # reading charges nobody


def test_a_class_keeps_vtc_order_however_long_each_waited():
    """Aging in whole units: batch (priority 1, a unit a minute) queued 40 s apart by two
    tenants stays one class until a minute has passed, so VTC orders them, not age."""
    vtc = VirtualCounters()
    q = AdmissionQueue(vtc)
    q.add(req("a_old", "a"), Held(1), 1 / 60, now=0.0, deadline_at=999.0)
    q.add(req("b_new", "b"), Held(1), 1 / 60, now=40.0, deadline_at=999.0)
    vtc.charge("a", 500)                                  # a was served meanwhile
    assert ids(q.in_order(50.0)) == ["b_new", "a_old"]    # both still class 1: b served less
    assert ids(q.in_order(60.0)) == ["a_old", "b_new"]    # a_old aged to 0 after a minute


def test_aged_batch_ranks_with_then_ahead_of_interactive_across_tenants():
    """SLO_CLASSES' batch (priority 1, aging 1/60) of a tenant served more: behind another
    tenant's interactive work for its first minute, with it (VTC decides) for the second,
    ahead of it after two: no stream of interactive work starves it."""
    vtc = VirtualCounters()
    q = AdmissionQueue(vtc)
    q.add(req("batch", "a"), Held(1), 1 / 60, now=0.0, deadline_at=999.0)
    q.add(req("inter", "b"), Held(0), 0.0, now=59.0, deadline_at=999.0)
    vtc.charge("a", 1000)
    assert ids(q.in_order(59.5)) == ["inter", "batch"]
    assert ids(q.in_order(60.0)) == ["inter", "batch"]     # one class: b served less
    vtc.charge("b", 2000)
    assert ids(q.in_order(60.0)) == ["batch", "inter"]     # one class: a served less now
    vtc.charge("a", 5000)
    assert ids(q.in_order(119.9)) == ["inter", "batch"]
    assert ids(q.in_order(120.0)) == ["batch", "inter"]    # class -1: ahead of interactive


def test_what_is_ahead_of_a_new_request():
    vtc = VirtualCounters()
    q = AdmissionQueue(vtc)
    q.add(req("a_batch", "a"), Held(1), 0.0, now=0.0, deadline_at=99.0)
    q.add(req("a_inter", "a"), Held(0), 0.0, now=0.1, deadline_at=5.0)
    q.add(req("b_batch", "b"), Held(1), 0.0, now=0.2, deadline_at=99.0)
    vtc.charge("a", 100)
    assert ids(q.ahead_of("c", 0, 99.0, 1.0)) == []            # c served less than a
    vtc.charge("c", 200)
    assert ids(q.ahead_of("c", 0, 99.0, 1.0)) == ["a_inter"]   # and now more: batch after
    assert ids(q.ahead_of("a", 0, 9.0, 1.0)) == ["a_inter"]    # its own, earlier deadline
    assert ids(q.ahead_of("a", 0, 1.0, 1.0)) == []             # its own deadline is earlier
    assert ids(q.ahead_of("b", 1, 99.0, 1.0)) == ["a_inter", "b_batch"]   # a's batch after
    assert len(q) == 3
