"""Routing decisions with exact inputs: locality against load, overload, sessions."""
import pytest

from components.router.scoring import (
    ReplicaState,
    SessionTable,
    predicted_queue_s,
    rank,
    score_replica,
)
from schemas.config import RouterWeights

W = RouterWeights(prefix=1.0, queue=1.0, kv_used=0.0, active_kv=0.0, tenant=0.0)


def test_score_is_saved_prefill_minus_queue_and_pressure():
    w = RouterWeights(prefix=1.0, queue=2.0, kv_used=0.5, active_kv=0.25, tenant=1.0)
    r = ReplicaState("a", cached_tokens=500, queue_s=0.1, prefill_tokens_per_s=1000,
                     kv_used=0.5, active_kv=0.4, tenant_share=0.2)
    s = score_replica(r, 1000, 5.0, w, kv_high=0.95)
    assert s.saved_s == pytest.approx(0.5)
    assert s.ttft_s == pytest.approx(0.1 + 0.5)
    assert s.score == pytest.approx(0.5 - 0.2 - 0.25 - 0.1 - 0.2)
    assert not s.overloaded


def test_the_warm_replica_wins_when_its_queue_is_short():
    warm = ReplicaState("a", cached_tokens=1600, queue_s=0.2)
    cold = ReplicaState("b", cached_tokens=0, queue_s=0.0)
    assert rank([cold, warm], 2000, 2.0, W, 0.95)[0].name == "a"      # saves 0.8 s, waits 0.2


def test_a_hot_replica_loses_its_cache_advantage():
    # the seed's worked decision: A holds the prefix but its queue is long; C holds part
    # of it with a short queue; B is idle and cold
    a = ReplicaState("A", cached_tokens=1600, queue_s=1.5)
    b = ReplicaState("B", cached_tokens=0, queue_s=0.0)
    c = ReplicaState("C", cached_tokens=1200, queue_s=0.1)
    ranked = rank([a, b, c], 2000, 2.0, W, 0.95)
    assert [s.name for s in ranked] == ["C", "B", "A"]


def test_an_overloaded_replica_gets_work_only_when_every_one_is():
    loaded = ReplicaState("a", cached_tokens=2000, queue_s=3.0)       # TTFT 3 s > 2 s
    idle = ReplicaState("b", cached_tokens=0, queue_s=0.0)
    ranked = rank([loaded, idle], 2000, 2.0, W, 0.95)
    assert [s.name for s in ranked] == ["b", "a"] and ranked[1].overloaded
    full = ReplicaState("b", kv_used=0.97)                            # pool nearly full
    ranked = rank([loaded, full], 2000, 2.0, W, 0.95)
    assert all(s.overloaded for s in ranked)
    assert ranked[0].name == "b"          # both overloaded: the score decides (0 > 1 - 3)


def test_unhealthy_and_draining_replicas_are_not_ranked():
    ranked = rank([ReplicaState("a", healthy=False), ReplicaState("b", draining=True),
                   ReplicaState("c")], 10, 1.0, W, 0.95)
    assert [s.name for s in ranked] == ["c"]
    assert rank([ReplicaState("a", healthy=False)], 10, 1.0, W, 0.95) == []


def test_least_loaded_ignores_the_prefix():
    warm = ReplicaState("a", cached_tokens=1600, queue_s=0.2)
    cold = ReplicaState("b", cached_tokens=0, queue_s=0.1)
    assert rank([warm, cold], 2000, 5.0, W, 0.95, use_prefix=False)[0].name == "b"


def test_equal_replicas_order_by_name():
    assert [s.name for s in rank([ReplicaState("b"), ReplicaState("a")], 10, 1.0, W,
                                 0.95)] == ["a", "b"]


def test_a_session_sticks_while_its_replica_meets_the_deadline():
    t = SessionTable()
    first = t.decide("s", rank([ReplicaState("a"), ReplicaState("b")], 10, 1.0, W, 0.95), 0.0)
    assert (first.replica, first.reason) == ("a", "best")
    # b is now better, but a is fine: the session stays
    ranked = rank([ReplicaState("a", queue_s=0.3), ReplicaState("b", cached_tokens=10)],
                  10, 1.0, W, 0.95)
    assert ranked[0].name == "b"
    d = t.decide("s", ranked, 1.0)
    assert (d.replica, d.reason, d.moved_from) == ("a", "sticky", None)
    assert t.moves == 0


def test_a_session_moves_when_its_replica_would_miss_the_deadline():
    t = SessionTable()
    t.decide("s", rank([ReplicaState("a")], 10, 1.0, W, 0.95), 0.0)
    ranked = rank([ReplicaState("a", queue_s=2.0), ReplicaState("b")], 10, 1.0, W, 0.95)
    d = t.decide("s", ranked, 1.0)
    assert (d.replica, d.reason, d.moved_from) == ("b", "moved:overloaded", "a")
    assert t.moves == 1 and t.get("s", 1.0) == "b"


def test_a_session_moves_off_a_lost_replica():
    t = SessionTable()
    t.decide("s", rank([ReplicaState("a")], 10, 1.0, W, 0.95), 0.0)
    ranked = rank([ReplicaState("a", healthy=False), ReplicaState("b")], 10, 1.0, W, 0.95)
    d = t.decide("s", ranked, 1.0)
    assert (d.replica, d.reason, d.moved_from) == ("b", "moved:unhealthy", "a")


def test_when_every_replica_is_overloaded_the_session_stays():
    t = SessionTable()
    t.decide("s", rank([ReplicaState("a")], 10, 1.0, W, 0.95), 0.0)
    ranked = rank([ReplicaState("a", queue_s=5.0), ReplicaState("b", queue_s=3.0)], 10, 1.0,
                  W, 0.95)
    assert t.decide("s", ranked, 1.0).replica == "a"


def test_sessions_expire_and_are_bounded():
    t = SessionTable(ttl_s=10.0, max_sessions=2)
    one = rank([ReplicaState("a")], 10, 1.0, W, 0.95)
    t.decide("x", one, 0.0)
    assert t.get("x", 5.0) == "a" and t.get("x", 11.0) is None
    t.decide("y", one, 1.0)
    t.decide("z", one, 2.0)
    assert len(t) == 2 and t.get("x", 2.0) is None          # the least recent went first
    t.decide("w", one, 20.0)                                   # y and z idle past ttl
    assert len(t) == 1


def test_assign_records_a_move():
    t = SessionTable()
    t.decide("s", rank([ReplicaState("a")], 10, 1.0, W, 0.95), 0.0)
    t.assign("s", "a", 1.0)
    assert t.moves == 0
    t.assign("s", "b", 2.0)
    assert t.moves == 1 and t.get("s", 2.0) == "b"


def test_no_replica_no_decision():
    assert SessionTable().decide("s", [], 0.0) is None


# predicted_queue_s: the report asked at t=10 said 0.5 s; the rate is 1000 tokens/s.
# A sent prompt is (tokens to prefill, accepted at, prefilled at), 0 for not yet.

def test_the_report_alone_when_nothing_was_sent():
    assert predicted_queue_s(0.5, 10.0, [], 1000.0) == 0.5


def test_prompts_the_report_cannot_know_of_add_their_tokens():
    sent = [(200, 0.0, 0.0),        # not accepted yet
            (300, 10.5, 0.0)]       # accepted after the report was asked
    assert predicted_queue_s(0.5, 10.0, sent, 1000.0) == pytest.approx(1.0)


def test_prompts_the_report_counts_are_not_counted_twice():
    assert predicted_queue_s(0.5, 10.0, [(400, 9.0, 0.0)], 1000.0) == 0.5


def test_a_prompt_prefilled_since_the_report_comes_off_it():
    sent = [(400, 9.0, 10.2),       # counted waiting by the report, done since
            (100, 9.0, 9.5)]        # done before the report was asked: not in it
    assert predicted_queue_s(0.5, 10.0, sent, 1000.0) == pytest.approx(0.1)


def test_a_prompt_prefilled_that_the_report_never_counted_changes_nothing():
    assert predicted_queue_s(0.5, 10.0, [(400, 10.1, 10.2)], 1000.0) == 0.5


def test_the_queue_is_never_negative():
    assert predicted_queue_s(0.1, 10.0, [(400, 9.0, 10.2)], 1000.0) == 0.0


def test_back_to_back_first_turns_spread_instead_of_piling_on():
    """Three prompts between two reports of idle replicas: each sees the ones sent
    before it, so they go to three replicas, not all to the first by name."""
    w, sent = RouterWeights(), {n: [] for n in ("r0", "r1", "r2")}
    went = []
    for _ in range(3):
        states = [ReplicaState(n, queue_s=predicted_queue_s(0.0, 10.0, sent[n], 1000.0),
                               prefill_tokens_per_s=1000.0) for n in sent]
        best = rank(states, 300, 2.0, w, 0.95)[0].name
        sent[best].append((300, 0.0, 0.0))
        went.append(best)
    assert went == ["r0", "r1", "r2"]
