"""The router's decisions, built directly (``RoutingCore`` over ``Membership`` replicas and
``Flight``s, exact clocks): what a replica looks like to one request, where a request
goes, session stickiness, a retry of an idempotent request, the reroute after a refusal
for load and what is left of its deadlines, round robin, and each request's deadline."""
import pytest

from components.router.membership import Membership, Replica, load_query_id
from components.router.routing import (
    MAX_PREFILLED,
    Flight,
    RoutingCore,
    note_prefilled,
    ttft_deadline_s,
)
from components.router.scoring import ReplicaState
from schemas.client import (
    Accepted,
    ComponentStatus,
    Finished,
    Rejected,
    StatusReport,
    Submit,
    TenantUsage,
    TextDelta,
    Usage,
)
from schemas.config import (
    AdmissionConfig,
    ReplicaSpec,
    RouterConfig,
    RouterWeights,
    ServiceClass,
    TenantConfig,
)

W = RouterWeights(prefix=1.0, queue=1.0, kv_used=0.0, active_kv=0.0, tenant=0.0, cpu_tier=0.5)
ADMISSION = AdmissionConfig(
    classes=(ServiceClass("interactive", ttft_slo_ms=3000),
             ServiceClass("batch", ttft_slo_ms=60000), ServiceClass("free")),
    tenants=(TenantConfig("t", default_class="interactive"),
             TenantConfig("u", classes=("batch", "interactive")), TenantConfig("default")))
BS = 16                                 # tokens a block


def core(policy="cache_aware", reroute_attempts=2) -> RoutingCore:
    rc = RouterConfig(policy=policy, weights=W, reroute_attempts=reroute_attempts,
                      overload_ttft_s=2.0, default_prefill_tokens_per_s=2000.0)
    return RoutingCore(rc, ADMISSION, BS, idempotency_ttl_s=600.0)


def replicas(*names: str) -> Membership:
    m = Membership(tuple(ReplicaSpec(n, f"ipc:///{n}") for n in names))
    for r in m:
        r.healthy = True
    return m


def holds(r: Replica, *hashes: int, tenant="t", tier="gpu") -> None:
    r.index.blocks.update({h: (tenant, tier) for h in hashes})


def loaded(r: Replica, queue_s: float, asked_s: float = 0.0) -> None:
    r.report_asked = asked_s
    r.report = StatusReport(load_query_id(int(asked_s * 1e9)), (
        ComponentStatus("admission", 1, True, "ready", 0, 0.0, {"predicted_queue_s": queue_s}),))


def flight(rid="r-1", tokens=1000, hashes=(), tenant="t", arrival=0.0, **kw) -> Flight:
    return Flight(b"client", Submit(rid, prompt="p", tenant=tenant, **kw), tenant, arrival,
                  tokens, hashes=list(hashes))


def send(c: RoutingCore, f: Flight, m: Membership, now: float, flights=None) -> str | None:
    """Route ``f`` as the service does: decide, then assign; the replica's name."""
    route = c.route(f, m, flights or {}, now)
    if route.decision is not None:
        c.assign(f, m[route.decision.replica], route)
    return route.decision and route.decision.reason


def test_what_a_replica_looks_like_to_one_request():
    m = replicas("r1")
    r = m["r1"]
    r.report_asked = 1.0
    r.report = StatusReport(load_query_id(1_000_000_000), (
        ComponentStatus("admission", 1, True, "ready", 0, 0.0, {
            "predicted_queue_s": 0.25, "prefill_tokens_per_s": 1000.0,
            "reserved_kv_blocks": 20.0}),
        ComponentStatus("kv_manager", 2, True, "ready", 0, 0.0,
                        {"total_blocks": 100.0, "free_blocks": 40.0}),
        ComponentStatus("scheduler", 3, True, "ready", 0, 0.0,
                        tenants={"t": TenantUsage(kv_blocks=10), "v": TenantUsage(kv_blocks=50)})))
    holds(r, 1, 2)
    holds(r, 3, tier="cpu")
    holds(r, 4, tenant="v")             # another tenant's block ends the prefix
    f = flight(hashes=(1, 2, 3, 4, 5))
    waiting = flight("w", 500)          # sent, not yet accepted: the report cannot know it
    waiting.pending = 500
    r.open.add("w")
    r.prefilled.append((300, 0.5, 1.5))     # counted waiting by the report, prefilled since
    assert core().state(r, f, {"w": waiting}) == ReplicaState(
        "r1", True, False, cached_tokens=(2 + 0.5 * 1) * BS, queue_s=0.25 + 200 / 1000,
        prefill_tokens_per_s=1000.0, kv_used=0.6, active_kv=0.2, tenant_share=0.1)


def test_a_request_goes_where_its_prefix_is_and_is_open_there_with_what_is_left():
    c, m = core(), replicas("a", "b")
    holds(m["a"], 11, 12)               # 32 tokens: 16 ms of prefill at 2000 tokens/s
    f = flight(hashes=(11, 12, 13), batch_events=True, deadline_ms=3000)
    assert send(c, f, m, now=0.25) == "best"
    assert (f.replica, f.tried, f.pending, m["a"].open, m["a"].counts["routed"]) == (
        "a", ["a"], 1000 - 32, {"r-1"}, 1)
    sent = c.forwarded(f, now=0.25)
    assert sent == Submit("r-1", prompt="p", tenant="t", deadline_ms=3000)   # unbatched


def test_a_session_stays_on_its_replica_until_it_is_overloaded_or_out():
    c, m = core(), replicas("a", "b")
    holds(m["a"], 1)
    assert send(c, flight("1", hashes=(1,), session_id="s"), m, now=1.0) == "best"
    holds(m["b"], 2)                    # b is better for the next turn: the session stays
    f = flight("2", hashes=(2,), session_id="s", arrival=2.0)
    assert send(c, f, m, now=2.0) == "sticky" and f.replica == "a"
    loaded(m["a"], 5.0)                 # a would miss the interactive class's 3 s
    route = c.route(flight("3", session_id="s", arrival=3.0), m, {}, now=3.0)
    assert (route.decision.replica, route.decision.reason, route.decision.moved_from) == (
        "b", "moved:overloaded", "a")
    m["b"].draining = True              # out of the ranking: the session moves again
    route = c.route(flight("4", session_id="s", arrival=4.0), m, {}, now=4.0)
    assert (route.decision.replica, route.decision.reason, route.decision.moved_from) == (
        "a", "moved:unhealthy", "b")     # a overloaded, but the only one left
    assert c.sessions.moves == 2 and c.sessions.get("s", 4.0) == "a"


def test_a_refusal_for_load_sends_the_request_on_with_what_is_left_of_its_deadlines():
    c, m = core(reroute_attempts=1), replicas("a", "b")
    holds(m["a"], 1)
    f = flight(hashes=(1,), session_id="s", deadline_ms=3000, e2e_deadline_ms=10000, arrival=1.0)
    assert send(c, f, m, now=1.0) == "best" and f.replica == "a"
    refused = Rejected("r-1", "overloaded", "full")
    assert c.reroutes(f, refused, m)
    m["a"].open.discard("r-1")
    assert send(c, f, m, now=1.5) == "rerouted"
    assert (f.replica, f.tried, c.sessions.get("s", 1.5), c.sessions.moves) == (
        "b", ["a", "b"], "b", 1)        # the session follows it
    assert c.forwarded(f, now=1.5) == Submit("r-1", prompt="p", tenant="t", session_id="s",
                                             deadline_ms=2500, e2e_deadline_ms=9500)
    assert c.forwarded(f, now=5.0).deadline_ms == 1       # spent: at least 1 ms
    assert not c.reroutes(f, refused, m)   # tries spent, and no untried replica left


@pytest.mark.parametrize("change, reroutes", [
    ({}, True),
    ({"accepted": True}, False),        # accepted: its refusal is the client's
    ({"cancelled": True}, False),
    ({"reason": "invalid_request"}, False),      # "never", not "not here"
    ({"reason": "deadline_unmeetable"}, True),
    ({"tried": ["a", "b"]}, False),     # no untried replica
    ({"tried": ["a", "x", "y"]}, False),    # past reroute_attempts (2)
    ({"b": "unhealthy"}, False), ({"b": "draining"}, False), ({"b": "retiring"}, False),
])
def test_which_refusals_reroute(change, reroutes):
    c, m = core(), replicas("a", "b")
    f = flight()
    f.tried = change.get("tried", ["a"])
    f.accepted, f.cancelled = change.get("accepted", False), change.get("cancelled", False)
    b = m["b"]
    b.healthy = change.get("b") != "unhealthy"
    b.draining, b.retiring = change.get("b") == "draining", change.get("b") == "retiring"
    assert c.reroutes(f, Rejected("r-1", change.get("reason", "queue_full"), ""), m) == reroutes


def test_a_retry_of_an_idempotent_request_goes_where_its_first_try_went():
    c, m = core(), replicas("a", "b")
    holds(m["a"], 1)
    assert send(c, flight("1", hashes=(1,), idempotency_key="k"), m, now=1.0) == "best"
    holds(m["b"], 2)
    holds(m["b"], 3, tenant="u")
    retry = flight("2", hashes=(2,), idempotency_key="k", attempt=1)
    assert send(c, retry, m, now=2.0) == "idempotent" and retry.replica == "a"
    other = flight("3", hashes=(3,), idempotency_key="k", tenant="u")   # not its key
    assert send(c, other, m, now=2.0) == "best" and other.replica == "b"
    m["a"].healthy = False              # where it went is out: the best one now
    again = flight("4", hashes=(2,), idempotency_key="k", attempt=2)
    assert send(c, again, m, now=3.0) == "best" and again.replica == "b"
    assert c.idempotent.get(("t", "k"), 3.0) == "b"
    assert c.idempotent.get(("t", "k"), 3.0 + 600.0 + 1e-3) is None     # its TTL


def test_round_robin_takes_the_eligible_replicas_in_name_order():
    c, m = core("round_robin"), replicas("c", "a", "b")
    m["b"].retiring = True
    names = []
    for i in range(4):
        f = flight(str(i))
        assert send(c, f, m, now=1.0) == "round_robin"
        names.append(f.replica)
    assert names == ["c", "a", "c", "a"]     # the turn advances before each pick


def test_no_replica_left_is_no_decision():
    c, m = core(), replicas("a", "b")
    m["b"].healthy = False
    f = flight()
    f.tried = ["a"]
    route = c.route(f, m, {}, now=1.0)
    assert route.ranked == [] and route.decision is None


@pytest.mark.parametrize("tenant, kw, seconds", [
    ("t", {"deadline_ms": 1500}, 1.5),                 # its own
    ("t", {}, 3.0),                                    # its tenant's default class
    ("t", {"service_class": "batch"}, 60.0),           # the class it names
    ("u", {}, 60.0),                                   # its tenant's first class
    ("t", {"service_class": "free"}, 2.0),             # a class with no TTFT SLO
    ("default", {}, 3.0),                              # its default: the config's first class
    ("nobody", {}, 2.0),
])
def test_the_ttft_deadline(tenant, kw, seconds):
    assert ttft_deadline_s(Submit("r", prompt="p", **kw), tenant, ADMISSION, 2.0) == seconds


def test_a_prompt_is_noted_prefilled_once_and_the_notes_are_bounded():
    r = replicas("a")["a"]
    f = flight()
    f.pending, f.accepted_at = 700, 1.25
    note_prefilled(r, f, 2.0)
    note_prefilled(r, f, 3.0)
    assert r.prefilled == [(700, 1.25, 2.0)] and f.prefilled
    r.prefilled = [(i, 0.0, 0.0) for i in range(MAX_PREFILLED)]
    note_prefilled(r, flight(), 4.0)
    assert len(r.prefilled) == MAX_PREFILLED and r.prefilled[0] == (1, 0.0, 0.0)
    assert r.prefilled[-1] == (0, 0.0, 4.0)


def test_what_the_router_does_with_each_answer_of_a_replica():
    c, m = core(reroute_attempts=1), replicas("a", "b")
    f = flight(tokens=500)
    assert send(c, f, m, now=1.0) == "best" and f.replica == "a"
    a = m["a"]
    assert c.answered(f, a, Accepted("r-1", 500, 0, "interactive"), m, 1.25) == "relay"
    assert (f.accepted, f.accepted_at) == (True, 1.25)
    assert c.answered(f, a, TextDelta("r-1", "x", (1,), 0), m, 1.5) == "relay"
    assert c.answered(f, a, TextDelta("r-1", "y", (2,), 0), m, 1.75) == "relay"
    assert a.prefilled == [(500, 1.25, 1.5)]            # its first token only
    assert c.answered(f, a, Finished("r-1", "stop", Usage(500, 2, 0)), m, 2.0) == "end"
    assert a.counts["finished"] == 1 and a.prefilled == [(500, 1.25, 1.5)]

    g = flight("r-2", tokens=300)
    assert send(c, g, m, now=3.0) == "best" and g.replica == "a"
    assert c.answered(g, a, Rejected("r-2", "queue_full", ""), m, 3.25) == "reroute"
    assert (a.counts["rerouted.queue_full"], "r-2" in a.open, a.prefilled[-1]) == (
        1, False, (500, 1.25, 1.5))                  # a refused prompt was not prefilled
    assert send(c, g, m, now=3.25) == "rerouted" and g.replica == "b"
    # the second refusal goes to the client: no try left
    assert c.answered(g, m["b"], Rejected("r-2", "queue_full", ""), m, 3.5) == "end"
    assert m["b"].counts["rejected"] == 1 and m["b"].prefilled == [(g.pending, 0.0, 3.5)]
