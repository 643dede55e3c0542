"""Idempotency keys: attach to a running request, replay a finished one within the TTL,
never across tenants, and run again after a failure."""
from components.streamer.idempotency import IdempotencyTable
from schemas.client import Accepted, Failed, Finished, TextDelta, Usage


def _run(table, rid="r1", tenant="acme", key="k"):
    table.start(tenant, key, rid)
    table.record(rid, Accepted(rid, 5), 0.0, False)
    table.record(rid, TextDelta(rid, "Hel", (1,)), 0.0, False)


def test_a_retry_attaches_to_the_running_request_and_gets_what_it_missed():
    t = IdempotencyTable(ttl_s=10)
    _run(t)
    replay = t.attach("acme", "k", b"c2", "r2", now=1.0)
    assert replay == [Accepted("r2", 5), TextDelta("r2", "Hel", (1,))]
    assert t.subscribers("r1") == [(b"c2", "r2")]


def test_a_finished_result_is_replayed_within_the_ttl_then_forgotten():
    t = IdempotencyTable(ttl_s=10)
    _run(t)
    done = Finished("r1", "length", Usage(5, 1))
    t.record("r1", done, now=2.0, terminal=True)
    assert not t.tracks("r1") and t.subscribers("r1") == []
    replay = t.attach("acme", "k", b"c2", "r9", now=11.9)
    assert replay[-1] == Finished("r9", "length", Usage(5, 1))
    assert t.attach("acme", "k", b"c3", "r10", now=12.1) is None


def test_keys_are_scoped_per_tenant():
    t = IdempotencyTable()
    _run(t, tenant="acme")
    assert t.attach("globex", "k", b"c2", "r2", now=0.0) is None


def test_a_failed_request_runs_again_on_retry():
    t = IdempotencyTable()
    _run(t)
    t.record("r1", Failed("r1", "boom"), now=1.0, terminal=True)
    assert t.attach("acme", "k", b"c2", "r2", now=1.0) is None
    assert len(t) == 0


def test_finished_entries_past_the_cap_are_evicted_oldest_first_running_ones_never():
    t = IdempotencyTable(ttl_s=100, max_entries=2)
    for i in range(3):
        _run(t, rid=f"r{i}", key=f"k{i}")
        t.record(f"r{i}", Finished(f"r{i}", "stop", Usage(1, 1)), now=0.0, terminal=True)
    _run(t, rid="live", key="live")
    assert t.attach("acme", "k0", b"c", "x", now=1.0) is None        # evicted
    assert t.attach("acme", "live", b"c", "y", now=1.0) is not None
