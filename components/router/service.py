"""The router process: one client endpoint in front of several Weir engines (replicas).

Clients (the SDK, the HTTP gateway, ``weir status``) see one Weir: the router speaks the
client protocol (docs/PROTOCOL.md; the loop is ``bus/endpoint.py``'s, shared with the
streamer) and is itself a client of each replica's endpoint. A Submit is authenticated
and bounded (``check_submit``) before any work proportional to it, its prompt tokenized and
hashed as a replica would (``intake.py``), its replica chosen from the prefix index
(``index.py``) and the load reports (``scoring.py``, ``routing.py``: sessions, reroutes,
retries), and every answer frame relayed untouched. A refusal for load before acceptance
sends it on to another replica with what is left of its deadline; a replica silent for
``heartbeat_timeout_s``, or restarted, is out and its requests end ``failed``; replicas
are added and retired by an operator (``membership.py``) or found by resolving a name
(``discovery.py``, ``router.discovery = "dns"``). Each decision is a
``router.route`` span with the per-replica scores. The decisions and the replicas' state
are pure modules; this service wires them to sockets, the clock and the spans
(docs/design/router.md says why it routes as it does).
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import structlog
import zmq
from opentelemetry import trace

from bus import tracing
from bus.codec import Codec
from bus.component import Component
from bus.endpoint import ClientEndpoint
from bus.identity import (
    Identity,
    Keyring,
    Refusal,
    acting_operator,
    load_operator_key,
    load_service_key,
    visible_status,
)
from bus.socket import BusSocket
from components.model.prompt import PromptHasher
from components.router import intake, migration, pool_canary
from components.router.budgets import (
    FleetBudgets,
    estimate,
    reported_outstanding,
    reported_used,
)
from components.router.discovery import Discovery, Resolver, plan, resolver_for
from components.router.fleetq import FleetQueue
from components.router.live_config import RouterLiveConfig, config_stats, history_path
from components.router.membership import Membership, Replica, load_query_id
from components.router.pool_canary import Placed, PoolTrial
from components.router.routing import REROUTE, Flight, RoutingCore, route_attributes
from components.router.signals import signal_stats, targets_s
from components.tenancy.watchdog import Watchdog
from schemas.client import (
    Accepted,
    Cancel,
    Cancelled,
    ChangeReplicas,
    ClientMsg,
    ConfigAnswer,
    ConfigCommand,
    Failed,
    Finished,
    Heartbeat,
    ProtocolError,
    Rejected,
    ReplicasChanged,
    ServerHeartbeat,
    ServerMsg,
    StatusQuery,
    StatusReport,
    Submit,
    TextDelta,
)
from schemas.config import WeirConfig
from schemas.config_change import ConfigVersion, Refused
from schemas.frames import client_frame_limit
from schemas.resolve import resolve
from schemas.validate import check_submit
from schemas.wire import ClusterStatus, KvEventsMsg, StreamerMsg

log = structlog.get_logger("router")


def used(terminal: Any) -> tuple[int, int] | None:
    """The tokens a request used by its terminal, (prompt, completion): a Finished's usage,
    none for a refusal (the replica never ran it); None when it cannot be told (failed,
    cancelled)."""
    if isinstance(terminal, Finished):
        return terminal.usage.prompt_tokens, terminal.usage.completion_tokens
    if isinstance(terminal, Rejected):
        return 0, 0
    return None


_TRACER = trace.get_tracer("weir.router")


@dataclass
class Link:
    """A replica's sockets, and the scope of the loops that read them."""

    sock: BusSocket
    events: BusSocket | None
    scope: anyio.CancelScope


class RouterService(Component):
    name = "router"
    # the lookup under router.discovery = "dns" (None: DnsResolver on discovery_name); a
    # test sets its own before setup
    resolver: Resolver | None = None
    discovery: Discovery | None = None        # under router.discovery = "dns"

    async def setup(self) -> None:
        # the config in force: the TOML, or the version a restarted router goes on with
        self.live = RouterLiveConfig(self.config, history_path(self.config), time.time())
        self.config = self.live.config
        rc = self.config.router
        if not rc.replicas and rc.discovery == "static":
            raise ValueError("router.replicas is empty: name at least one engine to route to")
        if rc.discovery == "dns":
            self.discovery = Discovery(rc.discovery_misses)
        if rc.discovery == "dns" and self.resolver is None:
            self.resolver = resolver_for(rc.discovery_name, rc.discovery_pools,
                                         rc.discovery_port, rc.discovery_kv_events_port)
        self.rc = rc
        self.targets = targets_s(self.config.admission.classes)    # TTFT objectives (s)
        self.prompts = PromptHasher(self.config)
        self.keys = Keyring(self.config.gateway.api_keys)
        self.service_key = load_service_key()
        self.instance = time.time_ns()
        self.draining = False
        self.cluster = ClusterStatus((), False)
        self.routing = RoutingCore(rc, self.config.admission, self.config.kv.block_size,
                                   self.config.streamer.idempotency_ttl_s)
        self.budgets = FleetBudgets(rc.tenants)
        self.fleetq = FleetQueue(rc.tenants, rc.fleet_queue_max) if rc.fleet_queue else None
        self.freed = False              # capacity may have returned: try the fleet queue
        self.slots = 0                  # requests ended on replicas while some were held
        self.tokenizing = 0
        self.tokenize_limiter = anyio.CapacityLimiter(intake.TOKENIZE_THREADS)
        self.flights: dict[str, Flight] = {}
        # a migration's wire id -> its request id (migration.py: the lease)
        self.wires: dict[str, str] = {}
        self.nonce = f"{self.instance:x}"[-8:]
        self.serial = 0
        self.handovers: deque[float] = deque(maxlen=4096)   # migration -> next token (s)
        self.drain_seen: dict[str, float] = {}   # replica -> when it was first seen draining
        self.counts: Counter[str] = Counter()
        self.replies = Codec(ServerMsg)
        self.clients = self.socket(
            zmq.ROUTER, "clients", ClientMsg,
            max_msg_size=client_frame_limit(self.config.engine.max_model_len)).bind(
            self.topology.client_endpoint)
        self.endpoint = ClientEndpoint(self.clients, self)
        # the supervisor relays this process's own cluster (router, gateway) here, as it
        # does to a streamer: the router is the client-facing process of its cluster
        self.inbox_sock = self.socket(zmq.PULL, "inbox", StreamerMsg).bind(
            self.topology.inbox("streamer", bind=True))
        self.members = Membership(rc.replicas)
        # a canary by pool (pool_canary.py): the one under watch, the replicas' answers to
        # the router's own config commands by query id, and a trial the router's last run
        # left (its pool's replicas are rolled back as they answer)
        self.trial: PoolTrial | None = None
        self.engine_answers: dict[str, ConfigAnswer | anyio.Event] = {}
        self.config_serial = 0
        self.orphan = self.live.orphan
        self.pool_rollbacks: deque[float] = deque(maxlen=256)   # trial start -> rolled back
        self.pool_counts: Counter[str] = Counter()
        self.links: dict[str, Link] = {}
        for r in self.members:
            self._connect(r)

    def _connect(self, r: Replica) -> None:
        spec = r.spec
        sock = self.socket(zmq.DEALER, f"to_{spec.name}").connect(spec.endpoint)
        events = (self.socket(zmq.SUB, f"events_{spec.name}", KvEventsMsg)
                  .connect(spec.kv_events) if spec.kv_events else None)
        self.links[spec.name] = Link(sock, events, anyio.CancelScope())

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self.endpoint.serve)
            tg.start_soon(self._cluster_loop)
            tg.start_soon(self._ticker)
            tg.start_soon(self._pool_watch)
            if self.rc.discovery == "dns":
                tg.start_soon(self._discovery_loop)
            for r in self.members:
                tg.start_soon(self._serve, r)

    async def _serve(self, r: Replica) -> None:
        """A replica's loops, until it is let go (its link's scope cancelled)."""
        link = self.links[r.spec.name]
        with link.scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._replica_loop, r, link.sock)
                if link.events is not None:
                    tg.start_soon(self._events_loop, r, link.events)

    async def drain(self) -> None:
        self.draining = True

    # ------------------------------------------------------------------ clients
    # (the client endpoint's loop, bus/endpoint.py, asks these)
    def is_open(self, request_id: str) -> bool:
        return request_id in self.flights

    def holder(self, request_id: str) -> bytes | None:
        f = self.flights.get(request_id)
        return None if f is None or f.cancelled else f.identity

    async def cancel(self, request_id: str, reason: str) -> None:
        await self._cancel(self.flights[request_id], reason)
        self.freed = True

    def malformed_answered(self, reply: Rejected | ProtocolError) -> None:
        pass                              # the router keeps no count of these

    async def submit(self, who: bytes, sub: Submit, traceparent: str | None) -> None:
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
        if intake.inline(sub):
            self.flights[rid] = f
            intake.tokenized(f, intake.prompt_blocks(self.prompts, sub, f.tenant))
            return await self._route(f)
        if self.tokenizing >= (most := intake.MAX_TOKENIZING):
            self.counts["load_rejected"] += 1
            return await self._refuse(who, Rejected(
                rid, "overloaded", f"{most} long prompts are being tokenized", 1.0))
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
            blocks = await anyio.to_thread.run_sync(
                intake.prompt_blocks, self.prompts, f.submit, f.tenant,
                limiter=self.tokenize_limiter)
        finally:
            self.tokenizing -= 1
        if self.flights.get(f.submit.request_id) is not f or f.cancelled:
            return
        intake.tokenized(f, blocks)
        await self._route(f)

    async def _route(self, f: Flight) -> None:
        """Send ``f`` to the best replica it has not tried; or, if none is left, end it."""
        rid = f.submit.request_id
        now = time.monotonic()
        cost = estimate(f.prompt_tokens, f.submit.params.max_tokens, f.submit.params.n,
                        self.config.engine.max_model_len)
        # a reroute, a migration or a release from the fleet queue: counted already
        placed = bool(f.tried or f.generation or f.held_at)
        unreported = any(r.healthy and r.report is None for r in self.members)
        if not placed and (no := self.budgets.check(f.tenant, cost, now, unreported)):
            await self._end_here(f, Rejected(rid, no.reason, no.message, no.retry_after_s))
            return
        if not placed and self.fleetq is not None and await self._hold(f, cost, now):
            return
        route = self.routing.route(f, self.members, self.flights, now)
        ranked, decision = route.ranked, route.decision
        with _TRACER.start_as_current_span(
                "router.route", context=tracing.context_from(f.traceparent)) as span:
            span.set_attributes(route_attributes(f, ranked, self.rc.policy))
            span.set_attribute("weir.config.version", self.live.history.current.version)
            if f.held_at and not f.tried:
                span.set_attribute("weir.fleetq.wait_ms", round((now - f.held_at) * 1e3, 3))
            if decision is None:
                span.set_attribute("weir.route.reason", "no_replica")
                if not f.announced:
                    self.counts["load_rejected"] += 1
                await self._end_here(f, Failed(
                    rid, "replica_lost: no replica can continue it") if f.announced
                    else Rejected(rid, "overloaded", "no replica can take this request now",
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
        r = self.members[decision.replica]
        if placed:
            self.budgets.moved(rid, r.spec.name)
        else:
            self.budgets.place(rid, f.tenant, r.spec.name, cost, now)
            if self.fleetq is not None:
                self.fleetq.placed(rid, f.tenant, f.prompt_tokens)
        self.routing.assign(f, r, route)
        f.placed_at = now
        self.counts[f"reason.{decision.reason}"] += 1
        if r.counts["routed"] == 1:
            log.info("replica_first_request", replica=r.spec.name,
                     since_up_s=round(now - r.up_at, 4),
                     since_found_s=round(now - r.found_at, 4) if r.found_at else None)
        sub = migration.continuation(f, now) if f.generation else self.routing.forwarded(f, now)
        await self.links[r.spec.name].sock.send(sub, traceparent=upstream_tp)

    async def _cancel(self, f: Flight, reason: str) -> None:
        """The client hears ``cancelled`` now; the replica is told, and its own terminal
        for the request is swallowed when it comes. One held in the fleet queue leaves it
        (it never ran: its budget charge is given back)."""
        rid = f.submit.request_id
        f.cancelled = True
        self.counts["cancelled"] += 1
        held = self.fleetq is not None and self.fleetq.remove(rid) is not None
        await self.clients.send(Cancelled(rid, reason), to=f.identity)
        r = self.members.get(f.replica)
        if r is not None and rid in r.open:
            await self.links[r.spec.name].sock.send(Cancel(f.wire_id or rid))
        else:
            self._forget(f, (0, 0) if held else None)

    async def _end_here(self, f: Flight, event: Any) -> None:
        """End a request at the router (the replicas never had it, or lost it)."""
        self.counts[type(event).__name__.lower()] += 1
        self._forget(f, used(event))
        if not f.cancelled:
            await self.clients.send(event, to=f.identity)

    def _forget(self, f: Flight, usage: tuple[int, int] | None = None) -> None:
        """``f`` ended (``usage``: the prompt and completion tokens it used, by its
        terminal; None: unknown)."""
        rid = f.submit.request_id
        if self.flights.get(rid) is f:
            del self.flights[rid]
            self.wires.pop(f.wire_id, None)
            self.budgets.ended(rid, None if usage is None else sum(usage), time.monotonic())
            if self.fleetq is not None:
                self.fleetq.ended(rid, usage)
                self.freed = True
                if f.replica and len(self.fleetq):
                    self.slots += 1
        r = self.members.get(f.replica)
        if r is not None:
            r.open.discard(rid)

    # ------------------------------------------------------------------ fleet queue
    async def _hold(self, f: Flight, cost: int, now: float) -> bool:
        """Hold a fresh request in the fleet queue (fleetq.py) when others are held or no
        eligible replica can take it now, unless its tenant is the least served (it
        passes); refuse it if the queue is full or its deadline would pass in it. False:
        route it now."""
        assert self.fleetq is not None
        full = self.routing.full(f, self.members, self.flights, now)
        if full is None or not (full or len(self.fleetq)) or self.fleetq.passes(f.tenant):
            return False
        rid = f.request_id
        no = self.fleetq.offer(rid, f.tenant, f.prompt_tokens, now,
                               self.routing.held_until(f, self.rc.fleet_queue_max_wait_s))
        if no is not None:
            self.counts["load_rejected"] += 1
            await self._end_here(f, Rejected(rid, no.reason, no.message, no.retry_after_s))
            return True
        f.held_at = now
        self.budgets.place(rid, f.tenant, "", cost, now)   # counted while held, no replica
        self.counts["held"] += 1
        if not full:
            await self._release()
        return True

    async def _release(self) -> None:
        """Send held requests on, least-served tenant first, while the next one's best
        replica can take it, or a request ended on a replica since it was held left a
        slot (``slots``: one release each, so the fleet runs as much as it ran when it
        filled even while the prediction says full); its refusal or a cancel meanwhile
        ends it once."""
        q = self.fleetq
        self.freed = False
        while q is not None and (h := q.head()) is not None:
            f = self.flights.get(h.request_id)
            now = time.monotonic()
            if f is None or f.cancelled:                # ended meanwhile: not held
                q.remove(h.request_id)
                continue
            full = self.routing.full(f, self.members, self.flights, now)
            if full is None or (full and not self.slots):
                return
            if full:
                self.slots -= 1
                self.counts["fleetq.slot_releases"] += 1
            q.release(h.request_id, now)
            await self._route(f)
        self.slots = 0                                  # none held: none banked

    async def _expire_held(self, now: float) -> None:
        """Refuse the held requests whose deadline would pass before a release could place
        them (the next tick and their own prefill), with a retry-after."""
        assert self.fleetq is not None
        for h in self.fleetq.expiring(now, self.rc.heartbeat_interval_s,
                                      self.rc.default_prefill_tokens_per_s):
            f = self.flights.get(h.request_id)
            if f is None or f.cancelled:
                continue
            self.counts["load_rejected"] += 1
            await self._end_here(f, Rejected(
                h.request_id, "deadline_unmeetable",
                f"held {now - h.held_at:.2f} s in the fleet queue: no replica could take it "
                f"before its deadline",
                self.fleetq.releases.retry_after(len(self.fleetq) + 1, now)))

    # ------------------------------------------------------------------ replicas
    async def _replica_loop(self, r: Replica, sock: BusSocket) -> None:
        """Every frame from a replica: answers for clients go on as they came."""
        while True:
            if self.freed and self.fleetq is not None and len(self.fleetq):
                await self._release()
            data = await sock.recv_raw()
            try:
                body = self.replies.decode(data).body
            except msgspec.DecodeError:
                r.counts["malformed"] += 1
                continue
            await self._heard(r, body)
            if isinstance(body, ConfigAnswer):
                waiter = self.engine_answers.get(body.query_id)
                if isinstance(waiter, anyio.Event):
                    self.engine_answers[body.query_id] = body
                    waiter.set()
                continue
            wid = getattr(body, "request_id", None)
            if wid is None:
                continue
            f = self.flights.get(self.wires.get(wid, wid))
            if f is None or f.replica != r.spec.name or (f.wire_id or f.request_id) != wid:
                r.counts["late_events"] += 1          # an ended or older placement's
                continue
            now = time.monotonic()
            if isinstance(body, Failed) and body.reason.startswith("drain_timeout") \
                    and migration.resumable(f) is None:
                await self._migrate(f, r, "drain_timeout")
                continue
            prefilled = f.prefilled
            step = self.routing.answered(f, r, body, self.members, now)
            if self.trial is not None:
                self._observe(self.trial, f, r, body, step, now)
            self.freed |= f.prefilled and not prefilled     # its queue estimate fell
            if step == "reroute":
                self.counts["rerouted"] += 1
                await self._route(f)
                continue
            if step == "end":
                self._forget(f, used(body))
                if isinstance(body, Rejected) and body.reason in REROUTE:
                    self.counts["load_rejected"] += 1      # its client hears it
            if f.cancelled:
                continue
            if isinstance(body, Accepted):
                if f.announced:
                    continue                          # a continuation's: the client has one
                f.announced = True
            elif isinstance(body, TextDelta) and f.migrated_at:
                self.handovers.append(now - f.migrated_at)
                f.migrated_at = 0.0
            if f.generation:
                if isinstance(body, Rejected):
                    body = Failed(f.request_id, f"replica_lost: its continuation was refused "
                                                f"({body.reason})")
                await self.clients.send(migration.relabel(f, body), to=f.identity)
            else:
                await self.clients.send_raw(data, to=f.identity)

    async def _heard(self, r: Replica, body: Any) -> None:
        if self.members.heard(r, body, time.monotonic()):
            await self._lose(r, "replica restarted")
        if isinstance(body, StatusReport) and body is r.report:       # a new load report
            self.budgets.reported(r.spec.name, reported_outstanding(body), r.report_asked,
                                  reported_used(body))
            self.freed = True
        if isinstance(body, ServerHeartbeat) and self.members.up(r, body):
            r.up_at = r.up_at or time.monotonic()
            log.info("replica_up", replica=r.spec.name)
            if self.trial is not None and r.spec.pool == self.trial.pool and not r.retiring:
                self._tg.start_soon(self._join_trial, self.trial, r)
            elif self.orphan is not None and r.spec.pool == self.orphan[1]:
                self._tg.start_soon(self._undo_orphan, r)

    async def _lose(self, r: Replica, why: str) -> None:
        """``r`` is out (silent, or restarted): every request open on it continues on
        another replica (migration.py) or, if it cannot, fails; its cache view is dropped;
        new requests go elsewhere."""
        log.warning("replica_lost", replica=r.spec.name, why=why, open=len(r.open))
        if self.trial is not None:
            self.trial.applied.pop(r.spec.name, None)     # re-applied when it is up again
        self.budgets.lost(r.spec.name)
        for rid in self.members.lose(r):
            f = self.flights.get(rid)
            if f is None:
                continue
            if migration.resumable(f) is None:
                await self._migrate(f, None, "replica_lost")
            else:
                await self._end_here(f, Failed(rid, f"replica_lost: {r.spec.name} ({why})"))

    async def _migrate(self, f: Flight, old: Replica | None, why: str) -> None:
        """Continue ``f`` elsewhere (migration.py): its old placement (on ``old``, None
        if that replica is lost) is cancelled and its lease moves to a fresh wire id
        before the continuation is routed; a request with every token it may have ends
        here."""
        rid, now = f.request_id, time.monotonic()
        if old is not None and rid in old.open:
            old.open.discard(rid)
            if (link := self.links.get(old.spec.name)) is not None:
                await link.sock.send(Cancel(f.wire_id or rid))
        self.wires.pop(f.wire_id, None)
        self.serial += 1
        f.generation += 1
        f.wire_id = migration.wire_id(rid, self.nonce, self.serial)
        self.wires[f.wire_id] = rid
        f.migrated_at, f.accepted = now, False
        f.tried = [f.replica] if f.replica else []
        self.counts["migrated"] += 1
        self.counts[f"migrated.{why}"] += 1
        log.info("request_migrating", replica=f.replica, why=why, generation=f.generation,
                 relayed=len(f.out_ids))
        if migration.remaining_tokens(f) == 0:
            return await self._end_here(f, migration.finished_here(f))
        ids = (f.prompt_ids or []) + f.out_ids
        f.prompt_tokens = len(ids)
        f.hashes, f.public_scope, f.public_blocks = self.prompts.hashes(f.tenant, ids)
        await self._route(f)

    async def _pull(self, r: Replica, now: float) -> None:
        """``r`` drains (or retires): each request on it that would not finish before its
        drain deadline, or whose remaining time exceeds the cost of moving it, moves
        (``migration.drain_choice``); the others finish in place."""
        targets = [o for o in self.members if o is not r and o.healthy and not o.draining
                   and not o.retiring]
        if not targets:
            return
        rate = max(self.routing.rate(o) for o in targets)
        left = float("inf")
        if r.draining:
            since = self.drain_seen.setdefault(r.spec.name, now)
            left = self.config.streamer.drain_timeout_s - (now - since) \
                - self.rc.heartbeat_timeout_s
        step_s = r.stat("scheduler", "last_step_ms", 50.0) / 1e3
        for rid in list(r.open):
            f = self.flights.get(rid)
            if f is None or not f.accepted or f.cancelled or f.migrated_at \
                    or migration.resumable(f) is not None:
                continue
            tpot = migration.request_tpot_s(f.first_token_at, len(f.out_ids), now, step_s)
            move, why = migration.drain_choice(
                migration.remaining_tokens(f), tpot, left,
                len(f.prompt_ids or ()) + len(f.out_ids), rate)
            if move:
                await self._migrate(f, r, why)

    async def _events_loop(self, r: Replica, events: BusSocket) -> None:
        while True:
            msg = (await events.recv()).body
            if not r.index.apply(msg):
                log.warning("kv_events_gap", replica=r.spec.name, seq=msg.seq)
                events.resubscribe()

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
            self.routing.expire(now)
            for r in list(self.members):       # a change may land while a send awaits
                if (link := self.links.get(r.spec.name)) is None:
                    continue                       # let go meanwhile
                sock = link.sock
                await sock.send(Heartbeat())
                if now >= next_load:
                    await sock.send(StatusQuery(load_query_id(time.monotonic_ns()),
                                                self.service_key))
                if r.healthy and now - r.last_heard > rc.heartbeat_timeout_s:
                    await self._lose(r, f"silent for {now - r.last_heard:.1f} s")
                elif r.healthy and (r.draining or r.retiring) and r.open:
                    await self._pull(r, now)
            if now >= next_load:
                next_load = now + rc.load_interval_s
            for r in self.members.idle_retired():
                self._let_go(r)
            await self._reap(now)
            if self.fleetq is not None and len(self.fleetq):
                await self._release()
                await self._expire_held(time.monotonic())
            await anyio.sleep(rc.heartbeat_interval_s)

    def _excuse(self, stalled_s: float, now: float) -> None:
        """This loop did not run for ``stalled_s``: every replica and client is heard that
        much later than it was (never later than now)."""
        self.counts["loop_stalls"] += 1
        log.warning("router_loop_stalled", stalled_s=round(stalled_s, 2))
        self.members.excuse(stalled_s, now)
        self.endpoint.excuse(stalled_s, now)

    async def _reap(self, now: float) -> None:
        gone = self.endpoint.gone(now, self.config.streamer.client_timeout_s)
        if not gone:
            return
        for f in list(self.flights.values()):
            if f.identity in gone and not f.cancelled:
                await self._cancel(f, "client gone")
        self.endpoint.forget(gone)

    # ------------------------------------------------------------------ live config
    async def config_command(self, cmd: ConfigCommand) -> ConfigAnswer:
        """An operator's config command (``live_config.py``): a new version is in force
        before the answer goes (saved first), from the next decision on. A canary by pool
        (``[rollout] pool``) is in force on its pool's replicas before the answer goes;
        while it runs, an apply is refused and a rollback ends it."""
        who = self.keys.operator(cmd.api_key)
        by = acting_operator(who, cmd.actor)
        if by is not None and cmd.action != "history":
            h = self.live.history
            if self.trial is not None and cmd.action == "apply":
                return ConfigAnswer(cmd.query_id, (
                    f"config not applied: a canary by pool runs on pool {self.trial.pool!r} "
                    f"(version {self.trial.version}): wait for the watchdog's verdict, or end "
                    f"it with `weir config rollback`"), h.current)
            if self.trial is not None:
                made = await self._end_trial(self.trial, False, by,
                                             "rolled back by an operator")
                if isinstance(made, Refused):
                    return ConfigAnswer(cmd.query_id, made.message, h.current)
                return ConfigAnswer(cmd.query_id, None, made)
            if cmd.action == "apply":
                cand = pool_canary.parse(self.live.config, h.boot, cmd.toml)
                if isinstance(cand, Refused):
                    return ConfigAnswer(cmd.query_id, cand.message, h.current)
                if cand is not None:
                    return await self._begin_trial(cmd, cand, by)
        answer, new = self.live.command(cmd, who, time.time())
        if new is not None:
            self._adopt(new)
            v = answer.current
            assert v is not None
            self.counts["config_changes"] += 1
            log.info("config_applied", version=v.version, sha256=v.sha256[:16],
                     applied_by=v.applied_by, changed=list(v.changed))
        return answer

    def _adopt(self, config: WeirConfig) -> None:
        """``config``'s live fields in force (schemas/config_change.py: ROUTER). Nothing
        placed is placed again: a request keeps its replica; the fleet queue keeps what it
        holds, released in the new weights' order; each tenant's bucket, outstanding count
        and virtual counter carry over by name (budgets.py, fleetq.py: ``retune``)."""
        self.config = config
        self.rc = rc = config.router
        self.routing.rc, self.routing.admission = rc, config.admission
        self.targets = targets_s(config.admission.classes)
        self.budgets.retune(rc.tenants, time.monotonic())
        if self.fleetq is not None:
            self.fleetq.retune(rc.tenants, rc.fleet_queue_max)
            self.freed = True                   # a larger bound or weight may release some

    # ------------------------------------------------------------------ canary by pool
    async def _engine_config(self, r: Replica, action: Any, key: str | None, toml: str = "",
                             version: int | None = None, actor: str = "",
                             timeout: float = 5.0) -> ConfigAnswer:
        """A config command sent to replica ``r`` over its link, and its answer (an error
        answer if none came in ``timeout`` s or it has no link)."""
        link = self.links.get(r.spec.name)
        if link is None:
            return ConfigAnswer("", f"replica {r.spec.name} is not connected")
        self.config_serial += 1
        qid = f"router-config:{self.nonce}:{self.config_serial}"
        done = anyio.Event()
        self.engine_answers[qid] = done
        try:
            await link.sock.send(ConfigCommand(qid, action, toml, version, actor, key))
            with anyio.move_on_after(timeout):
                await done.wait()
            answer = self.engine_answers.get(qid)
        finally:
            self.engine_answers.pop(qid, None)
        if not isinstance(answer, ConfigAnswer):
            return ConfigAnswer(qid, f"replica {r.spec.name} did not answer in {timeout:g} s")
        return answer

    def _engine_keys(self, given: str | None) -> list[str | None]:
        """The keys to send a replica the router's config commands with, in turn: the
        operator's own (that of the command), the deployment's operator key, the service
        key; the first a replica takes is kept for the trial."""
        keys: list[str | None] = []
        for k in (given, load_operator_key(), self.service_key):
            if k not in keys:
                keys.append(k)
        return keys or [None]

    async def _put_candidate(self, t: PoolTrial, r: Replica,
                             keys: list[str | None]) -> str | None:
        """The candidate in force on ``r`` (recorded in ``t.applied``), or why not. A
        replica that runs it already (restarted with its history) is only recorded."""
        inst = r.instance
        answer = ConfigAnswer("", "no key to try")
        for key in keys:
            answer = await self._engine_config(r, "history", key)
            if answer.error is None:
                t.key = key
                break
        if answer.error is not None or answer.current is None:
            return answer.error or "no history"
        before = pool_canary.pre_trial_version(answer.history, t.actor)
        if before is None:
            answer = await self._engine_config(r, "apply", t.key, t.cand.engine_toml,
                                               actor=t.actor)
            if answer.error is not None or answer.current is None:
                return answer.error or "no version"
            before = answer.current.version - 1
        t.applied[r.spec.name] = Placed(inst, before, time.monotonic())
        return None

    async def _begin_trial(self, cmd: ConfigCommand, cand: pool_canary.Candidate,
                           by: str) -> ConfigAnswer:
        """A canary by pool: the candidate in force on every replica of its pool (all or,
        with the first refusal's reason, none), then its trial version, then the watch."""
        h = self.live.history
        pool = [r for r in self.members.pool(cand.pool) if r.healthy and not r.retiring]
        base = [r for r in self.members if r.healthy and not r.retiring
                and r.spec.pool != cand.pool]
        why = (f"no healthy replica in pool {cand.pool!r} (pools: "
               f"{', '.join(sorted(self.members.pools()))})" if not pool else
               f"no healthy replica outside pool {cand.pool!r} to compare it with"
               if not base else None)
        if why is not None:
            return ConfigAnswer(cmd.query_id, f"config not applied: {why}", h.current)
        t = PoolTrial(len(h.versions), cand, None, Watchdog(cand.rollout, time.monotonic()))
        keys = self._engine_keys(cmd.api_key)
        for r in pool:
            why = await self._put_candidate(t, r, keys)
            if why is not None:
                await self._roll_back_pool(t)
                self.pool_counts["refused"] += 1
                return ConfigAnswer(cmd.query_id, f"config not applied: replica "
                                    f"{r.spec.name} refused it: {why}", h.current)
        v = self.live.begin_trial(cand.config, by, time.time())
        t.watchdog.started = time.monotonic()
        self.trial = t
        self.pool_counts["started"] += 1
        self._pool_event("pool_canary_started", v, t, "")
        return ConfigAnswer(cmd.query_id, None, v)

    async def _join_trial(self, t: PoolTrial, r: Replica) -> None:
        """A replica of the trial's pool up (added, found, or restarted): the candidate."""
        if self.trial is not t or r.spec.name in t.applied:
            return
        why = await self._put_candidate(t, r, [t.key])
        self.pool_counts["reapplied" if why is None else "pool_canary.join_errors"] += 1
        log.info("pool_canary_joined", replica=r.spec.name, pool=t.pool, version=t.version,
                 error=why)

    async def _undo_orphan(self, r: Replica) -> None:
        """The router restarted while a canary by pool ran (``live.orphan``): a replica of
        its pool that still runs the candidate gets its version from before it back."""
        assert self.orphan is not None
        version, _ = self.orphan
        by_actor = pool_canary.actor(version)
        for key in self._engine_keys(None):
            answer = await self._engine_config(r, "history", key)
            if answer.error is None:
                break
        before = pool_canary.pre_trial_version(answer.history, by_actor)
        if answer.error is not None or before is None:
            return
        done = await self._engine_config(r, "rollback", key, version=before, actor=by_actor)
        self.pool_counts["orphan_rollbacks"] += 1
        log.info("pool_canary_orphan_rolled_back", replica=r.spec.name, version=version,
                 to=before, error=done.error)

    async def _roll_back_pool(self, t: PoolTrial) -> int:
        """Every replica that took the candidate (and has not restarted since) gets its
        version from before it back; how many did not answer so."""
        errors = 0
        for name, p in list(t.applied.items()):
            r = self.members.get(name)
            if r is None or r.instance != p.instance:
                continue
            answer = await self._engine_config(r, "rollback", t.key, version=p.before,
                                               actor=t.actor)
            if answer.error is not None:
                errors += 1
                log.warning("pool_canary_rollback_refused", replica=name, error=answer.error)
        return errors

    async def _end_trial(self, t: PoolTrial, promote: bool, by: str,
                         reason: str) -> ConfigVersion | Refused:
        """The trial's verdict carried out: rolled back (the pool's replicas get their
        version back) or promoted (every other replica gets the candidate); then the
        router's version for it, logged, traced and counted."""
        self.trial = None
        errors = 0
        if promote:
            for r in [r for r in self.members if r.spec.pool != t.pool and r.healthy]:
                answer = await self._engine_config(r, "apply", t.key, t.cand.engine_toml,
                                                   actor=f"router promotion v{t.version}")
                if answer.error is not None:
                    errors += 1
                    log.warning("pool_canary_promotion_refused", replica=r.spec.name,
                                error=answer.error)
        else:
            errors = await self._roll_back_pool(t)
            self.pool_rollbacks.append(time.monotonic() - t.watchdog.started)
        made = self.live.end_trial(promote, by, time.time(), reason)
        what = "promoted" if promote else "rolled_back"
        self.pool_counts[f"{what}"] += 1
        self.pool_counts["replica_errors"] += errors
        if isinstance(made, ConfigVersion):
            self._adopt(self.live.config)
            self._pool_event(f"pool_canary_{what}", made, t, reason)
        return made

    def _pool_event(self, event: str, v: ConfigVersion, t: PoolTrial, reason: str) -> None:
        attributes = {"weir.config.version": v.version, "weir.config.applied_by": v.applied_by,
                      "weir.rollout.mode": "canary", "weir.rollout.pool": t.pool,
                      "weir.rollout.trial": t.version, "weir.rollout.reason": reason,
                      "weir.rollout.replicas": ",".join(sorted(t.applied)),
                      "weir.rollout.elapsed_s": round(time.monotonic() - t.watchdog.started,
                                                      3)}
        with _TRACER.start_as_current_span(f"config.{event}", attributes=attributes):
            log.info(event, version=v.version, sha256=v.sha256[:16], applied_by=v.applied_by,
                     pool=t.pool, trial=t.version, replicas=sorted(t.applied),
                     changed=list(v.changed), reason=reason or None,
                     elapsed_s=attributes["weir.rollout.elapsed_s"])

    def _observe(self, t: PoolTrial, f: Flight, r: Replica, body: Any, step: str,
                 now: float) -> None:
        """What one placement's answer tells the trial's watchdog (pool_canary.py)."""
        canary = t.side(r.spec.name, r.spec.pool, f.placed_at)
        if canary is None:
            return
        res = resolve(self.config.admission, f.tenant, f.submit.service_class,
                      f.submit.deadline_ms)
        if (d := pool_canary.placement_decision(body, now, canary, f.tenant,
                                                res.label)) is not None:
            t.watchdog.decided(d)
        if step in ("reroute", "end") and (e := pool_canary.placement_end(
                body, now, canary, res.label, f.arrival, f.first_token_at,
                None if res.deadline_ms is None else res.deadline_ms / 1e3,
                f.accepted)) is not None:
            t.watchdog.ended(e)
            self.pool_counts[f"observed.{'canary' if canary else 'baseline'}"] += 1

    async def _pool_watch(self) -> None:
        """Every 0.25 s while a canary by pool runs: the watchdog's verdict (with the
        longest wait of requests still without a first token), carried out."""
        while True:
            await anyio.sleep(0.25)
            t = self.trial
            if t is None:
                continue
            now = time.monotonic()
            waiting: dict[tuple[bool, str], float] = {}
            for f in self.flights.values():
                r = self.members.get(f.replica)
                if r is None or f.first_token_at or f.cancelled:
                    continue
                canary = t.side(r.spec.name, r.spec.pool, f.placed_at)
                if canary is not None:
                    label = resolve(self.config.admission, f.tenant, f.submit.service_class,
                                    f.submit.deadline_ms).label
                    waiting = pool_canary.waiting(waiting, canary, label, now - f.arrival)
            # judged once the baseline has min_requests in the window (pool_canary.py)
            base, _ = t.watchdog.sides(now)
            if base.ended < t.cand.rollout.min_requests:
                continue
            verdict = t.watchdog.verdict(now, waiting)
            if verdict is not None and self.trial is t:
                await self._end_trial(t, verdict.action == "promote", "watchdog",
                                      verdict.reason)

    # ------------------------------------------------------------------ membership
    def change_replicas(self, c: ChangeReplicas) -> ReplicasChanged:
        """An operator's change of replicas: all of it, or (with the reason) none of it."""
        answer, added = self.members.change(c, self.keys.operator(c.api_key))
        for r in added:
            self._connect(r)
            self._tg.start_soon(self._serve, r)
            log.info("replica_added", replica=r.spec.name)
        if answer.error is None:
            for name in c.remove:
                log.info("replica_retiring", replica=name, open=len(self.members[name].open))
            self.counts["replica_changes"] += 1
        return answer

    async def _discovery_loop(self) -> None:
        """Every ``discovery_interval_s``: resolve (on a thread: a lookup blocks), then add
        the replicas found and retire those gone (discovery.py), as an operator's change
        would, without one."""
        assert self.resolver is not None and self.discovery is not None
        while True:
            found = await anyio.to_thread.run_sync(self.resolver)
            self.discovery.observe(found)
            if found is None:
                log.warning("discovery_failed", name=self.rc.discovery_name)
            p = plan(self.discovery.wanted, self.members)
            now = time.monotonic()
            for spec in p.add:
                r = self.members.discover(spec)
                r.found_at = now
                self._connect(r)
                self._tg.start_soon(self._serve, r)
                # asked at once, not at the ticker's next turn: routed to from its answer
                await self.links[spec.name].sock.send(Heartbeat())
                await self.links[spec.name].sock.send(StatusQuery(
                    load_query_id(time.monotonic_ns()), self.service_key))
                self.counts["discovered"] += 1
                log.info("replica_discovered", replica=spec.name, endpoint=spec.endpoint)
            for name in p.retire:
                self.members.retire(name)
                self.counts["undiscovered"] += 1
                log.info("replica_retiring", replica=name, why="no longer resolves",
                         open=len(self.members[name].open))
            await anyio.sleep(self.rc.discovery_interval_s)

    def _let_go(self, r: Replica) -> None:
        """A retiring replica with nothing open on it: its loops stop, its sockets close."""
        link = self.links.pop(r.spec.name)
        link.scope.cancel()
        for sock in (link.sock, link.events):
            if sock is not None:
                sock.close()
                self._sockets.remove(sock)
        self.members.let_go(r)
        self.budgets.lost(r.spec.name)
        self.counts["replicas_let_go"] += 1
        log.info("replica_removed", replica=r.spec.name)

    # ------------------------------------------------------------------ status
    async def _cluster_loop(self) -> None:
        while True:
            match (await self.inbox_sock.recv()).body:
                case ClusterStatus() as cluster:
                    self.cluster = cluster

    def status(self, query_id: str, api_key: str | None) -> StatusReport:
        """The router's own cluster, then each healthy replica's components
        (``Membership.components``); each tenant's usage only to itself or an operator."""
        comps = [msgspec.structs.replace(c, stats={**c.stats, **config_stats(self.live)},
                                         info={**c.info, **self.info()})
                 if c.name == self.name else c
                 for c in self.members.components(self.cluster.components, self.name)]
        who = self.keys.identify(api_key, "default")
        if not (isinstance(who, Identity) and who.sees_all):
            tenant = who.tenant if isinstance(who, Identity) else ""
            comps = [visible_status(c, tenant) for c in comps]
        return StatusReport(query_id, tuple(comps), self.draining or self.cluster.draining)

    def info(self) -> dict[str, str]:
        return {"config_sha256": self.live.history.current.sha256,
                "router_policy": self.rc.policy,
                "pool_canary": "" if self.trial is None else self.trial.pool,
                **self.members.info()}

    def _pool_stats(self) -> dict[str, float]:
        """The canary by pool running (its trial version, 0: none; each side's requests
        ended in the window) and the time from the last trials' start to their rollback."""
        t = self.trial
        out = {**{f"pool_canary.{k}": v for k, v in self.pool_counts.items()},
               "pool_canary.trial": 0.0 if t is None else t.version,
               "pool_canary.rollback_s.last": self.pool_rollbacks[-1]
               if self.pool_rollbacks else 0.0}
        if t is not None:
            base, can = t.watchdog.sides(time.monotonic())
            out |= {"pool_canary.canary_ended": can.ended,
                    "pool_canary.baseline_ended": base.ended,
                    "pool_canary.replicas": len(t.applied),
                    "pool_canary.elapsed_s": round(time.monotonic() - t.watchdog.started, 3)}
        return out

    def stats(self) -> dict[str, float]:
        sessions = self.routing.sessions
        disc = getattr(self, "discovery", None)
        return {"active_requests": len(self.flights),
                "clients": len(self.endpoint.last_seen), "sessions": len(sessions),
                "tokenizing": self.tokenizing,
                "idempotent_keys": len(self.routing.idempotent),
                "session_moves": sessions.moves,
                "migration.handover_ms.p50":
                    round(migration.percentile(list(self.handovers), 0.5) * 1e3, 3),
                "migration.handover_ms.p99":
                    round(migration.percentile(list(self.handovers), 0.99) * 1e3, 3),
                **({"discovery.polls": disc.polls, "discovery.failed": disc.failed,
                    "discovery.wanted": len(disc.wanted)} if disc is not None else {}),
                **{f"requests.{k}": v for k, v in self.counts.items()},
                **config_stats(self.live),
                **self._pool_stats(),
                **self.budgets.stats(),
                **(self.fleetq.stats(time.monotonic()) if self.fleetq is not None else {}),
                **self.members.stats(),
                **signal_stats(self.members, lambda r: self.routing.queue_s(r, self.flights),
                               self.targets, self.counts["load_rejected"])}
