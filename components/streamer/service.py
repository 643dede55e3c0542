"""The streamer process: the client-facing ROUTER socket of one engine, its open
requests and the guarantee of exactly one terminal message per request.

The client endpoint's loop is ``bus/endpoint.py``'s (shared with the router); the open
requests and the one-terminal rule are the registry's (``registry.py``, pure: a second
terminal, or any event after the terminal, is dropped and counted), as is the late
backstop; the request's spans are ``spans.py``'s. This service wires them to sockets,
the clock, idempotent retries (``idempotency.py``) and the SLO counts (``slo.py``).

A client's Cancel, or its silence past ``client_timeout_s``, cancels its requests
in the engine. Each client heartbeat is answered with a ``ServerHeartbeat`` naming this
instance, so clients notice a dead or restarted streamer. Identity comes from the
request's API key (``identity.py``), never from what a client claims. A component
restart fails only the requests whose state died with it (``peer_restarted``); an event
for a request nobody holds any more is answered with a cancel, so the engine stops
work nobody waits for. Draining refuses new work and fails what is still running at
its deadline (``drain_timeout``).
"""
from __future__ import annotations

import time
from typing import Any

import anyio
import msgspec
import structlog
import zmq
from opentelemetry import trace

from bus import tracing
from bus.component import Component
from bus.endpoint import ClientEndpoint
from bus.identity import Identity, Keyring, Refusal, visible_status
from components.streamer import spans
from components.streamer.idempotency import IdempotencyTable, Refused, rename, request_digest
from components.streamer.live_config import LiveConfig, history_path
from components.streamer.pinned import engine_version, pinned
from components.streamer.registry import TERMINAL, Active, Registry
from components.streamer.slo import RequestClock, SloStats
from components.tenancy.retry import DrainRate
from components.tenancy.watchdog import Ended
from schemas.client import (
    ChangeReplicas,
    ConfigAnswer,
    ConfigCommand,
    Events,
    Pinned,
    ProtocolError,
    ReplicasChanged,
)
from schemas.config_change import ConfigVersion
from schemas.frames import client_frame_limit
from schemas.limits import MAX_ID_CHARS
from schemas.resolve import deterministic, resolve
from schemas.validate import check_submit
from schemas.wire import (
    Accepted,
    Cancelled,
    CancelRequest,
    ClientMsg,
    ClusterStatus,
    EventBatch,
    Failed,
    Finished,
    NewRequest,
    PolicyChange,
    Rejected,
    RequestHeader,
    StatusReport,
    StreamerMsg,
    Submit,
    TextDelta,
    deadline_ns,
)

log = structlog.get_logger("streamer")
_TRACER = trace.get_tracer("weir.streamer")
# Whose death loses what (see ARCHITECTURE.md, "Restart policy"): requests the engine
# accepted live in these components' state, so they fail; requests not yet accepted are
# sent again (they are only NewRequests in flight through stateless steps).
_HOLDS_ACCEPTED = ("scheduler", "kv_manager", "executor", "detokenizer")
_REPLAYS = ("tokenizer", "admission", "scheduler")


class StreamerService(Component):
    name = "streamer"

    async def setup(self) -> None:
        self.instance = time.time_ns()
        self.registry = Registry()                          # open requests
        self.ends = DrainRate()                             # for Retry-After estimates
        self.cluster = ClusterStatus((), False)
        self.cluster_at = time.monotonic()
        self.draining = False
        self.drain_deadline: float | None = None
        self.keys = Keyring(self.config.gateway.api_keys)
        sc = self.config.streamer
        self.idempotency = IdempotencyTable(
            sc.idempotency_ttl_s, max_bytes=int(sc.idempotency_max_mib * 2**20),
            max_entry_bytes=int(sc.idempotency_entry_max_mib * 2**20))
        self.slo = SloStats.for_config(self.config.admission)
        self.counts = {"submitted": 0, "finished": 0, "rejected": 0, "cancelled": 0, "failed": 0,
                       "replayed": 0,
                       "unauthenticated": 0, "idempotent_attached": 0, "idempotent_reused": 0,
                       "idempotent_crowded": 0, "idempotent_rate": 0, "retries": 0,
                       "deadline_expired": 0, "deadline_finished": 0}
        # a frame past what a legal Submit can be is never read (its sender is dropped)
        self.clients = self.socket(
            zmq.ROUTER, "clients", ClientMsg,
            max_msg_size=client_frame_limit(self.config.engine.max_model_len)).bind(
            self.topology.client_endpoint)
        self.endpoint = ClientEndpoint(self.clients, self)
        self.inbox_sock = self.inbox(StreamerMsg)
        self.to_tokenizer = self.push_to("tokenizer")
        self.to_admission = self.push_to("admission")      # config versions (live_config.py)
        self.to_scheduler = self.push_to("scheduler")
        self.live_config = LiveConfig(self.config, time.time(), history_path(self.config),
                                      time.monotonic())
        self.pin: Pinned | None = None             # what deterministic requests are pinned to
        self.version = engine_version()

    async def run(self) -> None:
        if self.live_config.restored and self.live_config.history.current.version:
            change = self.live_config.change()      # in case the last one was never sent
            await self.to_admission.send(change)
            await self.to_scheduler.send(change)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.endpoint.serve)
            tg.start_soon(self._engine_loop)
            tg.start_soon(self._reaper)
            tg.start_soon(self._watch)

    # ------------------------------------------------------------------ clients
    # (the client endpoint's loop, bus/endpoint.py, asks these)
    def is_open(self, request_id: str) -> bool:
        return request_id in self.registry

    def holder(self, request_id: str) -> bytes | None:
        req = self.registry.get(request_id)
        return None if req is None else req.identity

    def malformed_answered(self, reply: Rejected | ProtocolError) -> None:
        if isinstance(reply, Rejected):
            self.counts["rejected"] += 1

    def change_replicas(self, change: ChangeReplicas) -> ReplicasChanged:
        return ReplicasChanged(
            change.query_id, "this endpoint is an engine, not a router: it has no replicas")

    async def config_command(self, cmd: ConfigCommand) -> ConfigAnswer:
        """An operator's config command (``live_config.py``); a new version is sent to
        admission and the scheduler before the answer."""
        answer, change = self.live_config.command(
            cmd, self.keys.operator(cmd.api_key), time.time(), time.monotonic())
        if change is not None and answer.current is not None:
            await self._send_change(change, answer.current, "config_applied")
        return answer

    async def _send_change(self, change: PolicyChange, v: ConfigVersion, event: str) -> None:
        """Send a new version to admission and the scheduler; log and trace it."""
        await self.to_admission.send(change)
        await self.to_scheduler.send(change)
        rollout = change.trial.sections.rollout if change.trial else None
        attributes = {"weir.config.version": v.version, "weir.config.settled": change.version,
                      "weir.config.applied_by": v.applied_by,
                      "weir.rollout.mode": v.rollout,
                      "weir.rollout.share": rollout.share if rollout and v.rollout == "canary"
                      else 0.0, "weir.rollout.reason": v.reason,
                      "weir.config.rollback_of": -1 if v.rollback_of is None else v.rollback_of,
                      "weir.config.promotion_of": -1 if v.promotion_of is None
                      else v.promotion_of}
        with _TRACER.start_as_current_span(f"config.{event}", attributes=attributes):
            log.info(event, version=v.version, sha256=v.sha256[:16], applied_by=v.applied_by,
                     changed=list(v.changed), rollout=v.rollout, settled=change.version,
                     share=attributes["weir.rollout.share"] or None, reason=v.reason or None,
                     rollback_of=v.rollback_of, promotion_of=v.promotion_of)

    async def _watch(self) -> None:
        """Every 0.25 s while a canary is watched: the watchdog's verdict, carried out
        (``live_config.py``)."""
        while True:
            await anyio.sleep(0.25)
            if self.live_config.watchdog is None:
                continue
            now = time.monotonic()
            waiting: dict[tuple[bool, str], float] = {}
            since = self.live_config.watchdog.started
            for _, req in self.registry.requests():
                clock = req.clock
                if clock.first_token is None and clock.started >= since:
                    key = (bool(self.live_config.canary(req.tenant)), clock.service_class)
                    waiting[key] = max(waiting.get(key, 0.0), now - clock.started)
            done = self.live_config.watch(time.time(), now, waiting)
            if done is not None:
                verdict, v, change = done
                await self._send_change(change, v, "promoted" if verdict.action == "promote"
                                        else "rolled_back")

    def _outcome(self, req: Active, event: Any, now: float) -> None:
        """Count a request's end (the SLO counts, and the canary's watchdog)."""
        clock = req.clock
        outcome = self.slo.ended(clock, event, now)
        if self.live_config.watchdog is None or outcome in (None, "failed", "cancelled"):
            return
        if outcome == "rejected" and not clock.admitted:      # admission's refusal
            self.live_config.decided(now, clock.started, req.tenant, clock.service_class,
                                     False)
        wait = (clock.first_token - clock.started if clock.first_token is not None
                else now - clock.started if clock.admitted else None)
        computed = good = 0
        if isinstance(event, Finished):
            u = event.usage
            computed = max(u.prompt_tokens - u.cached_tokens, 0) + u.completion_tokens
            good = u.completion_tokens if outcome == "good" else 0
        self.live_config.ended(Ended(
            now, bool(self.live_config.canary(req.tenant)), clock.service_class,
            outcome in ("ttft", "tpot", "both", "deadline", "expired"),
            outcome == "rejected", wait, computed, good), clock.started)

    async def submit(self, who: bytes, sub: Submit, traceparent: str | None) -> None:
        rid = sub.request_id
        identity = self.keys.identify(sub.api_key, sub.tenant)
        if isinstance(identity, Refusal):
            self.counts["unauthenticated"] += 1
            n = self.counts["unauthenticated"]
            if n <= 20 or n % 1000 == 0:       # a flood must not become one of log lines
                log.warning("unauthenticated", request_id=rid[:64], count=n)
            return await self._terminal_to(who, Rejected(rid[:MAX_ID_CHARS], "unauthenticated",
                                                         identity.message))
        tenant = identity.tenant
        self.counts["retries"] += sub.attempt > 0          # every retry, refused again or not
        # an idempotent retry is checked as any Submit is before it may attach: a malformed
        # one, or one past the engine-wide stream cap, is refused, not replayed
        invalid = self._check_valid(sub)
        digest = request_digest(sub) if invalid is None and sub.idempotency_key else b""
        if digest and await self._attach(who, sub, tenant, digest):
            return
        record = self.config.telemetry.record_content
        span = spans.start_request(sub, tenant, traceparent, record)
        resolved = resolve(self.live_config.admission(tenant), tenant, sub.service_class,
                           sub.deadline_ms)
        clock = RequestClock(time.monotonic(), sub.deadline_ms, resolved.label)
        det = deterministic(self.config.engine.deterministic, sub.params.deterministic is True,
                            resolved.granted)
        req = Active(who, tenant, time.time_ns(), clock, span, batched=sub.batch_events,
                     deterministic=det is True)
        if record:
            req.completion = []
        if isinstance(det, str) and invalid is None:
            invalid = Rejected(rid, "invalid_request", det)
        if (rejected := invalid or self._check_capacity(sub, tenant)) is not None:
            spans.end_request(req, "rejected", rejected.reason)
            self.slo.ended(clock, rejected, clock.started)
            return await self._terminal_to(who, rejected)
        self.registry.open(rid, req)
        self.counts["submitted"] += 1
        if sub.idempotency_key:
            self.idempotency.start(tenant, sub.idempotency_key, rid, digest)
            req.idempotent = True
        params = sub.params
        if req.deterministic and not params.deterministic:     # its class's, or "all"
            params = msgspec.structs.replace(params, deterministic=True)
        header = RequestHeader(rid, tenant, params, req.arrival_ns, sub.priority,
                               sub.service_class,
                               ttft_deadline_ns=deadline_ns(req.arrival_ns, sub.deadline_ms),
                               e2e_deadline_ns=deadline_ns(req.arrival_ns, sub.e2e_deadline_ms))
        req.pending = NewRequest(header, sub.prompt, sub.messages, sub.prompt_token_ids,
                                 sub.tools)
        req.traceparent = tracing.traceparent_of(span)
        await self.to_tokenizer.send(req.pending, traceparent=req.traceparent)

    async def _attach(self, who: bytes, sub: Submit, tenant: str, digest: bytes) -> bool:
        """A retry of an idempotent request: replay what it has produced to this client
        (under this client's request id; compacted, at most ``n + 2`` events, in one frame
        to a client that takes ``Events``) and subscribe it to the rest. A key reused for
        another request, a request with ``max_subscribers`` retries attached already, or a
        tenant past its rate of attaches is refused. Attaching during a drain is allowed:
        it adds no engine work, and ends with the request the drain waits for anyway."""
        now = time.monotonic()
        got = self.idempotency.attach(tenant, sub.idempotency_key, who, sub.request_id, now,
                                      digest)
        if got is None:
            return False
        rid = sub.request_id
        if isinstance(got, Refused):
            self.counts[f"idempotent_{got.kind}"] += 1
            await self._terminal_to(who, Rejected(
                rid, "idempotency_key_reused" if got.kind == "reused" else "overloaded",
                got.message, None if got.kind == "reused" else 1.0))
            return True
        self.counts["idempotent_attached"] += 1
        if sub.batch_events and len(got) > 1:
            await self.clients.send(Events(got), to=who)
        else:
            for event in got:
                await self.clients.send(event, to=who)
        return True

    def _check_valid(self, sub: Submit) -> Rejected | None:
        """What every Submit must pass, a new request or an idempotent retry: a well-formed
        request (every bound of ``check_submit``, checked before any work proportional to
        its size), and room under the engine-wide cap on open streams."""
        rid = sub.request_id
        if not rid or len(rid) > MAX_ID_CHARS or rid in self.registry:
            return Rejected(rid[:MAX_ID_CHARS], "invalid_request",
                            f"request_id is empty, longer than {MAX_ID_CHARS} characters or "
                            f"already in use")
        if sum(x is not None for x in (sub.prompt, sub.messages, sub.prompt_token_ids)) != 1:
            return Rejected(rid, "invalid_request",
                            "set exactly one of prompt, prompt_token_ids or messages")
        if (bad := check_submit(sub, self.config.engine.max_model_len)) is not None:
            return Rejected(rid, bad[0], bad[1])
        if len(self.registry) >= self.config.streamer.max_clients_requests:
            return Rejected(rid, "overloaded", "too many open streams", 1.0)
        return None

    def _check_capacity(self, sub: Submit, tenant: str) -> Rejected | None:
        """Refusals of new engine work at the edge, before anything is spent (the request
        is valid: ``_check_valid``): a drain, and the caps admission would certainly refuse
        (this streamer's open requests are a superset of what admission holds), so a burst
        past them is refused in microseconds instead of queueing behind the tokenizer."""
        rid = sub.request_id
        if self.draining:
            return Rejected(rid, "draining", "the server is draining",
                            self.config.streamer.drain_timeout_s)
        now, engine_cap = time.monotonic(), self.config.admission.max_outstanding
        if len(self.registry) >= engine_cap:
            return Rejected(rid, "overloaded", f"the engine holds {engine_cap} requests, its cap",
                            self.ends.retry_after(len(self.registry) - engine_cap + 1, now))
        limits = self.config.admission.tenant(tenant)
        cap = limits.max_outstanding if limits is not None else None
        held = self.registry.held_by(tenant)
        if cap is not None and held >= cap:
            return Rejected(rid, "tenant_over_budget", f"tenant holds {cap} requests, its cap",
                            self.ends.retry_after(held - cap + 1, now))
        down = [c.name for c in self.cluster.components if not c.alive or c.state == "starting"]
        if down:                      # it would never be answered: say so now, not never
            return Rejected(rid, "overloaded",
                            f"engine component down or restarting: {', '.join(down)}", 2.0)
        return None

    async def _terminal_to(self, who: bytes, event) -> None:
        self.counts[type(event).__name__.lower()] += 1
        await self.clients.send(event, to=who)

    async def _end(self, rid: str, event: Any) -> None:
        """Deliver a terminal event the streamer itself decided, and stop the engine's work
        on the request (the cancel follows the request's own path). A request no longer
        open had its terminal while the caller awaited (its loops end requests from a list
        taken before their sends): it gets no second one."""
        if rid not in self.registry:
            return
        req = self._pop(rid)
        terminal = type(event).__name__.lower()
        reason = event.finish_reason if isinstance(event, Finished) else event.reason
        spans.end_request(req, terminal, reason, getattr(event, "usage", None))
        self.counts[terminal] += 1
        self._outcome(req, event, time.monotonic())
        await self._deliver(rid, req, event, terminal=True)
        await self.to_tokenizer.send(CancelRequest(rid, reason))

    def _pop(self, rid: str) -> Active:
        req = self.registry.close(rid)
        self.ends.ended(time.monotonic())
        return req

    async def cancel(self, rid: str, reason: str) -> None:
        await self._end(rid, Cancelled(rid, reason))

    async def _deliver(self, rid: str, req: Active, event: Any, terminal: bool,
                       out: dict[bytes, list] | None = None) -> None:
        """Send one event to the request's client and to any idempotent retries attached.
        With ``out`` (an engine batch's outbox), a client that takes ``Events`` gets it in
        its list there instead, sent by the caller once the batch is through."""
        if req.identity and out is not None and req.batched:
            out.setdefault(req.identity, []).append(event)
        elif req.identity:
            await self.clients.send(event, to=req.identity)
        if req.idempotent:
            for who, their_id in self.idempotency.subscribers(rid):
                await self.clients.send(rename(event, their_id), to=who)
            self.idempotency.record(rid, event, time.monotonic(), terminal)

    async def _reaper(self) -> None:
        """Cancel the requests of clients that stopped sending (killed, hung, gone), and
        fail what still runs at the drain deadline."""
        timeout = self.config.streamer.client_timeout_s
        tick = min(0.05, timeout / 4)
        idle_tick = min(1.0, timeout / 4)   # nothing running: nothing to reap, nor a deadline
        last = time.monotonic()
        while True:
            await anyio.sleep(tick if self.registry or self.drain_deadline is not None
                              else idle_tick)
            now = time.monotonic()
            self.idempotency.expire(now)
            await self._expire_late(now)
            if self.drain_deadline is not None and now >= self.drain_deadline and self.registry:
                for rid, _ in self.registry.requests():
                    await self._end(rid, Failed(rid, "drain_timeout: the server shut down "
                                                     "before the request finished"))
            stalled, last = now - last > timeout / 2, now
            if stalled:        # we were not running: heartbeats may be queued unread, not late
                continue
            gone = self.endpoint.gone(now, timeout)
            if not gone:
                continue
            for rid, req in self.registry.requests():
                if req.identity not in gone:
                    continue
                if req.idempotent:            # a retry may attach; it runs out on its own
                    req.identity = b""
                    continue
                log.info("client_gone", request_id=rid)
                await self.cancel(rid, "client disconnected")
            self.endpoint.forget(gone)

    async def _expire_late(self, now: float) -> None:
        """End the requests the scheduler should have ended ``LATE_GRACE_S`` ago (its end,
        or its message, was lost): ``deadline_expired`` one whose class drops late work
        with no first token by its deadline, or one with none by its end-to-end bound;
        finish reason ``deadline``, with the usage it streamed, one with tokens at its
        end-to-end bound. The engine is told to stop. Looks only at the ones due."""
        while (due := self.registry.overdue(now)) is not None:
            rid, event = due
            self.counts["deadline_expired" if isinstance(event, Rejected)
                        else "deadline_finished"] += 1
            await self._end(rid, event)

    # ------------------------------------------------------------------ engine
    async def _engine_loop(self) -> None:
        while True:
            match (await self.inbox_sock.recv()).body:
                case EventBatch(events=events):
                    # a step's events: one frame per client that takes Events, not one
                    # per event (a 64-sequence step was 64 sends here and 64 receives
                    # in the gateway)
                    out: dict[bytes, list] = {}
                    for event in events:
                        await self._on_event(event, out)
                    for who, batch in out.items():
                        await self.clients.send(batch[0] if len(batch) == 1 else Events(batch),
                                                to=who)
                case ClusterStatus() as status:
                    self.cluster, self.cluster_at = status, time.monotonic()
                    self.pin = None

    def _pinned(self) -> Pinned:
        """What deterministic requests are pinned to now (the components' facts as the
        supervisor last reported them)."""
        if self.pin is None:
            self.pin = pinned(self.cluster.components, self.version)
        return self.pin

    async def _on_event(self, event: Any, out: dict[bytes, list] | None = None) -> None:
        rid = event.request_id
        terminal = isinstance(event, TERMINAL)
        req = self.registry.event(event)          # closed, if this is its terminal
        if req is None:                          # it has had its terminal: dropped
            if not terminal and self.registry.orphaned(rid):
                # work for a request nobody holds (it failed, or this streamer restarted
                # and never knew it): stop it in the engine, once
                await self.to_tokenizer.send(CancelRequest(rid, "orphaned"))
            return
        if isinstance(event, Accepted):
            if req.deterministic:
                event = msgspec.structs.replace(event, pinned=self._pinned())
            self.slo.accepted(req.clock, event)
            self.registry.accepted(rid, req, event)
            self.live_config.decided(time.monotonic(), req.clock.started, req.tenant,
                                     event.service_class, True)
        if isinstance(event, TextDelta):
            self.registry.streamed(req, event, time.monotonic())
            spans.start_stream(req)
        if terminal:
            self.ends.ended(time.monotonic())
            kind = type(event).__name__.lower()
            self.counts[kind] += 1
            self._outcome(req, event, time.monotonic())
            spans.end_request(req, kind, getattr(event, "finish_reason", None)
                      or getattr(event, "reason", ""), getattr(event, "usage", None))
        await self._deliver(rid, req, event, terminal, out)

    async def peer_restarted(self, name: str) -> None:
        """Fail only the requests whose state died with ``name``; send again the ones that
        were only in flight through it. The gateway is a client: its death fails nothing
        here (its requests are cancelled when its heartbeats stop). A restarted admission
        or scheduler is sent the config version in force (it started from the TOML)."""
        if name in ("admission", "scheduler") and self.live_config.history.current.version:
            await (self.to_admission if name == "admission" else self.to_scheduler).send(
                self.live_config.change())
        if name in _HOLDS_ACCEPTED:
            for rid, req in self.registry.requests():
                if req.pending is None:
                    await self._end(rid, Failed(rid, f"engine component {name} restarted "
                                                     "and lost the request's state"))
        if name in _REPLAYS:
            for _, req in self.registry.requests():
                if req.pending is not None:
                    self.counts["replayed"] += 1
                    await self.to_tokenizer.send(req.pending, traceparent=req.traceparent)

    async def drain(self) -> None:
        self.draining = True
        margin = min(1.0, self.config.streamer.drain_timeout_s / 4)
        self.drain_deadline = time.monotonic() + self.config.streamer.drain_timeout_s - margin

    def status(self, query_id: str, api_key: str | None) -> StatusReport:
        """Every component's status; each tenant's usage only to itself or an operator."""
        who = self.keys.identify(api_key, "default")
        # the supervisor sends its status when it changes (or every keepalive): each
        # heartbeat's age has grown since
        since = round(time.monotonic() - self.cluster_at, 3)
        comps = tuple(msgspec.structs.replace(c, heartbeat_age_s=c.heartbeat_age_s + since)
                      for c in self.cluster.components)
        if isinstance(who, Identity) and who.sees_all:
            return StatusReport(query_id, comps, self.draining)
        tenant = who.tenant if isinstance(who, Identity) else ""
        return StatusReport(query_id, tuple(visible_status(c, tenant) for c in comps),
                            self.draining)

    def stats(self) -> dict[str, float]:
        return {"active_requests": len(self.registry), "clients": len(self.endpoint.last_seen),
                "idempotency_entries": len(self.idempotency),
                "idempotency_bytes": self.idempotency.finished_bytes,
                "idempotency_too_large": self.idempotency.too_large,
                **{f"requests.{k}": v for k, v in self.counts.items()},
                "requests.late_events": self.registry.late_events,
                "requests.orphans_cancelled": self.registry.orphans_cancelled,
                **self.slo.stats(), **self.live_config.stats()}
