"""The router's replicas, built directly: who may change them and which changes are
refused whole, adding and retiring, letting go, health from heartbeat answers, load
reports in the order they were asked, and what losing a replica drops. Adding and retiring
live: tests/e2e/test_router.py."""
import hashlib

import pytest

from bus.identity import Keyring
from components.router.membership import MAX_CHANGES, Membership, asked_at, load_query_id
from schemas.client import (
    ChangeReplicas,
    ComponentStatus,
    ReplicaAddress,
    ServerHeartbeat,
    StatusReport,
)
from schemas.config import ApiKey, ReplicaSpec


def key(secret: str, tenant: str, role: str = "tenant") -> ApiKey:
    return ApiKey(hashlib.sha256(secret.encode()).hexdigest(), tenant, role)


def change(api_key=None, **kw) -> ChangeReplicas:
    return ChangeReplicas("q1", api_key=api_key, **kw)


def members(*names: str) -> Membership:
    return Membership(tuple(ReplicaSpec(n, f"ipc:///{n}") for n in names))


OPEN = Keyring((), service_key="service-secret")      # no keys: anyone is an operator


@pytest.mark.parametrize("api_key, allowed", [
    (None, False), ("wrong", False), ("tenant-secret", False),
    ("operator-secret", True), ("service-secret", True)])
def test_only_an_operator_changes_replicas(api_key, allowed):
    keys = Keyring((key("tenant-secret", "acme"), key("operator-secret", "ops", "operator")),
                   service_key="service-secret")
    m = members()
    answer, added = m.change(change(api_key, remove=("r9",)),
                             keys.identify(api_key, "default"))
    assert answer.query_id == "q1" and answer.replicas == () and answer.retiring == ()
    # past the key, the change itself is checked (r9 does not exist)
    assert answer.error == ("no replica 'r9' to remove" if allowed
                            else "changing replicas needs an operator's key")
    assert added == [] and len(m) == 0


def test_without_keys_anyone_may():
    answer, _ = members().change(change(remove=("r9",)), OPEN.identify(None, "default"))
    assert answer.error == "no replica 'r9' to remove"


@pytest.mark.parametrize("kw, words", [
    ({"add": (ReplicaAddress("a", "ipc:///a"), ReplicaAddress("a", "ipc:///b"))}, "twice"),
    ({"add": (ReplicaAddress("", "ipc:///a"),)}, "a name is required"),
    ({"add": (ReplicaAddress("a/b", "ipc:///a"),)}, "without '/'"),
    ({"add": (ReplicaAddress("a", "http://a"),)}, "tcp:// or ipc://"),
    ({"add": (ReplicaAddress("a" * 300, "ipc:///a"),)}, "at most 256"),
    ({"add": tuple(ReplicaAddress(f"r{i}", "ipc:///a") for i in range(MAX_CHANGES + 1))},
     f"at most {MAX_CHANGES}"),
    ({"remove": ("nope",)}, "no replica 'nope'"),
    ({"add": (ReplicaAddress("r1", "ipc:///x"),)}, "'r1' is already routed to"),
    ({"add": (ReplicaAddress("r3", "ipc:///x"),), "remove": ("r3",)}, "no replica 'r3'"),
])
def test_a_bad_change_is_refused_whole(kw, words):
    m = members("r1", "r2")
    answer, added = m.change(change(**kw), OPEN.identify(None, "default"))
    assert answer.error is not None and words in answer.error, answer.error
    assert added == [] and list(m.replicas) == ["r1", "r2"]
    assert not any(r.retiring for r in m)


def test_a_change_adds_and_retires_and_a_retired_replica_is_let_go_once_idle():
    m = members("r1", "r2")
    m["r2"].open.add("req-1")
    answer, added = m.change(change(add=(ReplicaAddress("r3", "tcp://h:7450", "tcp://h:7460"),),
                                    remove=("r2",)), OPEN.identify(None, "default"))
    assert answer.error is None
    assert (answer.replicas, answer.retiring) == (("r1", "r3"), ("r2",))
    assert [r.spec for r in added] == [ReplicaSpec("r3", "tcp://h:7450", "tcp://h:7460")]
    assert m.get("r3") is added[0] and not added[0].healthy
    # retiring: routed nothing new, let go only once nothing is open on it
    assert m.idle_retired() == []
    again, _ = m.change(change(add=(ReplicaAddress("r2", "ipc:///r2"),)),
                        OPEN.identify(None, "default"))
    assert again.error == ("replica 'r2' is already routed to "
                           "(retiring: add it again once it is gone)")
    m["r2"].open.discard("req-1")
    assert m.idle_retired() == [m["r2"]]
    m.let_go(m["r2"])
    assert list(m.replicas) == ["r1", "r3"] and m.get("r2") is None


def test_a_replica_is_healthy_from_its_first_answer_and_a_new_instance_is_a_restart():
    m = members("r1")
    r = m["r1"]
    assert not Membership.heard(r, ServerHeartbeat(7), 10.0)
    assert r.last_heard == 10.0 and not r.healthy      # healthy only once ``up``
    assert Membership.up(r, ServerHeartbeat(7)) and r.healthy and r.instance == 7
    assert not Membership.heard(r, ServerHeartbeat(7, draining=True), 10.5)
    assert not Membership.up(r, ServerHeartbeat(7, draining=True)) and r.draining
    assert Membership.heard(r, ServerHeartbeat(8), 11.0)          # restarted
    assert r.instance == 7              # the caller loses it first, then ``up``
    Membership.up(r, ServerHeartbeat(8))
    assert (r.instance, r.draining, r.healthy) == (8, False, True)


def report(asked_s: float, queue_s: float) -> StatusReport:
    return StatusReport(load_query_id(int(asked_s * 1e9)), (
        ComponentStatus("admission", 1, True, "ready", 0, 0.0,
                        {"predicted_queue_s": queue_s}),))


def test_a_load_report_answering_an_older_query_is_ignored():
    r = members("r1")["r1"]
    r.prefilled = [(100, 1.0, 1.5), (200, 1.0, 2.5)]
    Membership.heard(r, report(2.0, 0.3), 3.0)
    assert (r.report_asked, r.stat("admission", "predicted_queue_s")) == (2.0, 0.3)
    assert r.prefilled == [(200, 1.0, 2.5)]            # prefilled after the query was asked
    Membership.heard(r, report(1.5, 9.0), 3.1)          # an older answer, come late
    assert (r.report_asked, r.stat("admission", "predicted_queue_s")) == (2.0, 0.3)
    assert r.last_heard == 3.1                          # but it was heard
    Membership.heard(r, StatusReport("someone-else:5", ()), 3.2)   # not a load query
    assert r.report_asked == 2.0
    assert asked_at("router-load:2500000000") == 2.5 and asked_at("router-load:x") == 0.0


def test_losing_a_replica_drops_its_view_and_hands_back_its_open_requests():
    m = members("r1")
    r = m["r1"]
    Membership.up(r, ServerHeartbeat(7))
    Membership.heard(r, report(2.0, 0.3), 3.0)
    r.open |= {"a", "b"}
    r.prefilled.append((10, 2.5, 2.6))
    assert sorted(Membership.lose(r)) == ["a", "b"]
    assert (r.healthy, r.report, r.open, r.prefilled, r.counts["lost"]) == (
        False, None, set(), [], 1)
    assert r.stat("admission", "predicted_queue_s", -1.0) == -1.0


def test_a_stall_is_not_held_against_a_replica():
    m = members("r1", "r2")
    m["r1"].last_heard, m["r2"].last_heard = 10.0, 11.5
    m.excuse(1.0, 12.0)
    assert (m["r1"].last_heard, m["r2"].last_heard) == (11.0, 12.0)   # never past now


def test_stats_per_replica():
    m = members("r1")
    m["r1"].open.add("x")
    m["r1"].counts["routed"] += 2
    assert m.stats() == {"replica.r1.healthy": 0, "replica.r1.retiring": 0,
                         "replica.r1.open": 1, "replica.r1.index_blocks": 0,
                         "replica.r1.index_gaps": 0, "replica.r1.index_stored": 0,
                         "replica.r1.index_snapshots": 0, "replica.r1.routed": 2,
                         "pool.default.replicas": 1}
    assert m.info() == {"replica.r1.pool": "default"}


def test_pools_label_the_replicas():
    m = Membership((ReplicaSpec("s0", "ipc:///a", pool="stable"),
                    ReplicaSpec("c0", "ipc:///b", pool="canary"),
                    ReplicaSpec("s1", "ipc:///c", pool="stable")))
    assert [r.name for r in m.pool("stable")] == ["s0", "s1"]
    assert m.pools() == {"stable": 2, "canary": 1}
    assert m.stats()["pool.canary.replicas"] == 1
    assert m.info()["replica.c0.pool"] == "canary"
