"""The router process: one client endpoint in front of several Weir engines (replicas).

Clients (the SDK, the HTTP gateway, ``weir status``) see one Weir: the router speaks the
client protocol (docs/PROTOCOL.md) on ``topology.client_endpoint`` and is itself a client
of each replica's endpoint. Per request it:

1. tokenizes the prompt and hashes its full blocks exactly as a replica's tokenizer does
   (``PromptHasher``), scoped to the tenant;
2. looks the hashes up in its per-replica prefix index (``index.py``), fed by each
   replica's KV event stream; off the hot path, approximate, resynced on a gap;
3. ranks the replicas by saved prefill against queue delay, KV pressure and tenant
   pressure (``scoring.py``), from each replica's load report (its status, asked every
   ``load_interval_s``) plus what the router sent it since;
4. keeps a session (``Submit.session_id``) on its replica while that replica is healthy
   and meets the deadline, and moves it, recorded, when not;
5. forwards the request, and relays every answer frame untouched to the client.

Before any of that, a Submit is authenticated (with keys configured, one without a valid
key is refused at once, ``unauthenticated``) and bounded (``check_submit``: every limit that
needs no tokenizer), so no work proportional to a request is done for one that is not
allowed; the client socket drops a frame larger than a legal request can be
(``client_frame_limit``) before it is read. A long prompt is tokenized and hashed on a
worker thread (the tokenizer releases the GIL): a legal 256K-character prompt takes
~0.1-0.25 s, which on the event loop stalled every relay, heartbeat and verdict. Issue 43
(D2): a 4 MB prompt with no credentials blocked the router 3.6 s, its ticker then declared
a healthy replica lost and its reaper cancelled healthy clients.

A rejection for load (admission's ``overloaded``, ``deadline_unmeetable``, ``queue_full``,
``kv_pressure``, ``tpot_slo_at_risk``, ``draining``) before the request was accepted is admission's ``route`` decision: the router
sends the request to the next replica, with what is left of its deadline. A replica silent
for ``heartbeat_timeout_s`` (or one that restarted) is out: each request open on it ends
``failed`` and new requests go elsewhere. Each decision is a ``router.route`` span with the
per-replica scores.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import structlog
import zmq
from opentelemetry import trace

from bus import tracing
from bus.codec import Codec, salvage_request_id
from bus.component import Component
from bus.socket import BusSocket, MalformedFrame
from schemas.frames import client_frame_limit
from schemas.limits import MAX_ID_CHARS
from schemas.validate import check_submit
from components.router.index import PrefixMatch, ReplicaIndex
from components.router.scoring import (Decision, ReplicaState, Score, SessionTable,
                                       predicted_queue_s, rank)
from bus.identity import (Identity, Keyring, Refusal, load_service_key,
                                          visible_status)
from components.model.prompt import PromptHasher
from schemas.client import (Accepted, Cancel, Cancelled, ChangeReplicas, ClientMsg,
                            ComponentStatus, Failed, Finished, Heartbeat, Rejected,
                            ReplicasChanged, ServerHeartbeat, ServerMsg, StatusQuery,
                            StatusReport, Submit, TextDelta, malformed_reply)
from schemas.config import ConfigError, ReplicaSpec
from schemas.wire import ClusterStatus, KvEventsMsg, StreamerMsg

log = structlog.get_logger("router")
_TRACER = trace.get_tracer("weir.router")
TERMINAL = (Finished, Rejected, Cancelled, Failed)
# rejections that say "not here, not now", not "never": another replica may take it
REROUTE = frozenset({"overloaded", "deadline_unmeetable", "queue_full", "draining",
                     "kv_pressure", "tpot_slo_at_risk"})
_LOAD_QUERY = "router-load"         # a load query's id: this, ':', when it was sent (ns)


_MAX_PREFILLED = 4096                # prefilled prompts kept while no report comes
MAX_CHANGES = 64                     # replicas added and removed in one ChangeReplicas
# A prompt of at most this many characters is tokenized on the event loop (~1 ms, less
# than a thread's round trip is worth); a longer one on a worker thread. Measured on a
# 2-core EPYC: 4096 characters of random words 2.4 ms, 262,144 (8192 x 32) 110-250 ms, a
# hop to a thread 46 us. Token ids are only range-checked and hashed (8191: 1.1 ms).
INLINE_CHARS = 2048
TOKENIZE_THREADS = 2                 # prompts tokenized at once (each holds a core)
MAX_TOKENIZING = 64                  # waiting for a thread, or on one: past it, overloaded
# (tenant, idempotency key) -> the replica that ran it, for a retry: ten replicas' worth of
# the streamer's own table (10,000 each); a replica forgets its own past that anyway
MAX_IDEMPOTENT = 100_000


def _asked_at(query_id: str) -> float:
    """When the router sent the load query ``query_id`` (monotonic seconds; 0 if the id
    is not one of its own)."""
    try:
        return int(query_id.rpartition(":")[2]) / 1e9
    except ValueError:
        return 0.0


@dataclass
class Replica:
    spec: ReplicaSpec
    sock: BusSocket
    events: BusSocket | None
    index: ReplicaIndex = field(default_factory=ReplicaIndex)
    instance: int | None = None
    last_heard: float = 0.0
    healthy: bool = False
    draining: bool = False
    report: StatusReport | None = None
    report_asked: float = 0.0           # when the query that ``report`` answers was sent
    # prompts prefilled since ``report_asked``: (tokens, accepted at, prefilled at)
    prefilled: list[tuple[int, float, float]] = field(default_factory=list)
    open: set[str] = field(default_factory=set)
    counts: Counter = field(default_factory=Counter)
    retiring: bool = False              # removed: no new requests; let go once none is open
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)   # its loops

    def stat(self, component: str, key: str, default: float = 0.0) -> float:
        if self.report is None:
            return default
        for c in self.report.components:
            if c.name == component:
                return c.stats.get(key, default)
        return default

    def tenant_blocks(self, tenant: str) -> int:
        if self.report is None:
            return 0
        return sum(c.tenants[tenant].kv_blocks for c in self.report.components
                   if tenant in c.tenants)


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


class RouterService(Component):
    name = "router"

    async def setup(self) -> None:
        rc = self.config.router
        if not rc.replicas:
            raise ValueError("router.replicas is empty: name at least one engine to route to")
        self.rc = rc
        self.prompts = PromptHasher(self.config)
        self.keys = Keyring(self.config.gateway.api_keys)
        self.service_key = load_service_key()
        self.instance = time.time_ns()
        self.draining = False
        self.cluster = ClusterStatus((), False)
        self.sessions = SessionTable(rc.session_ttl_s, rc.max_sessions)
        self.idempotent = SessionTable(self.config.streamer.idempotency_ttl_s, MAX_IDEMPOTENT)
        self.tokenizing = 0
        self.tokenize_limiter = anyio.CapacityLimiter(TOKENIZE_THREADS)
        self.flights: dict[str, Flight] = {}
        self.last_seen: dict[bytes, float] = {}
        self.counts: Counter[str] = Counter()
        self.rr = 0
        self.replies = Codec(ServerMsg)
        self.clients = self.socket(
            zmq.ROUTER, "clients", ClientMsg,
            max_msg_size=client_frame_limit(self.config.engine.max_model_len)).bind(
            self.topology.client_endpoint)
        # the supervisor relays this process's own cluster (router, gateway) here, as it
        # does to a streamer: the router is the client-facing process of its cluster
        self.inbox_sock = self.socket(zmq.PULL, "inbox", StreamerMsg).bind(
            self.topology.inbox("streamer", bind=True))
        self.replicas: dict[str, Replica] = {}
        for spec in rc.replicas:
            self._connect(spec)

    def _connect(self, spec: ReplicaSpec) -> Replica:
        sock = self.socket(zmq.DEALER, f"to_{spec.name}").connect(spec.endpoint)
        events = (self.socket(zmq.SUB, f"events_{spec.name}", KvEventsMsg)
                  .connect(spec.kv_events) if spec.kv_events else None)
        r = self.replicas[spec.name] = Replica(spec, sock, events)
        return r

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._client_loop)
            tg.start_soon(self._cluster_loop)
            tg.start_soon(self._ticker)
            for r in self.replicas.values():
                tg.start_soon(self._serve, r)

    async def _serve(self, r: Replica) -> None:
        """A replica's loops, until it is let go (``r.scope`` cancelled)."""
        with r.scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._replica_loop, r)
                if r.events is not None:
                    tg.start_soon(self._events_loop, r)

    async def drain(self) -> None:
        self.draining = True

    # ------------------------------------------------------------------ clients
    async def _reply_malformed(self, frame: MalformedFrame) -> None:
        if frame.identity is None:
            return
        rid = salvage_request_id(frame.data)
        await self.clients.send(
            malformed_reply(frame.error, rid if rid not in self.flights else None),
            to=frame.identity)

    async def _client_loop(self) -> None:
        while True:
            # a receive with frames queued completes without giving the loop up: a flood of
            # client frames would run here back to back while every relay and heartbeat
            # waits (as in the streamer). One message, then the others' turn.
            await anyio.lowlevel.checkpoint()
            msg = await self.clients.recv(on_malformed=self._reply_malformed)
            who = msg.identity
            self.last_seen[who] = time.monotonic()
            match msg.body:
                case Submit() as sub:
                    await self._submit(who, sub, msg.envelope.traceparent)
                case Cancel(request_id=rid):
                    f = self.flights.get(rid)
                    if f is not None and f.identity == who and not f.cancelled:
                        await self._cancel(f, "cancelled by client")
                case Heartbeat():
                    await self.clients.send(ServerHeartbeat(self.instance, self.draining),
                                            to=who)
                case StatusQuery(query_id=qid, api_key=key):
                    await self.clients.send(self._status(qid, key), to=who)
                case ChangeReplicas() as change:
                    await self.clients.send(self._change(change), to=who)

    async def _submit(self, who: bytes, sub: Submit, traceparent: str | None) -> None:
        """Who is asking, then every bound, then (only then) the prompt's tokens and block
        hashes, then a replica. The request id is taken before the tokens are awaited: a
        duplicate is refused meanwhile, and a cancel (or its client's going) answers it."""
        rid = sub.request_id
        self.counts["submitted"] += 1
        who_is = self.keys.identify(sub.api_key, sub.tenant)
        if isinstance(who_is, Refusal):
            self.counts["unauthenticated"] += 1
            return await self._refuse(who, Rejected(rid, "unauthenticated", who_is.message))
        if rid in self.flights:
            return await self._refuse(who, Rejected(rid, "invalid_request",
                                                    "request_id is already open"))
        if self.draining:
            return await self._refuse(who, Rejected(rid, "draining", "the router is draining"))
        if (bad := check_submit(sub, self.config.engine.max_model_len)) is not None:
            return await self._refuse(who, Rejected(rid, bad[0], bad[1]))
        f = Flight(who, sub, who_is.tenant, time.monotonic(), 0, traceparent=traceparent)
        if sub.prompt_token_ids is not None or _text_chars(sub) <= INLINE_CHARS:
            self.flights[rid] = f
            self._tokenized(f, self._tokens(sub, f.tenant))
            return await self._route(f)
        if self.tokenizing >= MAX_TOKENIZING:
            return await self._refuse(who, Rejected(
                rid, "overloaded", f"{MAX_TOKENIZING} long prompts are being tokenized", 1.0))
        self.flights[rid] = f
        self.tokenizing += 1
        self._tg.start_soon(self._tokenize_and_route, f)

    async def _refuse(self, who: bytes, rejected: Rejected) -> None:
        self.counts["rejected"] += 1
        await self.clients.send(rejected, to=who)

    async def _tokenize_and_route(self, f: Flight) -> None:
        """A long prompt's tokens on a worker thread, then its route, unless it was ended
        meanwhile (cancelled, or its client gone: it has its terminal already)."""
        try:
            tokens = await anyio.to_thread.run_sync(self._tokens, f.submit, f.tenant,
                                                    limiter=self.tokenize_limiter)
        finally:
            self.tokenizing -= 1
        if self.flights.get(f.submit.request_id) is not f or f.cancelled:
            return
        self._tokenized(f, tokens)
        await self._route(f)

    def _tokens(self, sub: Submit, tenant: str) -> tuple[int, list[int], str, int]:
        """The prompt's token count and its blocks' hashes (public scope, blocks in it);
        none if it cannot be tokenized (the replica rejects it, with the reason). Reads
        only the hasher, which nothing changes after setup: safe on a worker thread."""
        ids = self.prompts.tokenize(sub.prompt, sub.messages, sub.prompt_token_ids,
                                    tools=sub.tools)
        if not isinstance(ids, list):
            return 0, [], "", 0
        return len(ids), *self.prompts.hashes(tenant, ids)

    @staticmethod
    def _tokenized(f: Flight, tokens: tuple[int, list[int], str, int]) -> None:
        f.prompt_tokens, f.hashes, f.public_scope, f.public_blocks = tokens

    async def _route(self, f: Flight) -> None:
        """Send ``f`` to the best replica it has not tried; or, if none is left, end it."""
        rid = f.submit.request_id
        now = time.monotonic()
        candidates = [r for name, r in self.replicas.items()
                      if name not in f.tried and not r.retiring]
        deadline_s = self._deadline_s(f)
        states = [self._state(r, f) for r in candidates]
        use_prefix = self.rc.policy == "cache_aware"
        ranked = rank(states, f.prompt_tokens, deadline_s - (now - f.arrival),
                      self.rc.weights, self.rc.kv_high, use_prefix)
        decision = self._decide(f, ranked, now)
        with _TRACER.start_as_current_span(
                "router.route", context=tracing.context_from(f.traceparent)) as span:
            span.set_attributes({
                "weir.request_id": rid, "gen_ai.usage.input_tokens": f.prompt_tokens,
                "weir.tenant": f.tenant, "weir.route.policy": self.rc.policy,
                "weir.route.attempt": len(f.tried),
                "weir.route.replicas": [s.name for s in ranked],
                "weir.route.scores": [round(s.score, 6) for s in ranked],
                "weir.route.ttft_s": [round(s.ttft_s, 6) for s in ranked],
                "weir.route.saved_prefill_s": [round(s.saved_s, 6) for s in ranked],
                "weir.route.overloaded": [s.overloaded for s in ranked]})
            if f.submit.session_id is not None:
                span.set_attribute("weir.session", f.submit.session_id)
            if decision is None:
                span.set_attribute("weir.route.reason", "no_replica")
                await self._end_here(f, Rejected(
                    rid, "overloaded", "no replica can take this request now",
                    retry_after_s=self.rc.heartbeat_timeout_s))
                return
            span.set_attributes({"weir.route.replica": decision.replica,
                                 "weir.route.reason": decision.reason})
            if decision.moved_from is not None:
                span.set_attribute("weir.route.moved_from", decision.moved_from)
                log.info("session_moved", session_hash=hash(f.submit.session_id) & 0xFFFF,
                         to=decision.replica, moved_from=decision.moved_from,
                         reason=decision.reason)
            upstream_tp = tracing.traceparent_of(span)
        r = self.replicas[decision.replica]
        f.replica = decision.replica
        f.tried.append(decision.replica)
        cached = next((s.saved_s for s in ranked if s.name == r.spec.name), 0.0)
        f.pending = max(f.prompt_tokens - int(cached * self._rate(r)), 0)
        f.accepted_at, f.prefilled = 0.0, False
        r.open.add(rid)
        r.counts["routed"] += 1
        self.counts[f"reason.{decision.reason}"] += 1
        # this router relays events one by one: a replica must not batch them for it
        sub = msgspec.structs.replace(f.submit, batch_events=False) \
            if f.submit.batch_events else f.submit
        if f.tried[1:]:                   # a second try: what is left of its deadlines
            def left(ms: int | None) -> int | None:
                return None if ms is None else max(int(ms - (now - f.arrival) * 1e3), 1)
            sub = msgspec.structs.replace(sub, deadline_ms=left(sub.deadline_ms),
                                          e2e_deadline_ms=left(sub.e2e_deadline_ms))
        await r.sock.send(sub, traceparent=upstream_tp)

    def _decide(self, f: Flight, ranked: list[Score], now: float) -> Decision | None:
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
        if f.tried:                       # a reroute: the best left; a session follows it
            decision = Decision(ranked[0].name, "rerouted")
            if sub.session_id is not None:
                self.sessions.assign(sub.session_id, decision.replica, now)
        else:
            decision = self.sessions.decide(sub.session_id, ranked, now)
        if decision is not None and sub.idempotency_key is not None:
            self.idempotent.assign((f.tenant, sub.idempotency_key), decision.replica, now)
        return decision

    def _deadline_s(self, f: Flight) -> float:
        """The request's TTFT deadline: its own, else its class's, else the router's
        overload bound."""
        if f.submit.deadline_ms is not None:
            return f.submit.deadline_ms / 1e3
        adm = self.config.admission
        tenant = next((t for t in adm.tenants if t.name == f.tenant), None)
        name = f.submit.service_class or (tenant.default_class if tenant else "") or \
            (tenant.classes[0] if tenant and tenant.classes else "")
        cls = next((c for c in adm.classes if c.name == name), None)
        if cls is not None and cls.ttft_slo_ms is not None:
            return cls.ttft_slo_ms / 1e3
        return self.rc.overload_ttft_s

    def _rate(self, r: Replica) -> float:
        return r.stat("admission", "prefill_tokens_per_s", 0.0) or \
            self.rc.default_prefill_tokens_per_s

    def _state(self, r: Replica, f: Flight) -> ReplicaState:
        """What the router knows of ``r`` for this request: the prefix it holds, its queue
        (its last report, plus the prefill the report cannot know of yet), its pools."""
        m = r.index.match(f.hashes, f.public_scope, f.public_blocks, f.tenant) \
            if f.hashes else PrefixMatch()
        bs = self.config.kv.block_size
        cached = (m.gpu_blocks + self.rc.weights.cpu_tier * m.cpu_blocks) * bs
        rate = self._rate(r)
        total = r.stat("kv_manager", "total_blocks", 0.0)
        free = r.stat("kv_manager", "free_blocks", total)
        reserved = r.stat("admission", "reserved_kv_blocks", 0.0)
        return ReplicaState(
            r.spec.name, r.healthy, r.draining, cached,
            predicted_queue_s(r.stat("admission", "predicted_queue_s", 0.0), r.report_asked,
                              self._sent(r), rate), rate,
            (total - free) / total if total else 0.0,
            min(reserved / total, 1.0) if total else 0.0,
            r.tenant_blocks(f.tenant) / total if total else 0.0)

    def _sent(self, r: Replica) -> list[tuple[int, float, float]]:
        """What ``predicted_queue_s`` needs of the prompts the router sent ``r``: those
        waiting, and those prefilled since its last report."""
        waiting = [(f.pending, f.accepted_at, 0.0) for rid in r.open
                   if (f := self.flights.get(rid)) is not None and not f.prefilled]
        return waiting + r.prefilled

    def _prefilled(self, r: Replica, f: Flight) -> None:
        """``f``'s prompt is computed (its first token came, or it ended)."""
        if not f.prefilled:
            f.prefilled = True
            r.prefilled.append((f.pending, f.accepted_at, time.monotonic()))
            del r.prefilled[:-_MAX_PREFILLED]

    async def _cancel(self, f: Flight, reason: str) -> None:
        """The client hears ``cancelled`` now; the replica is told, and its own terminal
        for the request is swallowed when it comes."""
        rid = f.submit.request_id
        f.cancelled = True
        self.counts["cancelled"] += 1
        await self.clients.send(Cancelled(rid, reason), to=f.identity)
        r = self.replicas.get(f.replica)
        if r is not None and rid in r.open:
            await r.sock.send(Cancel(rid))
        else:
            self._forget(f)

    async def _end_here(self, f: Flight, event: Any) -> None:
        """End a request at the router (the replicas never had it, or lost it)."""
        self.counts[type(event).__name__.lower()] += 1
        self._forget(f)
        if not f.cancelled:
            await self.clients.send(event, to=f.identity)

    def _forget(self, f: Flight) -> None:
        rid = f.submit.request_id
        if self.flights.get(rid) is f:
            del self.flights[rid]
        r = self.replicas.get(f.replica)
        if r is not None:
            r.open.discard(rid)

    # ------------------------------------------------------------------ replicas
    async def _replica_loop(self, r: Replica) -> None:
        """Every frame from a replica: answers for clients go on as they came."""
        while True:
            data = await r.sock.recv_raw()
            try:
                body = self.replies.decode(data).body
            except msgspec.DecodeError:
                r.counts["malformed"] += 1
                continue
            await self._heard(r, body)
            rid = getattr(body, "request_id", None)
            if rid is None:
                continue
            f = self.flights.get(rid)
            if f is None or f.replica != r.spec.name:
                r.counts["late_events"] += 1
                continue
            if isinstance(body, Accepted):
                f.accepted = True
                f.accepted_at = time.monotonic()
            elif isinstance(body, TextDelta):
                self._prefilled(r, f)
            if isinstance(body, Rejected) and not f.accepted and not f.cancelled \
                    and body.reason in REROUTE and len(f.tried) <= self.rc.reroute_attempts \
                    and any(o.healthy and not o.draining and not o.retiring
                            and name not in f.tried for name, o in self.replicas.items()):
                r.counts[f"rerouted.{body.reason}"] += 1
                self.counts["rerouted"] += 1
                r.open.discard(rid)
                await self._route(f)
                continue
            terminal = isinstance(body, TERMINAL)
            if terminal:
                r.counts[type(body).__name__.lower()] += 1
                self._prefilled(r, f)
                self._forget(f)
            if not f.cancelled:
                await self.clients.send_raw(data, to=f.identity)

    async def _heard(self, r: Replica, body: Any) -> None:
        r.last_heard = time.monotonic()
        match body:
            case ServerHeartbeat(instance=instance, draining=draining):
                if r.instance is not None and instance != r.instance:
                    await self._lose(r, "replica restarted")
                r.instance, r.draining = instance, draining
                if not r.healthy:
                    log.info("replica_up", replica=r.spec.name)
                r.healthy = True
            case StatusReport(query_id=qid) as report if qid.startswith(_LOAD_QUERY):
                asked = _asked_at(qid)
                if asked >= r.report_asked:       # not an older answer come late
                    r.report, r.report_asked = report, asked
                    r.prefilled = [p for p in r.prefilled if p[2] > asked]

    async def _lose(self, r: Replica, why: str) -> None:
        """``r`` is out (silent, or restarted): every request open on it fails, its cache
        view is dropped; new requests go elsewhere."""
        r.healthy = False
        r.counts["lost"] += 1
        r.index.clear()
        r.report = None
        log.warning("replica_lost", replica=r.spec.name, why=why, open=len(r.open))
        for rid in list(r.open):
            f = self.flights.get(rid)
            if f is not None:
                await self._end_here(f, Failed(rid, f"replica_lost: {r.spec.name} ({why})"))
        r.open.clear()
        r.prefilled.clear()

    async def _events_loop(self, r: Replica) -> None:
        assert r.events is not None
        while True:
            msg = (await r.events.recv()).body
            if not r.index.apply(msg):
                log.warning("kv_events_gap", replica=r.spec.name, seq=msg.seq)
                r.events.resubscribe()

    async def _ticker(self) -> None:
        """Heartbeats to every replica (their answers are their liveness), load reports at
        ``load_interval_s``, the health verdicts, and silent clients' requests cancelled.

        A gap since the last tick longer than half the heartbeat timeout means this loop
        did not run (a stall of its own, or the whole process descheduled): what replicas
        and clients sent meanwhile may wait unread in the sockets, so the gap is not
        counted against them (``_excuse``), as the streamer's reaper skips such a tick."""
        rc = self.rc
        next_load = 0.0
        last = time.monotonic()
        while True:
            now = time.monotonic()
            if now - last > rc.heartbeat_timeout_s / 2:
                self._excuse(now - last - rc.heartbeat_interval_s, now)
            last = now
            self.sessions.expire(now)
            self.idempotent.expire(now)
            for r in self.replicas.values():
                await r.sock.send(Heartbeat())
                if now >= next_load:
                    await r.sock.send(StatusQuery(f"{_LOAD_QUERY}:{time.monotonic_ns()}",
                                                  self.service_key))
                if r.healthy and now - r.last_heard > rc.heartbeat_timeout_s:
                    await self._lose(r, f"silent for {now - r.last_heard:.1f} s")
            if now >= next_load:
                next_load = now + rc.load_interval_s
            for r in [r for r in self.replicas.values() if r.retiring and not r.open]:
                self._let_go(r)
            await self._reap(now)
            await anyio.sleep(rc.heartbeat_interval_s)

    def _excuse(self, stalled_s: float, now: float) -> None:
        """This loop did not run for ``stalled_s``: every replica and client is heard that
        much later than it was (never later than now)."""
        self.counts["loop_stalls"] += 1
        log.warning("router_loop_stalled", stalled_s=round(stalled_s, 2))
        for r in self.replicas.values():
            r.last_heard = min(r.last_heard + stalled_s, now)
        for who, t in self.last_seen.items():
            self.last_seen[who] = min(t + stalled_s, now)

    async def _reap(self, now: float) -> None:
        timeout = self.config.streamer.client_timeout_s
        gone = {who for who, t in self.last_seen.items() if now - t > timeout}
        if not gone:
            return
        for f in list(self.flights.values()):
            if f.identity in gone and not f.cancelled:
                await self._cancel(f, "client gone")
        for who in gone:
            del self.last_seen[who]

    # ------------------------------------------------------------------ membership
    def _change(self, c: ChangeReplicas) -> ReplicasChanged:
        """An operator's change of replicas: all of it, or (with the reason) none of it."""
        who = self.keys.identify(c.api_key, "default")
        error = "changing replicas needs an operator's key" if not (
            isinstance(who, Identity) and who.sees_all) else self._check_change(c)
        if error is None:
            for a in c.add:
                r = self._connect(ReplicaSpec(a.name, a.endpoint, a.kv_events))
                self._tg.start_soon(self._serve, r)
                log.info("replica_added", replica=a.name)
            for name in c.remove:
                self.replicas[name].retiring = True
                log.info("replica_retiring", replica=name, open=len(self.replicas[name].open))
            self.counts["replica_changes"] += 1
        return ReplicasChanged(
            c.query_id, error, tuple(n for n, r in self.replicas.items() if not r.retiring),
            tuple(n for n, r in self.replicas.items() if r.retiring))

    def _check_change(self, c: ChangeReplicas) -> str | None:
        names = [a.name for a in c.add]
        if len(c.add) + len(c.remove) > MAX_CHANGES:
            return f"at most {MAX_CHANGES} replicas in one change"
        if len(set(names)) != len(names):
            return "add names one replica twice"
        for a in c.add:
            if a.name in self.replicas:
                return f"replica {a.name[:64]!r} is already routed to" + (
                    " (retiring: add it again once it is gone)"
                    if self.replicas[a.name].retiring else "")
            try:
                ReplicaSpec(a.name, a.endpoint, a.kv_events)      # its own checks
            except ConfigError as exc:
                return str(exc)[:300]
            if len(a.name) > MAX_ID_CHARS:
                return f"a replica's name must be at most {MAX_ID_CHARS} characters"
        for name in c.remove:
            r = self.replicas.get(name)
            if r is None or r.retiring or name in names:
                return f"no replica {name[:64]!r} to remove"
        return None

    def _let_go(self, r: Replica) -> None:
        """A retiring replica with nothing open on it: its loops stop, its sockets close."""
        r.scope.cancel()
        for sock in (r.sock, r.events):
            if sock is not None:
                sock.close()
                self._sockets.remove(sock)
        del self.replicas[r.spec.name]
        self.counts["replicas_let_go"] += 1
        log.info("replica_removed", replica=r.spec.name)

    # ------------------------------------------------------------------ status
    async def _cluster_loop(self) -> None:
        while True:
            match (await self.inbox_sock.recv()).body:
                case ClusterStatus() as cluster:
                    self.cluster = cluster

    def _status(self, query_id: str, api_key: str | None) -> StatusReport:
        """The router's own cluster (it is ready while a replica is), then each healthy
        replica's components as ``replica/component``; each tenant's usage only to itself
        or an operator."""
        up = any(r.healthy for r in self.replicas.values())
        comps: list[ComponentStatus] = []
        for c in self.cluster.components:
            if c.name == self.name and c.state == "ready" and not up:
                c = msgspec.structs.replace(c, state="no_replica")
            comps.append(c)
        for r in self.replicas.values():
            if r.healthy and r.report is not None:
                comps += [msgspec.structs.replace(c, name=f"{r.spec.name}/{c.name}")
                          for c in r.report.components]
        who = self.keys.identify(api_key, "default")
        if not (isinstance(who, Identity) and who.sees_all):
            tenant = who.tenant if isinstance(who, Identity) else ""
            comps = [visible_status(c, tenant) for c in comps]
        return StatusReport(query_id, tuple(comps), self.draining or self.cluster.draining)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {"active_requests": len(self.flights),
                                 "clients": len(self.last_seen), "sessions": len(self.sessions),
                                 "tokenizing": self.tokenizing,
                                 "idempotent_keys": len(self.idempotent),
                                 "session_moves": self.sessions.moves,
                                 **{f"requests.{k}": v for k, v in self.counts.items()}}
        for name, r in self.replicas.items():
            out.update({f"replica.{name}.healthy": int(r.healthy),
                        f"replica.{name}.retiring": int(r.retiring),
                        f"replica.{name}.open": len(r.open),
                        f"replica.{name}.index_blocks": len(r.index.blocks),
                        f"replica.{name}.index_gaps": r.index.gaps,
                        f"replica.{name}.index_stored": r.index.stored,
                        f"replica.{name}.index_snapshots": r.index.snapshots,
                        **{f"replica.{name}.{k}": v for k, v in r.counts.items()}})
        return out


def _text_chars(sub: Submit) -> int:
    """The characters a Submit's prompt gives the tokenizer (bounded by check_submit)."""
    if sub.prompt is not None:
        return len(sub.prompt)
    return sum(len(m.content) + len(m.role) + sum(len(c.arguments) for c in m.tool_calls)
               for m in sub.messages or ()) + sum(
        len(t.description or "") + len(t.parameters or "") for t in sub.tools)
