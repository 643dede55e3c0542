"""What fits now, exact: a reservation's blocks, the order the blockers are checked in
(engine, then the tenant's caps, then the pool by the ledger, then the live pool), the
room a tenant's reservation has, and the largest max_tokens that fits a room or a token
bucket."""
from __future__ import annotations

from components.admission.capacity import Capacity, TenantBuckets
from components.admission.decision import Blocker, Estimate
from components.admission.ledger import Ledger
from components.admission.live import LiveEngine
from schemas.config import ServiceClass, TenantConfig
from schemas.wire import HeldRequest, SchedulerLoad
from tests.components.admission.policies import policy

A = TenantConfig("a", max_outstanding=3, kv_blocks=40, max_running=4)
BATCH = ServiceClass("batch", may_degrade=True, min_max_tokens=8)


def capacity(max_outstanding=5, num_blocks=100, kv_safety=0.0) -> Capacity:
    """A 100-block pool of 16-token blocks, no watermark, an engine cap of 5."""
    cfg = policy(num_blocks=num_blocks, max_outstanding=max_outstanding,
                 kv_safety=kv_safety).config
    return Capacity(cfg, Ledger(), LiveEngine(cfg))


def est(blocks: int, uncached: int = 32, output: int = 64) -> Estimate:
    return Estimate(uncached, output, blocks, None, None)


def test_a_reservation_is_the_prompt_and_n_outputs_grown_by_the_safety_margin():
    assert capacity().blocks(32, 64, 1) == 6                   # 96 tokens
    assert capacity().blocks(33, 64, 1) == 7
    assert capacity().blocks(32, 64, 3) == 14                  # 224 tokens
    assert capacity(kv_safety=0.5).blocks(32, 64, 1) == 8      # 32 + 96 = 128
    assert capacity().kv_capacity == 100


def test_the_blockers_in_the_order_they_are_checked():
    cap = capacity()
    led = cap.ledger
    assert cap.blocker(A, est(10), 1, "batch") is None
    led.hold(HeldRequest("x", "a", "batch", 3, 35))
    assert cap.blocker(A, est(5), 1, "batch") is None          # 40 of 40, 4 of 4 running
    assert cap.blocker(A, est(6), 1, "batch") == Blocker.TENANT_KV
    assert cap.blocker(A, est(5), 2, "batch") == Blocker.TENANT_RUNNING
    led.hold(HeldRequest("y", "a", "batch", 1, 0))
    led.hold(HeldRequest("z", "a", "batch", 0, 0))
    assert cap.blocker(A, est(1), 5, "batch") == Blocker.TENANT_CAP   # before running
    b = TenantConfig("b")
    assert cap.blocker(b, est(66), 1, "batch") == Blocker.KV     # 35 + 66 > 100
    assert cap.blocker(b, est(65), 1, "batch") is None
    led.hold(HeldRequest("w", "b", "batch", 1, 0))
    led.hold(HeldRequest("v", "b", "batch", 1, 0))
    assert cap.blocker(b, est(1), 1, "batch") == Blocker.ENGINE_CAP    # 5 held, first
    assert cap.blocker(A, est(6), 9, "batch") == Blocker.ENGINE_CAP


def test_the_live_pool_holds_what_the_ledger_would_let_in():
    cap = capacity()
    cap.ledger.hold(HeldRequest("x", "b", "batch", 1, 30))
    b = TenantConfig("b")
    assert cap.room(b) == 70                                   # nothing reported yet
    # 50 free: 50 used, more than the 30 reserved, so nothing is still owed
    cap.live.check(SchedulerLoad(1, 0, 0, 0.0, 0.0, kv_free_blocks=50), 1)
    assert cap.live.kv_room(30) == 50
    cap.live.check(SchedulerLoad(1, 0, 0, 0.0, 0.0, kv_free_blocks=20), 1)
    assert cap.room(b) == 20                                   # 80 used, 30 reserved: none owed
    assert cap.blocker(b, est(20), 1, "batch") is None
    assert cap.blocker(b, est(21), 1, "batch") == Blocker.KV_PRESSURE
    assert "it needs 21 KV blocks; the pool has 20 free, 20 of them" in \
        cap.why(Blocker.KV_PRESSURE, est(21), "batch", 1)
    assert cap.why(Blocker.KV, est(80), "batch", 1) == "kv"
    assert cap.room(A) == 20                                   # min(70, 20, 40 - 0)
    cap.ledger.hold(HeldRequest("y", "a", "batch", 1, 25))
    assert cap.room(A) == 15                                   # its budget: 40 - 25


def test_the_largest_max_tokens_that_fits():
    cap = capacity()
    e = est(6, uncached=32, output=64)
    assert cap.tokens_within_blocks(1, e, 5, BATCH) == 48      # 80 tokens less 32
    assert cap.tokens_within_blocks(2, e, 5, BATCH) == 24
    assert cap.tokens_within_blocks(1, e, 6, BATCH) == 63      # below what it expects
    assert cap.tokens_within_blocks(1, e, 2, BATCH) is None    # 0 < min_max_tokens 8
    assert cap.tokens_within_budget(1, e, 60.0, BATCH) == 28
    assert cap.tokens_within_budget(2, e, 60.0, BATCH) == 14
    assert cap.tokens_within_budget(1, e, 39.0, BATCH) is None
    assert cap.tokens_within_budget(1, e, 60.0, ServiceClass("i")) is None   # may not
    d = cap.degraded(Estimate(32, 64, 6, 0.4, 900.0, decode_context=64), 48, 1)
    assert (d.expected_output, d.kv_blocks, d.decode_context, d.predicted_ttft_s) == \
        (48, 5, 56, 0.4)


def test_a_tenants_bucket_is_made_on_first_use_and_only_with_a_rate():
    buckets = TenantBuckets()
    assert buckets.of(TenantConfig("free"), 0.0) is None and buckets.get("free") is None
    rated = TenantConfig("r", token_rate=100.0, token_burst=50.0)
    assert buckets.get("r") is None
    first = buckets.of(rated, 1.0)
    assert first is buckets.of(rated, 2.0) is buckets.get("r")
    assert first.level == 50.0
