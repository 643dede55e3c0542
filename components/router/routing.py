"""The router's decisions, pure: which replica a request goes to, what it is sent as, and
whether a refusal sends it on to another. No sockets and no clock of its own (the service
passes ``now``, monotonic seconds), so each rule is tested by building ``RoutingCore``.

Per request (a ``Flight``) and per try:

1. the candidates are the replicas it has not tried that are not retiring; each is seen as
   a ``ReplicaState`` (``replica_state``: the prefix it holds of the prompt, its queue by
   its last load report corrected by what the router sent since, its pools);
2. ``scoring.rank`` orders the eligible ones against the request's TTFT deadline
   (``ttft_deadline_s``) less the time it has spent at the router;
3. the decision (``RoutingCore.decide``): round robin under that policy; else a retry of
   an idempotent request goes where its first try went; a reroute takes the best left,
   and its session follows it; else the session table keeps a session on its replica or
   moves it (scoring.py);
4. the request is sent with ``batch_events`` off (the router relays events one by one)
   and, on a second try, what is left of its deadlines (``forwarded``).

A rejection for load before the request was accepted (``REROUTE``) sends it to the next
replica while tries are left (``reroute_attempts``) and an untried healthy replica is.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from components.router.index import PrefixMatch
from components.router.membership import Replica
from components.router.scoring import (
    Decision,
    ReplicaState,
    Score,
    SessionTable,
    predicted_queue_s,
    rank,
)
from schemas.client import Accepted, Cancelled, Failed, Finished, Rejected, Submit, TextDelta
from schemas.config import AdmissionConfig, RouterConfig
from schemas.resolve import resolve

# rejections that say "not here, not now", not "never": another replica may take it
REROUTE = frozenset({"overloaded", "deadline_unmeetable", "queue_full", "draining",
                     "kv_pressure", "tpot_slo_at_risk"})
TERMINAL = (Finished, Rejected, Cancelled, Failed)
MAX_PREFILLED = 4096                 # prefilled prompts kept while no report comes
# (tenant, idempotency key) -> the replica that ran it, for a retry: ten replicas' worth of
# the streamer's own table (10,000 each); a replica forgets its own past that anyway
MAX_IDEMPOTENT = 100_000


@dataclass
class Flight:
    """A request the router holds between its submit and its terminal message."""

    identity: bytes
    submit: Submit
    tenant: str
    arrival: float
    prompt_tokens: int
    replica: str = ""
    pending: int = 0                    # prompt tokens its replica has still to prefill
    accepted_at: float = 0.0            # when the replica's Accepted came (0: not yet)
    prefilled: bool = False             # its first token came
    tried: list[str] = field(default_factory=list)
    accepted: bool = False
    cancelled: bool = False             # the client has its terminal; awaiting the replica's
    hashes: list[int] = field(default_factory=list)
    public_scope: str = ""
    public_blocks: int = 0
    traceparent: str | None = None
    # what it takes to continue it on another replica (migration.py): the prompt's token
    # ids (intake: tokenized as a replica would; None: not tokenized, not resumable) and
    # the output token ids relayed to its client so far
    prompt_ids: list[int] | None = None
    out_ids: list[int] = field(default_factory=list)
    # its lease: the placement in force is (replica, generation), and the replica knows it
    # by ``wire_id`` (its request id, then a fresh id per migration): an event under any
    # other id, or from any other replica, is an old placement's and is dropped
    generation: int = 0
    wire_id: str = ""
    announced: bool = False             # its client has its Accepted
    migrated_at: float = 0.0            # when its latest migration began (0: none open)
    first_token_at: float = 0.0         # when its client's first token came
    held_at: float = 0.0                # when the fleet queue took it (0: never held)
    placed_at: float = 0.0              # when its latest placement was sent (0: none)

    @property
    def request_id(self) -> str:
        return self.submit.request_id


@dataclass(frozen=True)
class Route:
    """One routing decision: the eligible candidates ranked, and where it goes (None:
    nowhere, the request is refused)."""

    ranked: list[Score]
    decision: Decision | None


def ttft_deadline_s(sub: Submit, tenant: str, admission: AdmissionConfig,
                    fallback_s: float) -> float:
    """The request's TTFT deadline in seconds from its arrival: its own, else its class's
    (``schemas.resolve``: the class its replica's admission grants it, or counts it under
    if it refuses it), else ``fallback_s`` (the router's overload bound)."""
    ms = resolve(admission, tenant, sub.service_class, sub.deadline_ms).deadline_ms
    return ms / 1e3 if ms is not None else fallback_s


def prefill_rate(r: Replica, default: float) -> float:
    """``r``'s measured prefill rate (tokens/s), ``default`` until it has one."""
    return r.stat("admission", "prefill_tokens_per_s", 0.0) or default


def sent_to(r: Replica, flights: Mapping[str, Flight]) -> list[tuple[int, float, float]]:
    """What ``predicted_queue_s`` needs of the prompts the router sent ``r``: those
    waiting, and those prefilled since its last report."""
    waiting = [(f.pending, f.accepted_at, 0.0) for rid in r.open
               if (f := flights.get(rid)) is not None and not f.prefilled]
    return waiting + r.prefilled


def note_prefilled(r: Replica, f: Flight, now: float) -> None:
    """``f``'s prompt is computed on ``r`` at ``now`` (its first token came, or it ended)."""
    if not f.prefilled:
        f.prefilled = True
        r.prefilled.append((f.pending, f.accepted_at, now))
        del r.prefilled[:-MAX_PREFILLED]


def route_attributes(f: Flight, ranked: list[Score], policy: str) -> dict[str, Any]:
    """A ``router.route`` span's attributes before its decision: the request, the try,
    and each ranked replica's score, predicted TTFT, saved prefill and overload."""
    attrs: dict[str, Any] = {
        "weir.request_id": f.request_id, "gen_ai.usage.input_tokens": f.prompt_tokens,
        "weir.tenant": f.tenant, "weir.route.policy": policy,
        "weir.route.attempt": len(f.tried),
        "weir.route.replicas": [s.name for s in ranked],
        "weir.route.scores": [round(s.score, 6) for s in ranked],
        "weir.route.ttft_s": [round(s.ttft_s, 6) for s in ranked],
        "weir.route.saved_prefill_s": [round(s.saved_s, 6) for s in ranked],
        "weir.route.overloaded": [s.overloaded for s in ranked]}
    if f.submit.session_id is not None:
        attrs["weir.session"] = f.submit.session_id
    return attrs


class RoutingCore:
    """The router's decisions and the tables they keep: sessions, idempotent requests'
    replicas, the round-robin turn."""

    def __init__(self, rc: RouterConfig, admission: AdmissionConfig, block_size: int,
                 idempotency_ttl_s: float) -> None:
        self.rc = rc
        self.admission = admission
        self.block_size = block_size
        self.sessions = SessionTable(rc.session_ttl_s, rc.max_sessions)
        self.idempotent = SessionTable(idempotency_ttl_s, MAX_IDEMPOTENT)
        self.rr = 0

    def expire(self, now: float) -> None:
        self.sessions.expire(now)
        self.idempotent.expire(now)

    def rate(self, r: Replica) -> float:
        return prefill_rate(r, self.rc.default_prefill_tokens_per_s)

    def queue_s(self, r: Replica, flights: Mapping[str, Flight]) -> float:
        """``r``'s predicted wait before a new prompt's prefill: its last load report,
        plus the prefill the report cannot know of yet (``scoring.predicted_queue_s``)."""
        return predicted_queue_s(r.stat("admission", "predicted_queue_s", 0.0),
                                 r.report_asked, sent_to(r, flights), self.rate(r))

    def state(self, r: Replica, f: Flight, flights: Mapping[str, Flight]) -> ReplicaState:
        """What the router knows of ``r`` for ``f``: the prefix it holds, its queue (its
        last report, plus the prefill the report cannot know of yet), its pools."""
        m = r.index.match(f.hashes, f.public_scope, f.public_blocks, f.tenant) \
            if f.hashes else PrefixMatch()
        cached = (m.gpu_blocks + self.rc.weights.cpu_tier * m.cpu_blocks) * self.block_size
        rate = self.rate(r)
        total = r.stat("kv_manager", "total_blocks", 0.0)
        free = r.stat("kv_manager", "free_blocks", total)
        reserved = r.stat("admission", "reserved_kv_blocks", 0.0)
        return ReplicaState(
            r.spec.name, r.healthy, r.draining, cached, self.queue_s(r, flights), rate,
            (total - free) / total if total else 0.0,
            min(reserved / total, 1.0) if total else 0.0,
            r.tenant_blocks(f.tenant) / total if total else 0.0)

    def ranking(self, f: Flight, replicas: Iterable[Replica], flights: Mapping[str, Flight],
                now: float, since: float | None = None) -> list[Score]:
        """The ``replicas`` ``f`` has not tried and that are not retiring, eligible ones
        only, best first (``scoring.rank``) against its deadline less the time since
        ``since`` (its arrival by default): decides nothing."""
        candidates = [r for r in replicas if r.spec.name not in f.tried and not r.retiring]
        deadline_s = ttft_deadline_s(f.submit, f.tenant, self.admission,
                                     self.rc.overload_ttft_s)
        states = [self.state(r, f, flights) for r in candidates]
        start = f.arrival if since is None else since
        return rank(states, f.prompt_tokens, deadline_s - (now - start),
                    self.rc.weights, self.rc.kv_high, self.rc.policy == "cache_aware")

    def full(self, f: Flight, replicas: Iterable[Replica], flights: Mapping[str, Flight],
             now: float) -> bool | None:
        """Whether no replica can take ``f`` now: every eligible one is overloaded for it,
        as for a request arriving now (the time it has waited in the fleet queue does not
        make a replica overloaded; its deadline's passing is the queue's to refuse);
        None: none is eligible at all."""
        ranked = self.ranking(f, replicas, flights, now, since=now)
        return ranked[0].overloaded if ranked else None

    def held_until(self, f: Flight, max_wait_s: float) -> float:
        """The latest ``f`` may wait in the fleet queue (fleetq.py): its TTFT deadline (its
        own or its class's), its end-to-end deadline, or ``max_wait_s``, from its
        arrival."""
        ms = resolve(self.admission, f.tenant, f.submit.service_class,
                     f.submit.deadline_ms).deadline_ms
        e2e = f.submit.e2e_deadline_ms
        return f.arrival + min(max_wait_s, ms / 1e3 if ms is not None else max_wait_s,
                               e2e / 1e3 if e2e is not None else max_wait_s)

    def route(self, f: Flight, replicas: Iterable[Replica], flights: Mapping[str, Flight],
              now: float) -> Route:
        """Where ``f`` goes now, among the ``replicas`` it has not tried and that are not
        retiring."""
        ranked = self.ranking(f, replicas, flights, now)
        return Route(ranked, self.decide(f, ranked, now))

    def decide(self, f: Flight, ranked: list[Score], now: float) -> Decision | None:
        if not ranked:
            return None
        sub = f.submit
        if self.rc.policy == "round_robin":
            names = sorted(s.name for s in ranked)
            self.rr += 1
            return Decision(names[self.rr % len(names)], "round_robin")
        if sub.idempotency_key is not None and not f.tried:   # a retry goes where it went
            where = self.idempotent.get((f.tenant, sub.idempotency_key), now)
            if where is not None and any(s.name == where for s in ranked):
                return Decision(where, "idempotent")
        decision: Decision | None
        if f.tried:                       # a reroute: the best left; a session follows it
            decision = Decision(ranked[0].name,
                                "migrated" if f.migrated_at and not f.accepted else "rerouted")
            if sub.session_id is not None:
                self.sessions.assign(sub.session_id, decision.replica, now)
        else:
            decision = self.sessions.decide(sub.session_id, ranked, now)
        if decision is not None and sub.idempotency_key is not None:
            self.idempotent.assign((f.tenant, sub.idempotency_key), decision.replica, now)
        return decision

    def assign(self, f: Flight, r: Replica, route: Route) -> None:
        """``f`` goes to ``r`` (``route``'s decision): it is open there, with the prompt
        tokens ``r`` has still to prefill (less the prefix it holds)."""
        f.replica = r.spec.name
        f.tried.append(r.spec.name)
        cached = next((s.saved_s for s in route.ranked if s.name == r.spec.name), 0.0)
        f.pending = max(f.prompt_tokens - int(cached * self.rate(r)), 0)
        f.accepted_at, f.prefilled = 0.0, False
        if not f.wire_id:
            f.wire_id = f.request_id
        r.open.add(f.request_id)
        r.counts["routed"] += 1

    @staticmethod
    def forwarded(f: Flight, now: float) -> Submit:
        """The Submit sent for ``f``'s latest try: events unbatched (this router relays
        them one by one: a replica must not batch them for it); on a second try, what is
        left of its deadlines (at least 1 ms)."""
        sub = msgspec.structs.replace(f.submit, batch_events=False) \
            if f.submit.batch_events else f.submit
        if f.tried[1:]:
            def left(ms: int | None) -> int | None:
                return None if ms is None else max(int(ms - (now - f.arrival) * 1e3), 1)
            sub = msgspec.structs.replace(sub, deadline_ms=left(sub.deadline_ms),
                                          e2e_deadline_ms=left(sub.e2e_deadline_ms))
        return sub

    def answered(self, f: Flight, r: Replica, body: Any, replicas: Iterable[Replica],
                 now: float) -> Literal["relay", "reroute", "end"]:
        """``f``'s replica ``r`` answered ``body`` at ``now``: what the router does with it.
        ``reroute``: a refusal for load (``reroutes``), no longer open on ``r``: route it
        again, the client hears nothing of it; ``end``: its terminal, relayed, after which
        the router forgets it; ``relay``: any other answer, relayed."""
        if isinstance(body, Accepted):
            f.accepted = True
            f.accepted_at = now
        elif isinstance(body, TextDelta):
            note_prefilled(r, f, now)
            if body.index == 0:
                f.out_ids.extend(body.token_ids)
                f.first_token_at = f.first_token_at or now
        if isinstance(body, Rejected) and body.reason in REROUTE:
            r.counts["load_rejected"] += 1          # an autoscaling signal (signals.py)
        if isinstance(body, Rejected) and self.reroutes(f, body, replicas):
            r.counts[f"rerouted.{body.reason}"] += 1
            r.open.discard(f.request_id)
            return "reroute"
        if isinstance(body, TERMINAL):
            r.counts[type(body).__name__.lower()] += 1
            note_prefilled(r, f, now)
            return "end"
        return "relay"

    def reroutes(self, f: Flight, rejected: Rejected, replicas: Iterable[Replica]) -> bool:
        """Whether ``rejected``, from ``f``'s replica, sends ``f`` on to another: a
        refusal for load, before it was accepted and while its client waits, with tries
        left and an untried replica that is healthy, not draining and not retiring."""
        return (not f.accepted and not f.cancelled and rejected.reason in REROUTE
                and len(f.tried) <= self.rc.reroute_attempts
                and any(o.healthy and not o.draining and not o.retiring
                        and o.spec.name not in f.tried for o in replicas))
