"""The admission policy, exact: each decision and reason from given inputs, the class and
priority rules, the cost estimate (its TTFT: test_ttft.py), the queue's order with aging,
expiry, release, the degrade arithmetic and the KV reservation."""
from __future__ import annotations

import msgspec
import pytest

from components.admission.decision import Kind
from components.costs.estimate import COLD_START, OutputStats
from components.tenancy.bucket import TokenBucket
from schemas.wire import SchedulerLoad
from tests.components.admission.policies import policy, req


# ------------------------------------------------------------------ classes and priority
@pytest.mark.parametrize("tenant_cfg, asked, kind, cls, reason", [
    ({"name": "a"}, None, Kind.ACCEPT, "interactive", "fits"),              # first class = default
    ({"name": "a"}, "batch", Kind.ACCEPT, "batch", "fits"),                 # a lower class: granted
    ({"name": "a", "default_class": "batch"}, "interactive", Kind.REJECT, "", "class_not_allowed"),
    ({"name": "a", "classes": ["bulk"]}, "batch", Kind.REJECT, "", "class_not_allowed"),
    ({"name": "a", "classes": ["batch", "bulk"]}, None, Kind.ACCEPT, "batch", "fits"),
    ({"name": "a"}, "nope", Kind.REJECT, "", "class_not_allowed"),
])
def test_class_granted_by_tenant_policy(tenant_cfg, asked, kind, cls, reason):
    p = policy(tenants=[tenant_cfg])
    d = p.decide(req(cls=asked), 0, 0.0)
    assert (d.kind, d.service_class, d.reason) == (kind, cls, reason)
    if kind == Kind.REJECT:
        assert d.rejected.reason == reason and "class" in d.rejected.message


@pytest.mark.parametrize("asked, expect", [(0, 10), (5, 10), (15, 15)])
def test_priority_comes_from_the_class_and_may_only_be_lowered(asked, expect):
    d = policy().decide(req(cls="batch", priority=asked), 0, 0.0)
    assert d.priority == expect


def test_class_cap_on_max_tokens():
    p = policy()
    assert p.decide(req("x", cls="batch", max_tokens=1000), 0, 0.0).max_tokens == 256
    assert p.decide(req("y", cls="batch", max_tokens=None), 0, 0.0).max_tokens == 256
    assert p.decide(req("z", cls="batch", max_tokens=20), 0, 0.0).max_tokens == 20


def test_no_classes_is_one_default_class_and_fcfs_behaviour():
    p = policy("fcfs", classes=[], tenants=[{"name": "a", "max_outstanding": 2}],
               max_outstanding=3)
    kinds = [p.decide(req(str(i)), 0, 0.0) for i in range(3)]
    assert [(d.kind, d.service_class) for d in kinds] == \
        [(Kind.ACCEPT, "default"), (Kind.ACCEPT, "default"), (Kind.REJECT, "default")]
    assert kinds[2].reason == "tenant_over_budget" and kinds[2].rejected.retry_after_s >= 1
    assert p.queued == 0                              # fcfs never queues


# ------------------------------------------------------------------ estimate
def test_estimate_uncached_expected_output_and_blocks():
    p = policy()
    d = p.decide(req(prompt=100, max_tokens=60), cached=48, now=0.0)
    est = d.estimate
    assert est.uncached_tokens == 52
    assert est.expected_output == 60                  # cold start: the cap
    assert est.kv_blocks == 7                         # ceil((52 + 60) / 16)
    assert est.deadline_ms == 1000                    # the class's TTFT SLO


def test_expected_output_is_a_percentile_after_cold_start():
    stats = OutputStats(percentile=90)
    for _ in range(COLD_START - 1):
        stats.observe("a", "c", 10)
    assert stats.expected("a", "c", 500, 500) == 500   # still cold
    stats.observe("a", "c", 10)
    assert stats.expected("a", "c", 500, 500) == 10
    for v in (20, 30, 40, 50, 60, 70, 80, 90, 100, 110):
        stats.observe("a", "c", v)
    assert stats.expected("a", "c", 500, 500) == 100   # p90 of 18 outputs: the 17th
    assert stats.expected("a", "c", 64, 500) == 64     # capped by max_tokens
    assert stats.expected("b", "c", None, 77) == 77    # another tenant: cold


def test_released_outputs_teach_the_estimate():
    p = policy()
    for i in range(COLD_START):
        assert p.decide(req(str(i), max_tokens=50), 0, 0.0).kind == Kind.ACCEPT
    p.released([str(i) for i in range(COLD_START)], 1.0,
               {str(i): 20 for i in range(COLD_START)})
    assert p.decide(req("next", max_tokens=500), 0, 1.0).estimate.expected_output == 20


# ------------------------------------------------------------------ decisions
def test_deadline_unmeetable_rejects_at_once_with_retry_after():
    p = policy()
    p.ttft.load = SchedulerLoad(4, 2, 4000, 1000.0, 0.05)   # 4 s of prefill queued
    d = p.decide(req(cls="interactive"), 0, 0.0)
    assert (d.kind, d.reason) == (Kind.REJECT, "deadline_unmeetable")
    assert d.rejected.retry_after_s == pytest.approx(4.082 - 1.0, abs=0.1)
    own = p.decide(req("own", cls="batch", deadline=10_000), 0, 0.0)   # its own deadline
    assert own.kind == Kind.ACCEPT


def test_a_prompt_is_never_refused_for_its_own_size_only_for_the_wait():
    """A class target below what the prompt alone takes here is stretched to that prefill
    plus half the target (interactive: 1000 ms; 1000 prompt tokens/s, nothing ahead)."""
    p = policy(num_blocks=4096)
    p.ttft.load = SchedulerLoad(0, 0, 0, 1000.0, 0.05)
    short = p.decide(req("short", prompt=100, max_tokens=8, cls="interactive"), 0, 0.0)
    assert short.estimate.deadline_ms == 1000          # 0.1 s alone: the class's target
    long = p.decide(req("long", prompt=900, max_tokens=8, cls="interactive"), 0, 0.0)
    assert long.estimate.deadline_ms == pytest.approx(500 + 900)
    assert long.kind == Kind.ACCEPT                          # 0.95 s predicted, 1.12 s allowed
    p.ttft.load = SchedulerLoad(4, 2, 2000, 1000.0, 0.05)   # now 2 s of prefill is ahead
    behind = p.decide(req("behind", prompt=900, max_tokens=8, cls="interactive"), 0, 0.0)
    assert (behind.kind, behind.reason) == (Kind.REJECT, "deadline_unmeetable")
    own = p.decide(req("own", prompt=900, max_tokens=8, cls="interactive", deadline=800),
                   0, 0.0)
    assert own.estimate.deadline_ms == 800              # a client's own deadline is its own


def test_reservation_decides_accept_then_queue():
    p = policy(num_blocks=10)
    first = p.decide(req("1", prompt=64, max_tokens=64), 0, 0.0)      # 8 blocks
    assert first.kind == Kind.ACCEPT and p.ledger.reserved_blocks == 8
    second = p.decide(req("2", prompt=32, max_tokens=32), 0, 0.0)     # 4 more: no room
    assert (second.kind, second.reason) == (Kind.QUEUE, "waiting_for_kv")
    assert p.queued == 1 and p.queue_position("2") == 0
    assert p.release(0.1) == []                                        # still no room
    p.released(["1"], 0.2)
    (released,) = p.release(0.2)
    assert released[0].request_id == "2" and released[2] == pytest.approx(0.2)
    assert p.ledger.reserved_blocks == 4 and p.queued == 0


def test_class_that_does_not_queue_is_rejected_overloaded():
    p = policy(num_blocks=10)
    p.decide(req("1", prompt=64, max_tokens=64), 0, 0.0)
    d = p.decide(req("2", cls="bulk", prompt=32, max_tokens=32), 0, 0.0)
    assert (d.kind, d.reason) == (Kind.REJECT, "overloaded")


def test_queue_full_per_tenant_and_in_total():
    p = policy(num_blocks=4, tenants=[{"name": "a", "max_queued": 2}, {"name": "b"}],
               max_queued=3)
    p.decide(req("0", prompt=32, max_tokens=32), 0, 0.0)               # fills the pool
    kinds = [p.decide(req(str(i), prompt=32, max_tokens=32), 0, 0.0).reason
             for i in (1, 2, 3)]
    assert kinds == ["waiting_for_kv", "waiting_for_kv", "queue_full"]
    assert p.decide(req("b1", "b", prompt=32, max_tokens=32), 0, 0.0).kind == Kind.QUEUE
    assert p.decide(req("b2", "b", prompt=32, max_tokens=32), 0, 0.0).reason == "queue_full"


def test_degrade_lowers_max_tokens_to_what_fits():
    p = policy(num_blocks=10)
    p.decide(req("1", prompt=64, max_tokens=32), 0, 0.0)               # 6 blocks reserved
    d = p.decide(req("2", cls="batch", prompt=32, max_tokens=100), 0, 0.0)
    # 4 blocks left = 64 tokens; the prompt takes 32, so 32 output tokens fit
    assert (d.kind, d.max_tokens, d.reason) == (Kind.DEGRADE, 32, "kv_capacity")
    assert d.estimate.kv_blocks == 4 and p.ledger.reserved_blocks == 10


def test_a_degraded_request_does_not_speculate_an_accepted_one_may():
    """The first seed's degrade options include turning speculative decoding off: the
    admitted header carries ``speculate`` False for a degraded request, which the
    scheduler's k rule then leaves at 0 (components/scheduler/speculation.py)."""
    p = policy(num_blocks=10)
    r1 = req("1", prompt=64, max_tokens=32)
    d1 = p.decide(r1, 0, 0.0)
    r2 = req("2", cls="batch", prompt=32, max_tokens=100)
    d2 = p.decide(r2, 0, 0.0)
    assert (d1.kind, d2.kind) == (Kind.ACCEPT, Kind.DEGRADE)
    assert p.admitted(r1, d1).header.speculate is True
    assert p.admitted(r2, d2).header.speculate is False


def test_degrade_never_below_min_max_tokens():
    p = policy(num_blocks=10)
    p.decide(req("1", prompt=64, max_tokens=64), 0, 0.0)               # 8 of 10 blocks
    d = p.decide(req("2", cls="batch", prompt=30, max_tokens=100), 0, 0.0)
    # 2 blocks = 32 tokens: 2 output tokens would fit, below min_max_tokens (8): queued
    assert d.kind == Kind.QUEUE


def test_tenant_kv_budget():
    p = policy(tenants=[{"name": "a", "kv_blocks": 6}])
    assert p.decide(req("big", prompt=100, max_tokens=32, cls="interactive"), 0, 0.0).reason \
        == "tenant_kv_budget"                                          # 9 blocks > 6 alone
    assert p.decide(req("1", prompt=48, max_tokens=16), 0, 0.0).kind == Kind.ACCEPT   # 4 blocks
    assert p.decide(req("2", prompt=48, max_tokens=16), 0, 0.0).reason == \
        "waiting_for_tenant_kv"


def test_token_bucket_rejects_with_the_wait_then_refills():
    p = policy(tenants=[{"name": "a", "token_rate": 100, "token_burst": 200}])
    assert p.decide(req("1", prompt=100, max_tokens=50), 0, 0.0).kind == Kind.ACCEPT  # 150 of 200
    d = p.decide(req("2", prompt=100, max_tokens=50), 0, 0.0)
    assert (d.kind, d.reason) == (Kind.REJECT, "tenant_token_budget")
    assert d.rejected.retry_after_s == pytest.approx(1.0)              # 100 short at 100/s
    assert p.decide(req("3", prompt=100, max_tokens=50), 0, 1.0).kind == Kind.ACCEPT


def test_token_bucket_degrades_a_class_that_may():
    p = policy(tenants=[{"name": "a", "token_rate": 100, "token_burst": 200}])
    p.decide(req("1", prompt=100, max_tokens=50), 0, 0.0)               # 50 left
    d = p.decide(req("2", cls="batch", prompt=20, max_tokens=100), 0, 0.0)
    assert (d.kind, d.max_tokens, d.reason) == (Kind.DEGRADE, 30, "tenant_token_budget")


def test_running_cap_counts_n():
    p = policy(tenants=[{"name": "a", "max_running": 4}])
    assert p.decide(req("1", n=3), 0, 0.0).kind == Kind.ACCEPT
    assert p.decide(req("2", n=2), 0, 0.0).reason == "waiting_for_tenant_running"
    assert p.decide(req("3", n=1), 0, 0.0).kind == Kind.ACCEPT


def test_the_admitted_message_carries_what_the_scheduler_acts_on():
    """What the admission service and the simulator both hand the scheduler: the cap
    decided on, the deadline (the class's where the client set none), the class's aging,
    its late rule, the ledger entry and the time queued."""
    p = policy(tenants=[{"name": "a", "kv_blocks": 4}])
    inter = req("i", prompt=10, max_tokens=8)
    msg = p.admitted(inter, p.decide(inter, 0, 0.0), 0.25)
    h = msg.header
    assert (h.asked_class, h.granted_class, h.priority, h.ttft_deadline_ns, h.tpot_slo_ms,
            msg.drop_late, msg.aging_per_s) == (None, "interactive", 0, 1_000_000_000, None,
                                               True, 0.0)
    assert msg.header == msgspec.structs.replace(
        inter.header, granted_class="interactive", ttft_deadline_ns=1_000_000_000)
    assert msg.held == p.ledger.entry("i") and msg.queued_ns == 250_000_000
    assert msg.params.max_tokens == 8 and msg.prompt_token_ids == inter.prompt_token_ids
    batch = req("b", prompt=10, max_tokens=64, cls="batch")
    d = p.decide(batch, 0, 0.0)
    msg = p.admitted(batch, d, 0.0)
    assert (d.kind, msg.params.max_tokens) == (Kind.DEGRADE, 22)      # what 2 blocks left hold
    assert (msg.header.ttft_deadline_ns, msg.drop_late, msg.aging_per_s) == (None, False, 1.0)
    assert (msg.header.asked_class, msg.header.granted_class) == ("batch", "batch")
    own = req("own", prompt=10, max_tokens=8, deadline=200)
    fcfs = policy("fcfs")
    assert not fcfs.admitted(own, fcfs.decide(own, 0, 0.0)).drop_late    # fcfs drops nothing


# ------------------------------------------------------------------ queue order and expiry
def test_queue_order_priority_then_deadline_with_aging():
    p = policy(num_blocks=4)
    p.decide(req("fill", prompt=32, max_tokens=32), 0, 0.0)            # the pool is full
    p.decide(req("batch", cls="batch", prompt=32, max_tokens=32), 0, 0.0)
    p.decide(req("late", cls="interactive", prompt=32, max_tokens=32, deadline=900), 0, 0.1)
    p.decide(req("early", cls="interactive", prompt=32, max_tokens=32, deadline=300), 0, 0.1)
    p.queue.in_order(0.2)
    # interactive (priority 0) before batch (10); within it, the earlier deadline first
    assert [p.queue_position(r) for r in ("early", "late", "batch")] == [0, 1, 2]
    # aging earns whole units, as the scheduler's: after 10.5 s at 1/s batch ranks with
    # the interactive ones (10 - 10 = 0), after their deadlines; after 11 s (10 - 11 < 0)
    # it is ahead of them (they would have expired by then; the order alone is checked)
    p.queue.in_order(10.5)
    assert p.queue_position("batch") == 2
    p.queue.in_order(11.0)
    assert p.queue_position("batch") == 0


def test_expiry_at_deadline_or_max_queue():
    p = policy(num_blocks=4)
    p.decide(req("fill", prompt=32, max_tokens=32), 0, 0.0)
    p.decide(req("i", cls="interactive", prompt=32, max_tokens=32), 0, 0.0)   # max 500 ms
    p.decide(req("d", cls="batch", prompt=32, max_tokens=32, deadline=200), 0, 0.0)
    assert p.expire(0.1) == []
    (first,) = p.expire(0.2)
    assert (first.request_id, first.reason) == ("d", "deadline_expired")
    (second,) = p.expire(0.5)
    assert second.request_id == "i"
    assert p.queued == 0 and p.rejections["deadline_expired", "interactive"] == 1


def test_cancel_removes_a_queued_request():
    p = policy(num_blocks=4)
    p.decide(req("fill", prompt=32, max_tokens=32), 0, 0.0)
    p.decide(req("q", cls="batch", prompt=32, max_tokens=32), 0, 0.0)
    assert p.cancel("q") and not p.cancel("q")
    p.released(["fill"], 1.0)
    assert p.release(1.0) == [] and len(p.ledger) == 0


def test_head_of_queue_is_not_jumped():
    p = policy(num_blocks=6)
    p.decide(req("fill", prompt=64, max_tokens=16), 0, 0.0)             # 5 blocks
    p.decide(req("big", cls="batch", prompt=64, max_tokens=16), 0, 0.0)  # queued, needs 5
    small = p.decide(req("small", cls="batch", prompt=8, max_tokens=8), 0, 0.1)
    assert (small.kind, small.reason) == (Kind.QUEUE, "waiting_for_queue")   # fits, but behind
    assert [d.request_id for d, *_ in p.release(0.2)] == []              # big is first
    p.released(["fill"], 0.3)
    assert [d.request_id for d, *_ in p.release(0.3)] == ["big", "small"]


def test_token_bucket_arithmetic():
    b = TokenBucket(rate=10, burst=0, now=0.0)       # burst defaults to one second of rate
    assert b.level == 10
    b.take(15, 0.0)
    assert b.wait_s(10, 0.0) == pytest.approx(1.5)
    assert b.refill(1.0) == pytest.approx(5)
    assert b.refill(100.0) == 10


def test_a_queued_request_that_fits_only_degraded_starts_degraded():
    # the tenant's budget (3 blocks) holds one degraded request; the second waits, and
    # starts degraded when the first is released (it would never fit at full size)
    p = policy(tenants=[{"name": "a", "kv_blocks": 3}])
    first = p.decide(req("1", cls="batch", prompt=10, max_tokens=64), 0, 0.0)
    assert (first.kind, first.max_tokens) == (Kind.DEGRADE, 38)       # 3 blocks = 48 tokens
    second = p.decide(req("2", cls="batch", prompt=10, max_tokens=64), 0, 0.0)
    assert second.kind == Kind.QUEUE
    p.released(["1"], 1.0)
    ((tok, d, waited),) = p.release(1.0)
    assert (tok.request_id, d.kind, d.max_tokens) == ("2", Kind.DEGRADE, 38)
    assert p.ledger.tenant_blocks("a") == 3


def test_beyond_deadline_even_fully_cached_needs_no_cache_lookup():
    """Interactive: 1000 ms less 20% headroom (a 900-token prompt's, alone 0.9 s here:
    1400 ms). 1000 prefill tokens/s, 50 ms a decode step, 300 tokens ahead: a 900-token
    prompt predicts 1.25 s uncached, 0.45 s with 800 tokens cached."""
    p = policy(num_blocks=1000)
    assert not p.beyond_deadline(req(prompt=900), 800)      # unknown rates: nothing to say
    p.ttft.on_load(SchedulerLoad(0, 0, 300, 1000.0, 0.05))
    assert p.beyond_deadline(req(prompt=900), 0)
    assert not p.beyond_deadline(req(prompt=900), 800)      # its cached prefix might save it
    assert not p.beyond_deadline(req(prompt=900, cls="batch"), 0)         # no TTFT deadline
    assert p.beyond_deadline(req(prompt=100, deadline=100), 0)            # its own deadline
    assert not p.beyond_deadline(req(prompt=900, tenant="nobody"), 0)     # decide() says why
    assert not policy("fcfs").beyond_deadline(req(prompt=900), 0)
    d = p.decide(req(prompt=900), 0, 0.0)                   # what decide() then says
    assert (d.kind, d.reason) == (Kind.REJECT, "deadline_unmeetable")


def test_queue_releases_the_least_served_tenant_first():
    # a holds the pool and has three more queued; b queues one later, lifted to a's counter
    # (idle time earns no credit). Each release charges the tenant, so b's request goes
    # second, not after all of a's (FIFO would give a0, a1, a2, b0)
    p = policy(num_blocks=4)
    assert p.decide(req("fill", "a", prompt=32, max_tokens=32), 0, 0.0).kind == Kind.ACCEPT
    for i in range(3):
        assert p.decide(req(f"a{i}", "a", cls="batch", prompt=32, max_tokens=32), 0,
                        0.1).kind == Kind.QUEUE
    assert p.decide(req("b0", "b", cls="batch", prompt=32, max_tokens=32), 0, 0.2).kind \
        == Kind.QUEUE
    assert p.vtc.of("b") == p.vtc.of("a") == 32 + 2 * 32
    order, running = [], "fill"
    for t in range(4):
        p.released([running], 1.0 + t)
        ((tok, _, _),) = p.release(1.0 + t)
        order.append(running := tok.request_id)
    assert order == ["a0", "b0", "a1", "a2"]


def test_class_first_across_tenants_as_the_scheduler_orders():
    """a was served more (192 against b's 96), and b's batch request waits for the pool.
    An interactive request of a that fits starts at once: it ranks before b's batch work
    (class first), so it does not queue behind it as VTC-first order had it. One that
    does not fit queues ahead of b's batch, and is released first."""
    p = policy(num_blocks=10)
    assert p.decide(req("a_run", "a", prompt=64, max_tokens=64), 0, 0.0).kind == Kind.ACCEPT
    p.released(["a_run"], 0.1)
    assert p.decide(req("b_run", "b"), 0, 0.2).kind == Kind.ACCEPT                  # 4 blocks
    assert p.decide(req("b_big", "b", cls="batch", prompt=90, max_tokens=64), 0,
                    0.3).reason == "waiting_for_kv"                             # 10 blocks
    assert (p.vtc.of("a"), p.vtc.of("b")) == (192, 96)
    assert p.decide(req("a1", "a", prompt=16, max_tokens=16), 0, 0.4).reason == "fits"
    assert p.decide(req("a2", "a", prompt=64, max_tokens=32), 0,
                    0.45).reason == "waiting_for_kv"                            # 6 blocks
    p.queue.in_order(0.45)
    assert [p.queue_position(r) for r in ("a2", "b_big")] == [0, 1]
    p.released(["b_run", "a1"], 0.5)
    assert [tok.request_id for tok, *_ in p.release(0.5)] == ["a2"]   # b_big: 6 + 10 > 10


# ------------------------------------------------------------------ release past a tenant's cap
@pytest.mark.parametrize("cap, blocker, then", [
    ({"kv_blocks": 6}, "tenant_kv", ["a1", "a2"]),          # a2 fits a's budget beside a1
    ({"max_running": 1}, "tenant_running", ["a1"]),
    ({"max_outstanding": 1}, "tenant_cap", ["a1"]),
])
def test_a_tenant_at_its_own_cap_does_not_hold_back_another_tenant(cap, blocker, then):
    # a, b and c each run a 4-block request (counters 96), filling the pool. a queues a1
    # (held by a's cap) and a2 (1 block, held by the full pool); b queues b1 (its running
    # cap), after them in order (tied counters; a1 and a2 came first). When c's and b's
    # runs end, b1 starts: a1, held by a's own cap, is passed over, and so is a's later a2,
    # though it would fit. When a's run ends, a's requests start in a's order
    p = policy(num_blocks=12, tenants=[{"name": "a", **cap}, {"name": "b", "max_running": 1},
                                       {"name": "c"}])
    for t in "abc":
        assert p.decide(req(f"{t}_run", t), 0, 0.0).kind == Kind.ACCEPT
    assert p.decide(req("a1", "a"), 0, 0.1).reason == f"waiting_for_{blocker}"
    a2 = p.decide(req("a2", "a", prompt=8, max_tokens=8), 0, 0.2).reason
    assert a2 == ("waiting_for_kv" if blocker == "tenant_kv" else f"waiting_for_{blocker}")
    assert p.decide(req("b1", "b", prompt=8, max_tokens=8), 0, 0.3).reason == \
        "waiting_for_tenant_running"
    assert p.vtc.of("a") == p.vtc.of("b") == 96
    assert [p.queue_position(r) for r in ("a1", "a2", "b1")] == [0, 1, 2]
    p.released(["c_run", "b_run"], 0.35)
    assert [tok.request_id for tok, *_ in p.release(0.35)] == ["b1"]
    assert [p.queue_position(r) for r in ("a1", "a2")] == [0, 1]
    p.released(["a_run"], 0.4)
    assert [tok.request_id for tok, *_ in p.release(0.4)] == then


def test_a_request_waiting_for_the_engine_still_holds_the_line_past_a_capped_tenant():
    # a (max_outstanding 1) runs a 1-block request and queues a1; b and c run 8 blocks each
    # (3 of 20 left). b1 (4 blocks) waits for the pool; c1 (1 block) fits, but b1 is ahead
    # of it (a1, held by a's own cap, is passed over), so c1 queues rather than take the
    # blocks b1 waits for; a release stops at b1 until the pool has room for it
    p = policy(num_blocks=20, tenants=[{"name": "a", "max_outstanding": 1}, {"name": "b"},
                                       {"name": "c"}])
    assert p.decide(req("a_run", "a", prompt=8, max_tokens=8), 0, 0.0).kind == Kind.ACCEPT
    for t in "bc":
        assert p.decide(req(f"{t}_run", t, prompt=64, max_tokens=64), 0, 0.0).kind == Kind.ACCEPT
    assert p.decide(req("a1", "a", prompt=8, max_tokens=8), 0, 0.1).reason == \
        "waiting_for_tenant_cap"
    assert p.decide(req("b1", "b"), 0, 0.2).reason == "waiting_for_kv"
    assert p.decide(req("c1", "c", prompt=8, max_tokens=8), 0, 0.3).reason == \
        "waiting_for_queue"
    assert [p.queue_position(r) for r in ("a1", "b1", "c1")] == [0, 1, 2]
    assert p.release(0.35) == []
    p.released(["c_run"], 0.4)
    assert [tok.request_id for tok, *_ in p.release(0.4)] == ["b1", "c1"]
    p.released(["a_run"], 0.45)
    assert [tok.request_id for tok, *_ in p.release(0.45)] == ["a1"]


# ------------------------------------------------------------------ the queue's lift
def test_a_tenant_with_admitted_work_but_nothing_queued_is_lifted():
    # a runs a 1-block request (counter 16) and has nothing queued; b runs 4 blocks (96),
    # filling the pool, and queues b1. When a queues a1 it becomes backlogged: lifted to
    # b's 96 (running work earns no credit), so b1, queued first, goes first
    p = policy(num_blocks=5)
    assert p.decide(req("a_run", "a", prompt=8, max_tokens=4), 0, 0.0).kind == Kind.ACCEPT
    assert p.decide(req("b_run", "b"), 0, 0.0).kind == Kind.ACCEPT
    assert p.decide(req("b1", "b"), 0, 0.1).reason == "waiting_for_kv"
    assert (p.vtc.of("a"), p.vtc.of("b")) == (16, 96)
    assert p.decide(req("a1", "a"), 0, 0.2).reason == "waiting_for_kv"
    assert p.vtc.of("a") == 96
    assert [p.queue_position(r) for r in ("b1", "a1")] == [0, 1]


def test_the_lift_floor_is_the_least_counter_among_tenants_with_queued_requests():
    # c runs a request (counter 16) with nothing queued: it is not backlogged, so its
    # counter is not the floor; a, idle, is lifted to b's 96 (b has b1 queued), not to 16
    p = policy(num_blocks=5, tenants=[{"name": "a"}, {"name": "b"}, {"name": "c"}])
    assert p.decide(req("c_run", "c", prompt=8, max_tokens=4), 0, 0.0).kind == Kind.ACCEPT
    assert p.decide(req("b_run", "b"), 0, 0.0).kind == Kind.ACCEPT
    assert p.decide(req("b1", "b"), 0, 0.1).reason == "waiting_for_kv"
    assert p.decide(req("a1", "a"), 0, 0.2).reason == "waiting_for_kv"
    assert (p.vtc.of("a"), p.vtc.of("b"), p.vtc.of("c")) == (96, 96, 16)
