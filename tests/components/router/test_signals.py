"""The autoscaling signals the router computes from its replicas' reports (signals.py):
per replica and fleet-wide, which replicas count, headroom against each class's TTFT
objective, and the refusals for load it counts."""
import pytest

from components.router.membership import Membership, Replica, load_query_id
from components.router.routing import Flight, RoutingCore
from components.router.signals import parse, signal_stats, targets_s
from schemas.client import ComponentStatus, Rejected, StatusReport, Submit
from schemas.config import AdmissionConfig, ReplicaSpec, RouterConfig, ServiceClass

CLASSES = (ServiceClass("interactive", ttft_slo_ms=2000.0), ServiceClass("batch"),
           ServiceClass("tier.1", ttft_slo_ms=8000.0))
TARGETS = targets_s(CLASSES)


def report(r: Replica, queue_s: float, free: int, total: int = 100, prefill: int = 0,
           decode: int = 0) -> None:
    comps = (ComponentStatus("admission", 1, True, "ready", 0, 0.0,
                             {"predicted_queue_s": queue_s}),
             ComponentStatus("kv_manager", 1, True, "ready", 0, 0.0,
                             {"total_blocks": total, "free_blocks": free}),
             ComponentStatus("scheduler", 1, True, "ready", 0, 0.0,
                             {"backlog.prefill_tokens": prefill,
                              "backlog.decode_tokens": decode}))
    r.report, r.report_asked = StatusReport(load_query_id(0), comps), 0.0


def fleet(*names: str) -> Membership:
    m = Membership(tuple(ReplicaSpec(n, f"ipc:///{n}") for n in names))
    for r in m:
        r.healthy = True
    return m


def stats(m: Membership, rejections: float = 0.0) -> dict[str, float]:
    return signal_stats(m, lambda r: r.stat("admission", "predicted_queue_s"), TARGETS,
                        rejections)


def test_targets_are_the_classes_with_a_ttft_objective():
    assert TARGETS == {"interactive": 2.0, "tier.1": 8.0}


def test_each_replica_and_the_fleet_of_those_taking_work():
    m = fleet("a", "b", "c", "d", "e")
    report(m["a"], 1.0, free=60, prefill=400, decode=1000)
    report(m["b"], 3.0, free=10, total=300, prefill=2000, decode=50)
    report(m["c"], 9.0, free=0)                  # draining: its own signals, not the fleet's
    m["c"].draining = True
    report(m["d"], 9.0, free=0)                  # lost: none at all
    m["d"].healthy = False
    # e: healthy, no load report yet: none
    m["a"].counts["load_rejected"] = 4
    out = stats(m, rejections=7)
    assert out["signal/a/queue_s"] == 1.0
    assert out["signal/a/kv_used"] == pytest.approx(0.4)
    assert out["signal/a/headroom/interactive"] == pytest.approx(0.5)
    assert out["signal/a/headroom/tier.1"] == pytest.approx(1 - 1 / 8)
    assert "signal/a/headroom/batch" not in out               # no TTFT objective
    assert out["signal/a/prefill_backlog_tokens"] == 400
    assert out["signal/a/decode_backlog_tokens"] == 1000
    assert out["signal/a/load_rejections"] == 4
    assert out["signal/b/headroom/interactive"] == pytest.approx(-0.5)   # past it: < 0
    assert out["signal/b/load_rejections"] == 0
    assert out["signal/c/queue_s"] == 9.0
    assert not any(k.startswith(("signal/d/", "signal/e/")) for k in out)
    # the fleet: a and b
    assert out["fleet/replicas"] == 2
    assert out["fleet/queue_s"] == pytest.approx(2.0)
    assert out["fleet/headroom/interactive"] == pytest.approx(0.0)
    assert out["fleet/headroom/tier.1"] == pytest.approx(0.75)
    assert out["fleet/kv_used"] == pytest.approx((40 + 290) / 400)     # by blocks, not mean
    assert out["fleet/prefill_backlog_tokens"] == 2400
    assert out["fleet/decode_backlog_tokens"] == 1050
    assert out["fleet/load_rejections"] == 7


def test_a_fleet_with_no_replica_taking_work_says_so_and_nothing_else():
    m = fleet("a")
    m["a"].retiring = True
    report(m["a"], 0.5, free=100)
    out = stats(m, rejections=2)
    assert out["fleet/replicas"] == 0 and out["fleet/load_rejections"] == 2
    assert "fleet/queue_s" not in out and "fleet/headroom/interactive" not in out
    assert out["signal/a/queue_s"] == 0.5


def test_keys_read_back_with_dotted_and_slashed_names():
    assert parse("signal/weir-replica-0.x/headroom/tier.1") == (
        "weir-replica-0.x", "headroom", "tier.1")
    assert parse("fleet/headroom/a/b") == (None, "headroom", "a/b")
    assert parse("fleet/queue_s") == (None, "queue_s", "")
    assert parse("replica.a.healthy") is None


def test_the_queue_is_the_one_routing_ranks_by_with_what_was_sent_since():
    """A prompt the router sent after the report counts at the replica's prefill rate."""
    rc = RouterConfig(default_prefill_tokens_per_s=1000.0)
    core = RoutingCore(rc, AdmissionConfig(classes=CLASSES), 16, 600.0)
    m = fleet("a")
    r = m["a"]
    report(r, 1.0, free=100)
    f = Flight(b"c", Submit("r1", prompt="p"), "default", 0.0, 500)
    f.replica, f.pending = "a", 500
    r.open.add("r1")
    flights = {"r1": f}
    assert core.queue_s(r, flights) == pytest.approx(1.5)
    out = signal_stats(m, lambda x: core.queue_s(x, flights), TARGETS, 0)
    assert out["signal/a/headroom/interactive"] == pytest.approx(0.25)


def test_refusals_for_load_are_counted_per_replica_rerouted_or_not():
    core = RoutingCore(RouterConfig(reroute_attempts=1), AdmissionConfig(classes=CLASSES),
                       16, 600.0)
    m = fleet("a", "b")
    f = Flight(b"c", Submit("r1", prompt="p"), "default", 0.0, 10, replica="a",
               tried=["a"])
    assert core.answered(f, m["a"], Rejected("r1", "overloaded", "full"), m, 0.0) == "reroute"
    f.replica, f.tried = "b", ["a", "b"]
    assert core.answered(f, m["b"], Rejected("r1", "kv_pressure", "full"), m, 0.0) == "end"
    g = Flight(b"c", Submit("r2", prompt="p"), "default", 0.0, 10, replica="a", tried=["a"])
    core.answered(g, m["a"], Rejected("r2", "invalid_request", "no"), m, 0.0)   # not load
    assert (m["a"].counts["load_rejected"], m["b"].counts["load_rejected"]) == (1, 1)


def test_the_router_service_stats_carry_the_signals():
    """``RouterService.stats`` (what its status report, hence the gateway's /metrics,
    shows) holds every signal beside its counts: built without sockets."""
    from collections import Counter
    from types import SimpleNamespace

    from components.router.budgets import FleetBudgets
    from components.router.fleetq import FleetQueue
    from components.router.service import RouterService

    class Sessions(dict):
        moves = 0

    m = fleet("a")
    report(m["a"], 0.5, free=50)
    svc = SimpleNamespace(
        flights={}, endpoint=SimpleNamespace(last_seen={}), tokenizing=0, members=m,
        routing=SimpleNamespace(sessions=Sessions(), idempotent={},
                                queue_s=lambda r, flights: 0.5 + len(flights)),
        counts=Counter(load_rejected=3), targets=TARGETS, handovers=[],
        budgets=FleetBudgets(()), fleetq=FleetQueue((), 10), _pool_stats=dict,
        live=SimpleNamespace(history=SimpleNamespace(current=SimpleNamespace(version=3)),
                             persist_errors=0))
    svc.fleetq.offer("q", "acme", 10, 0.0, 60.0)
    out = RouterService.stats(svc)
    assert out["fleetq.depth"] == 1 and out["fleetq.depth.acme"] == 1
    assert out["requests.load_rejected"] == 3 and out["fleet/load_rejections"] == 3
    assert out["signal/a/queue_s"] == 0.5 and out["fleet/headroom/interactive"] == 0.75
    assert out["signal/a/kv_used"] == 0.5 and out["replica.a.healthy"] == 1
    assert out["config_version"] == 3
