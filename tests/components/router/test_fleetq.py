"""The fleet queue (components/router/fleetq.py), pure: VTC order across tenants with the
lift of a newly backlogged tenant, the charge by what terminals report, the bounds, the
deadline-aware refusals and the exits (release, remove, expiring), each exactly once."""
from components.router.fleetq import FleetQueue
from schemas.config import TenantConfig


def queue(max_held: int = 100, **tenants: dict) -> FleetQueue:
    return FleetQueue([TenantConfig(name, **kw) for name, kw in tenants.items()], max_held)


def drain(q: FleetQueue, now: float = 1.0) -> list[str]:
    out = []
    while (h := q.head()) is not None:
        out.append(q.release(h.request_id, now).request_id)
    return out


def test_least_served_tenant_first_then_arrival():
    q = queue()
    q.placed("old", "flood", 300)          # flood was served 300 input tokens
    for i in range(3):
        assert q.offer(f"f{i}", "flood", 10, 0.0, 60.0) is None
    assert q.offer("l0", "light", 10, 0.0, 60.0) is None
    # light was never served but is lifted to flood's 300 on becoming backlogged: the tie
    # goes to flood's earlier head; then flood is at 310 and light (300) goes
    assert q.vtc.of("light") == 300.0
    assert drain(q) == ["f0", "l0", "f1", "f2"]
    assert q.vtc.of("flood") == 330.0 and q.vtc.of("light") == 310.0


def test_a_flood_does_not_hold_a_light_tenant_behind_all_of_it():
    q = queue()
    for i in range(50):
        q.offer(f"f{i}", "flood", 10, 0.0, 60.0)
    q.offer("l0", "light", 10, 0.0, 60.0)
    q.offer("l1", "light", 10, 0.0, 60.0)
    order = drain(q)
    # both tenants start level: they alternate while both are backlogged
    assert order[:5] == ["f0", "l0", "f1", "l1", "f2"]


def test_weights_divide_the_charge():
    q = queue(flood={}, gold={"weight": 3.0})
    for i in range(8):
        q.offer(f"f{i}", "flood", 10, 0.0, 60.0)
        q.offer(f"g{i}", "gold", 10, 0.0, 60.0)
    order = drain(q)[:8]
    # each gold release costs it 10/3: three golds per flood
    assert order == ["f0", "g0", "g1", "g2", "f1", "g3", "g4", "g5"]


def test_idle_time_is_not_banked():
    q = queue()
    q.placed("a", "busy", 1000)
    q.offer("b0", "busy", 10, 0.0, 60.0)
    assert q.vtc.of("idle") == 0.0
    q.offer("i0", "idle", 10, 0.0, 60.0)      # lifted to the least backlogged counter
    assert q.vtc.of("idle") == 1000.0
    drain(q)
    # none backlogged: a tenant joining is lifted to the last released tenant's counter
    assert q.vtc.of("busy") == 1010.0 and q.vtc.of("idle") == 1010.0
    q.offer("late", "third", 10, 2.0, 60.0)
    assert q.vtc.of("third") == 1010.0
    # the lift never lowers a counter
    q.placed("x", "rich", 5000)
    q.offer("r0", "rich", 10, 2.0, 60.0)
    assert q.vtc.of("rich") == 5000.0


def test_terminals_set_the_charge_to_what_was_used():
    q = queue()
    q.placed("a", "t", 100)
    q.placed("a", "t", 100)                   # placed once only
    assert q.vtc.of("t") == 100.0
    q.ended("a", (100, 40))                   # prompt 100 + 2 x 40 output
    assert q.vtc.of("t") == 180.0
    q.ended("a", (100, 40))                   # a repeated terminal changes nothing
    assert q.vtc.of("t") == 180.0
    q.placed("b", "t", 50)
    q.ended("b", (0, 0))                      # refused by its replica: never ran
    assert q.vtc.of("t") == 180.0
    q.placed("c", "t", 50)
    q.ended("c", None)                        # failed or cancelled: the prompt stays
    assert q.vtc.of("t") == 230.0 and not q.charged


def test_bounds_per_tenant_and_in_all():
    q = queue(max_held=5, small={"max_queued": 2})
    assert q.offer("s0", "small", 1, 0.0, 60.0) is None
    assert q.offer("s1", "small", 1, 0.0, 60.0) is None
    no = q.offer("s2", "small", 1, 0.0, 60.0)
    assert no is not None and no.reason == "queue_full" and "tenant's share" in no.message
    assert 1.0 <= no.retry_after_s <= 60.0
    for i in range(3):
        assert q.offer(f"o{i}", "other", 1, 0.0, 60.0) is None
    no = q.offer("o3", "other", 1, 0.0, 60.0)
    assert no is not None and no.reason == "queue_full" and "5 held" in no.message
    assert len(q) == 5 and "s2" not in q and "o3" not in q
    assert q.counts["refused.queue_full"] == 2


def test_a_deadline_the_queue_cannot_meet_is_refused_at_once():
    q = queue()
    for i in range(10):
        q.offer(f"f{i}", "flood", 10, 0.0, 60.0)
    # no release yet: the wait cannot be told, the request is held
    assert q.offer("x", "flood", 10, 0.0, 0.5) is None
    q.remove("x")
    # two releases 0.5 s apart: 4 per second
    q.release(q.head().request_id, 1.0)
    q.release(q.head().request_id, 1.5)
    assert q.releases.rate(1.5) == 4.0
    # flood has 8 held ahead of a new flood request: 2 s; its deadline is 1 s away
    no = q.offer("late", "flood", 10, 1.5, 2.5)
    assert no is not None and no.reason == "deadline_unmeetable"
    assert no.retry_after_s == 2.0 and "8 requests are held ahead" in no.message
    # a light tenant, lifted to flood's counter, has only flood's head-of-line ahead of it
    # at an equal counter, none at a smaller one: its wait is 0 and it is held
    assert q.ahead("light") == 0
    assert q.offer("l0", "light", 10, 1.5, 2.5) is None
    assert q.counts["refused.deadline"] == 1


def test_expiring_takes_out_those_the_next_release_could_not_place_in_time():
    q = queue()
    q.offer("soon", "t", 1000, 0.0, 1.0)     # 1000 prompt tokens at 2000/s: 0.5 s
    q.offer("later", "t", 10, 0.0, 5.0)
    assert q.expiring(0.2, 0.25, 2000.0) == []
    gone = q.expiring(0.3, 0.25, 2000.0)     # 0.3 + 0.25 + 0.5 > 1.0
    assert [h.request_id for h in gone] == ["soon"]
    assert "soon" not in q and q.head().request_id == "later"
    assert q.expiring(0.3, 0.25, 2000.0) == []   # out once


def test_remove_and_release_each_end_a_request_once():
    q = queue()
    q.offer("a", "t", 10, 0.0, 60.0)
    q.offer("b", "t", 10, 0.0, 60.0)
    assert q.remove("a").request_id == "a"
    assert q.remove("a") is None
    assert q.head().request_id == "b"
    q.release("b", 2.0)
    assert q.head() is None and len(q) == 0 and not q.queues
    assert q.remove("b") is None
    assert q.counts == {"held": 2, "removed": 1, "released": 1}
    assert list(q.waits) == [2.0]


def test_stats():
    q = queue(flood={})
    q.offer("a", "flood", 10, 0.0, 60.0)
    q.offer("b", "flood", 10, 0.5, 60.0)
    q.release("a", 1.0)
    s = q.stats(2.0)
    assert s["fleetq.depth"] == 1 and s["fleetq.depth.flood"] == 1
    assert s["fleetq.counter.flood"] == 10.0
    assert s["fleetq.wait_ms.p50"] == 1000.0 and s["fleetq.oldest_ms"] == 1500.0
    assert s["fleetq.held"] == 2 and s["fleetq.released"] == 1


def test_the_least_served_tenant_passes_and_the_over_served_is_held():
    q = queue()
    assert q.passes("flood")                 # alone: nothing to be fair between
    q.placed("f0", "flood", 300)             # flood has 300 in flight
    # light has none: lifted to flood's 300, the least served (a tie), so it passes
    assert q.passes("light") and q.vtc.of("light") == 300.0
    q.placed("l0", "light", 10)              # light 310 in flight, flood 300
    assert q.passes("flood") and not q.passes("light")
    q.placed("f1", "flood", 300)             # flood 600: light is the least served again
    assert q.passes("light") and not q.passes("flood")
    # a tenant with a request held never passes it (its own arrive in order)
    assert q.offer("l1", "light", 10, 0.0, 60.0) is None
    assert not q.passes("light")
    assert q.counts["passed"] == 4


def test_a_lift_never_lowers_a_counter_and_an_idle_tenant_banks_nothing():
    q = queue()
    q.placed("a0", "a", 1000)
    q.ended("a0", (1000, 0))                 # a served 1000, now idle
    q.placed("b0", "b", 10)                  # b active at 10
    assert not q.passes("a")                 # a's 1000 stays: above b's 10
    assert q.vtc.of("a") == 1000.0
    q.placed("b1", "b", 2000)                # b at 2010: a, idle, is lifted to it (its
    assert q.passes("a") and q.vtc.of("a") == 2010.0     # idle time banks nothing): a tie
    q.ended("b0", (10, 0))
    q.ended("b1", (2000, 0))                 # nobody in flight: a passes alone
    assert q.passes("a")


def test_new_weights_and_bounds_carry_over_what_is_held():
    """A live config change (retune): what is held stays held and in order; each counter
    keeps its value and is charged at the new weight; a smaller bound refuses new requests
    until the queue is under it."""
    q = queue(max_held=10, heavy={"weight": 1.0, "max_queued": 8})
    q.placed("p0", "heavy", 100)
    for i in range(3):
        assert q.offer(f"h{i}", "heavy", 10, 0.0, 60.0) is None
    q.retune([TenantConfig("heavy", weight=4.0, max_queued=2)], max_held=2)
    assert len(q) == 3 and q.vtc.of("heavy") == 100.0
    refused = q.offer("h3", "heavy", 10, 0.0, 60.0)
    assert refused is not None and refused.reason == "queue_full"
    assert drain(q) == ["h0", "h1", "h2"]
    assert q.vtc.of("heavy") == 100.0 + 3 * 10 / 4.0
    assert q.offer("h4", "heavy", 10, 1.0, 60.0) is None and q.limit("heavy") == 2
