"""The router's fleet-wide tenant budgets (components/router/budgets.py), pure: caps counted
from placement to terminal, the token bucket charged at placement and corrected at the
end, and the caps rebuilt from the replicas' reports after a restart."""
from components.router.budgets import (
    FleetBudgets,
    estimate,
    reported_outstanding,
    reported_used,
)
from schemas.client import ComponentStatus, StatusReport
from schemas.config import TenantConfig


def budgets(**kw) -> FleetBudgets:
    return FleetBudgets([TenantConfig("acme", **kw)])


def report(**stats: float) -> StatusReport:
    return StatusReport("router-load:1", (
        ComponentStatus("admission", 1, True, "ready", 0, 0.0,
                        stats={k.replace("__", "."): v for k, v in stats.items()}),
        ComponentStatus("scheduler", 2, True, "ready", 0, 0.0,
                        stats={"ledger.outstanding.acme": 99})))


def test_estimate_is_prompt_plus_n_times_the_output_cap():
    assert estimate(10, 5, 1, 100) == 15
    assert estimate(10, 5, 3, 100) == 25
    assert estimate(10, None, 1, 100) == 100        # no cap: the room the context leaves
    assert estimate(10, 500, 1, 100) == 100


def test_an_ungoverned_tenant_is_never_refused_nor_counted():
    b = budgets(max_outstanding=1)
    for i in range(5):
        assert b.check("globex", 10, 0.0) is None
        b.place(f"g{i}", "globex", "r0", 10, 0.0)
    assert b.outstanding("globex") == 0 and not b.placed


def test_the_outstanding_cap_counts_from_placement_to_terminal():
    b = budgets(max_outstanding=2)
    b.place("a", "acme", "r0", 10, 0.0)
    b.place("b", "acme", "r1", 10, 0.0)
    no = b.check("acme", 10, 0.0)
    assert no is not None and no.reason == "tenant_over_budget"
    assert "2 requests across the fleet" in no.message and 1.0 <= no.retry_after_s <= 60
    b.moved("b", "r2")                    # a reroute counts once
    assert b.outstanding("acme") == 2 and b.placed["b"].replica == "r2"
    b.place("b", "acme", "r2", 10, 0.0)   # placing it again changes nothing
    assert b.outstanding("acme") == 2
    b.ended("a", 15, 1.0)
    b.ended("a", 15, 1.0)                 # a repeated end uncounts nothing
    assert b.outstanding("acme") == 1 and b.check("acme", 10, 1.0) is None
    assert b.refusals == {"tenant_over_budget": 1}


def test_the_token_bucket_is_charged_the_estimate_and_refunded_the_unused():
    b = budgets(token_rate=100, token_burst=200)
    assert b.check("acme", 150, 0.0) is None
    b.place("a", "acme", "r0", 150, 0.0)            # 200 - 150 = 50 left
    no = b.check("acme", 100, 0.0)
    assert no is not None and no.reason == "tenant_token_budget"
    assert no.retry_after_s == 0.5                  # 50 short at 100/s
    assert "holds 50" in no.message
    assert b.check("acme", 100, 0.5) is None        # refilled
    b.ended("a", 30, 0.5)                           # used 30 of 150: 120 back
    assert b.buckets["acme"].level == 200           # 100 + 120, at most the burst
    assert b.refunded == 120


def test_an_estimate_past_the_burst_waits_for_a_full_bucket_and_leaves_debt():
    b = budgets(token_rate=100, token_burst=100)
    assert b.check("acme", 500, 0.0) is None        # full: it may go
    b.place("a", "acme", "r0", 500, 0.0)
    assert b.buckets["acme"].level == -400
    no = b.check("acme", 500, 1.0)
    assert no is not None and no.retry_after_s == 4.0   # 100 needed from -300 at 100/s
    b.ended("a", None, 1.0)                         # unknown use (failed): no refund
    assert b.buckets["acme"].level == -300


def test_a_refusal_from_the_replica_refunds_everything():
    b = budgets(token_rate=10, token_burst=100)
    b.place("a", "acme", "r0", 80, 0.0)
    b.ended("a", 0, 0.0)
    assert b.buckets["acme"].level == 100


def test_no_token_rate_means_only_the_cap():
    b = budgets(max_outstanding=3)
    b.place("a", "acme", "r0", 10**9, 0.0)
    assert b.check("acme", 10**9, 0.0) is None and not b.buckets


def test_reports_are_read_from_admission_only():
    got = reported_outstanding(report(ledger__outstanding__acme=3, queued__acme=2,
                                      ledger__outstanding__globex=1, queued=7))
    assert got == {"acme": 5, "globex": 1}
    assert reported_outstanding(None) == {}


def test_after_a_restart_the_cap_is_rebuilt_from_the_replicas_reports():
    """A new router has placed nothing; the replicas still hold the last router's
    requests: they count until a report no longer shows them."""
    b = budgets(max_outstanding=10)
    b.reported("r0", {"acme": 4, "globex": 9}, 1.0)
    b.reported("r1", {"acme": 3}, 1.0)
    b.reported("r2", {"acme": 3}, 1.0)
    assert b.outstanding("acme") == 10
    assert b.check("acme", 1, 1.0).reason == "tenant_over_budget"
    b.reported("r2", {}, 2.0)                       # r2's finished
    assert b.outstanding("acme") == 7
    b.place("x", "acme", "r2", 1, 2.5)              # ours, placed after that report
    b.reported("r2", {"acme": 1}, 2.4)              # asked before we placed it: not ours
    assert b.outstanding("acme") == 9               # 7 unplaced + x + (1 on r2) at worst
    b.reported("r2", {"acme": 1}, 3.0)              # asked after: it is ours
    assert b.outstanding("acme") == 8
    b.lost("r0")                                    # a lost replica's report goes
    assert b.outstanding("acme") == 4
    assert b.stats()["budget.unplaced.acme"] == 3


def test_our_own_requests_are_not_counted_twice_by_the_reports():
    b = budgets(max_outstanding=10)
    for i in range(4):
        b.place(f"a{i}", "acme", "r0", 1, 0.0)
    b.reported("r0", {"acme": 3}, 1.0)              # one not yet admitted there
    assert b.outstanding("acme") == 4 and not b.unplaced
    b.reported("r0", {"acme": 5}, 1.0)              # one more than ours: not ours
    assert b.outstanding("acme") == 5


def test_a_governed_tenant_waits_while_a_replica_has_not_reported():
    b = budgets(max_outstanding=10)
    no = b.check("acme", 1, 0.0, unreported=True)
    assert no is not None and no.reason == "overloaded" and no.retry_after_s == 0.5
    assert b.check("globex", 1, 0.0, unreported=True) is None


def test_a_request_ended_just_before_a_report_is_not_counted_as_another_routers():
    """Its terminal reached the router, its release has not yet reached the replica's
    admission: the report still counts it, as ours."""
    b = budgets(max_outstanding=10)
    b.place("a", "acme", "r0", 1, 0.0)
    b.place("b", "acme", "r0", 1, 0.0)
    b.ended("a", 1, 1.0)                            # ended after the query was asked
    b.reported("r0", {"acme": 2}, 0.5)
    assert b.outstanding("acme") == 1
    b.ended("b", 1, 2.0)
    b.reported("r0", {"acme": 1}, 2.5)              # b ended 0.5 s before: lag
    assert b.outstanding("acme") == 0
    b.reported("r0", {"acme": 1}, 4.0)              # 2 s later it is someone else's
    assert b.outstanding("acme") == 1 and len(b.recent) == 0


def test_after_a_restart_a_bucket_starts_from_what_the_replicas_report_used():
    """The last router let ``acme`` use 300 tokens in the last second on r0 and 100 more
    on r1 two seconds ago: the new router's bucket (rate 100, burst 200) starts at
    200 + 100 - 300 = 0, not full; a tenant the reports do not name starts full."""
    b = FleetBudgets([TenantConfig("acme", token_rate=100, token_burst=200),
                      TenantConfig("beta", token_rate=100, token_burst=200)])
    r0 = reported_used(report(used_tokens__1s__acme=300, used_tokens__2s__acme=300,
                              used_tokens__64s__acme=300, queued__acme=0))
    r1 = reported_used(report(used_tokens__1s__acme=0, used_tokens__2s__acme=100,
                              used_tokens__64s__acme=100))
    assert r0 == {"acme": {1: 300, 2: 300, 64: 300}}
    b.reported("r0", {}, 0.0, r0)
    b.reported("r1", {}, 0.0, r1)
    no = b.check("acme", 50, 10.0)
    assert no is not None and no.reason == "tenant_token_budget" and "holds 0" in no.message
    assert b.rebuilt == {"acme": 0.0} and b.stats()["budget.rebuilt_tokens.acme"] == 0.0
    assert b.check("beta", 50, 10.0) is None and b.buckets["beta"].level == 200
    assert b.check("acme", 50, 10.5) is None            # it refills at its rate from there
    # a replica lost takes its report with it; a bucket already made is not rebuilt again
    b.lost("r0")
    assert b.used == {"r1": r1} and b.buckets["acme"].refill(10.5) == 50.0


def test_new_budgets_carry_over_by_tenant_name():
    """A live config change (retune): acme's two placed requests count against its new cap
    of 2, its bucket keeps its level (cut to the smaller burst) and refills at the new
    rate; globex, now named, is governed from then on; a tenant dropped is not."""
    b = FleetBudgets([TenantConfig("acme", max_outstanding=10, token_rate=100,
                                   token_burst=1000),
                      TenantConfig("old", max_outstanding=1, token_rate=5)])
    b.place("a1", "acme", "r0", 100, 0.0)
    b.place("a2", "acme", "r1", 200, 0.0)
    b.place("o1", "old", "r0", 1, 0.0)
    assert b.buckets["acme"].level == 700
    b.retune([TenantConfig("acme", max_outstanding=2, token_rate=10, token_burst=500),
              TenantConfig("globex", max_outstanding=1)], 1.0)
    assert b.outstanding("acme") == 2 and b.placed["a1"].charged == 100
    bucket = b.buckets["acme"]
    assert (bucket.rate, bucket.burst, bucket.level) == (10, 500, 500)  # 700 + 100, cut
    no = b.check("acme", 10, 1.0)
    assert no is not None and no.reason == "tenant_over_budget" and "cap is 2" in no.message
    b.ended("a1", 50, 2.0)                     # refunded 50 at the new burst's bound
    assert b.outstanding("acme") == 1 and b.buckets["acme"].level == 500
    assert "old" not in b.buckets and b.check("old", 1, 2.0) is None
    b.ended("o1", 1, 2.0)                      # placed under the old config: ends once
    assert b.own["old"] == 0
    b.place("g1", "globex", "r0", 5, 2.0)
    assert b.check("globex", 5, 2.0).reason == "tenant_over_budget"
