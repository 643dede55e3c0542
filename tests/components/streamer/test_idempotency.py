"""Idempotency keys: attach to a running request, replay a finished one within the TTL,
never across tenants, and run again after a failure; the record compacted, its digest
checked, and every bound (subscribers, rate, bytes, one entry's size) held."""
from components.streamer.idempotency import IdempotencyTable, Refused, request_digest
from schemas.client import (
    Accepted,
    Failed,
    Finished,
    SamplingParams,
    Submit,
    TextDelta,
    TokenLogprob,
    Usage,
)

D = b"digest"


def _run(table, rid="r1", tenant="acme", key="k", digest=D):
    table.start(tenant, key, rid, digest)
    table.record(rid, Accepted(rid, 5), 0.0, False)
    table.record(rid, TextDelta(rid, "Hel", (1,)), 0.0, False)


def _finish(table, rid, now=0.0):
    table.record(rid, Finished(rid, "stop", Usage(1, 1)), now=now, terminal=True)


def test_a_retry_attaches_to_the_running_request_and_gets_what_it_missed():
    t = IdempotencyTable(ttl_s=10)
    _run(t)
    replay = t.attach("acme", "k", b"c2", "r2", now=1.0, digest=D)
    assert replay == [Accepted("r2", 5), TextDelta("r2", "Hel", (1,))]
    assert t.subscribers("r1") == [(b"c2", "r2")]


def test_the_replay_is_one_delta_per_choice_however_many_tokens_came():
    t = IdempotencyTable()
    _run(t)
    lp = TokenLogprob(7, "x", -0.5)
    for _ in range(400):
        t.record("r1", TextDelta("r1", "x", (7,), 0, (lp,)), 0.0, False)
        t.record("r1", TextDelta("r1", "y", (8,), 1), 0.0, False)
    t.record("r1", Finished("r1", "length", Usage(5, 801)), 1.0, True)
    replay = t.attach("acme", "k", b"c2", "r2", now=2.0, digest=D)
    assert [type(e).__name__ for e in replay] == ["Accepted", "TextDelta", "TextDelta",
                                                  "Finished"]
    first, second = replay[1], replay[2]
    assert first.index == 0 and first.text == "Hel" + "x" * 400
    assert first.token_ids == (1,) + (7,) * 400 and first.logprobs == (lp,) * 400
    assert second.index == 1 and second.text == "y" * 400 and second.token_ids == (8,) * 400
    assert {e.request_id for e in replay} == {"r2"}


def test_a_finished_result_is_replayed_within_the_ttl_then_forgotten():
    t = IdempotencyTable(ttl_s=10)
    _run(t)
    done = Finished("r1", "length", Usage(5, 1))
    t.record("r1", done, now=2.0, terminal=True)
    assert not t.tracks("r1") and t.subscribers("r1") == []
    replay = t.attach("acme", "k", b"c2", "r9", now=11.9, digest=D)
    assert replay[-1] == Finished("r9", "length", Usage(5, 1))
    assert t.attach("acme", "k", b"c3", "r10", now=12.1, digest=D) is None


def test_keys_are_scoped_per_tenant():
    t = IdempotencyTable()
    _run(t, tenant="acme")
    assert t.attach("globex", "k", b"c2", "r2", now=0.0, digest=D) is None


def test_a_key_reused_for_another_request_is_refused_not_answered():
    t = IdempotencyTable()
    _run(t)
    got = t.attach("acme", "k", b"c2", "r2", now=0.0, digest=b"other")
    assert isinstance(got, Refused) and got.kind == "reused"
    assert t.subscribers("r1") == []


def test_the_digest_covers_prompt_params_and_tools_not_the_retry_bookkeeping():
    base = Submit("a", prompt="hi", params=SamplingParams(max_tokens=4, n=3),
                  idempotency_key="k")
    same = Submit("b", prompt="hi", params=SamplingParams(max_tokens=4, n=3),
                  idempotency_key="k", attempt=2, deadline_ms=50, priority=3, api_key="x")
    assert request_digest(base) == request_digest(same)
    for other in (Submit("a", prompt="hi!", params=base.params),
                  Submit("a", prompt="hi", params=SamplingParams(max_tokens=5, n=3)),
                  Submit("a", prompt="hi", params=SamplingParams(max_tokens=4, n=1)),
                  Submit("a", prompt_token_ids=[1], params=base.params)):
        assert request_digest(other) != request_digest(base)


def test_a_running_request_takes_at_most_max_subscribers_retries():
    t = IdempotencyTable(max_subscribers=2)
    _run(t)
    assert isinstance(t.attach("acme", "k", b"a", "x1", now=0.0, digest=D), list)
    assert isinstance(t.attach("acme", "k", b"b", "x2", now=0.0, digest=D), list)
    got = t.attach("acme", "k", b"c", "x3", now=0.0, digest=D)
    assert isinstance(got, Refused) and got.kind == "crowded"
    assert len(t.subscribers("r1")) == 2


def test_attaches_are_rate_limited_per_tenant_and_the_bucket_refills():
    t = IdempotencyTable(attach_rate=10)
    _run(t)
    _finish(t, "r1")
    got = [t.attach("acme", "k", b"c", f"x{i}", now=0.0, digest=D) for i in range(25)]
    assert sum(isinstance(g, list) for g in got) == 20             # the burst: 2 x rate
    assert all(g.kind == "rate" for g in got[20:])
    assert isinstance(t.attach("acme", "k", b"c", "y", now=0.1, digest=D), list)  # +1 in 0.1 s
    _run(t, tenant="globex", rid="g1")
    assert isinstance(t.attach("globex", "k", b"c", "z", now=0.1, digest=D), list)


def test_a_failed_request_runs_again_on_retry():
    t = IdempotencyTable()
    _run(t)
    t.record("r1", Failed("r1", "boom"), now=1.0, terminal=True)
    assert t.attach("acme", "k", b"c2", "r2", now=1.0, digest=D) is None
    assert len(t) == 0


def test_finished_entries_past_the_cap_are_evicted_oldest_first_running_ones_never():
    t = IdempotencyTable(ttl_s=100, max_entries=2)
    _run(t, rid="live", key="live")                   # running, and first: expiry passes it
    for i in range(3):
        _run(t, rid=f"r{i}", key=f"k{i}")
        _finish(t, f"r{i}")
    assert t.attach("acme", "k0", b"c", "x", now=1.0, digest=D) is None        # evicted
    assert t.attach("acme", "k1", b"c", "x", now=1.0, digest=D) is None
    assert t.attach("acme", "k2", b"c", "x", now=1.0, digest=D) is not None
    assert t.attach("acme", "live", b"c", "y", now=1.0, digest=D) is not None


def test_a_running_head_entry_does_not_stop_expiry_behind_it():
    t = IdempotencyTable(ttl_s=10)
    _run(t, rid="live", key="live")
    _run(t, rid="done", key="done")
    _finish(t, "done", now=0.0)
    t.expire(now=11.0)
    assert len(t) == 1 and t.finished_bytes == 0


def test_finished_records_are_bounded_in_bytes_oldest_first():
    t = IdempotencyTable(max_bytes=3000, max_entry_bytes=2000)
    for i in range(3):
        _run(t, rid=f"r{i}", key=f"k{i}")
        t.record(f"r{i}", TextDelta(f"r{i}", "z" * 1000, (1,)), 0.0, False)
        _finish(t, f"r{i}", now=float(i))
    assert t.finished_bytes <= 3000
    assert t.attach("acme", "k0", b"c", "x", now=3.0, digest=D) is None
    assert t.attach("acme", "k2", b"c", "x", now=3.0, digest=D) is not None


def test_a_result_too_large_to_keep_is_dropped_and_its_retry_runs_again():
    t = IdempotencyTable(max_entry_bytes=500)
    _run(t)
    t.record("r1", TextDelta("r1", "z" * 1000, (1,)), 0.0, False)
    _finish(t, "r1")
    assert t.too_large == 1 and len(t) == 0
    assert t.attach("acme", "k", b"c", "x", now=1.0, digest=D) is None
