"""The streamer process: the client-facing ROUTER socket, the request registry and
the guarantee of exactly one terminal message per request.

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

import heapq
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

from typing import Any

import anyio
import msgspec
import structlog
import zmq
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from bus import tracing
from bus.component import Component
from bus.endpoint import ClientEndpoint
from schemas.frames import client_frame_limit
from components.tenancy.retry import DrainRate
from schemas.validate import check_submit
from components.streamer.idempotency import IdempotencyTable, Refused, rename, request_digest
from bus.identity import Identity, Keyring, Refusal, visible_status
from components.streamer.slo import RequestClock, SloStats
from schemas.wire import (Accepted, Cancelled, CancelRequest, ChoiceEnd, ClientMsg,
                          ClusterStatus, EventBatch, Failed, Finished, NewRequest,
                          Rejected, StatusReport, StreamerMsg, Submit, TextDelta, Usage)
from schemas.client import ChangeReplicas, Events, ProtocolError, ReplicasChanged

log = structlog.get_logger("streamer")
_TRACER = trace.get_tracer("weir.streamer")
TERMINAL = (Finished, Rejected, Cancelled, Failed)
# Whose death loses what (see ARCHITECTURE.md, "Restart policy"): requests the engine
# accepted live in these components' state, so they fail; requests not yet accepted are
# sent again (they are only NewRequests in flight through stateless steps).
_HOLDS_ACCEPTED = ("scheduler", "kv_manager", "executor", "detokenizer")
# The scheduler drops a request whose class drops late work at its deadline, and ends one
# at its end-to-end bound; this streamer does too, this much later, so that a lost message
# (a restart, a dropped frame) cannot leave its client waiting past it
LATE_GRACE_S = 1.0
_REPLAYS = ("tokenizer", "admission", "scheduler")


@dataclass
class Active:
    identity: bytes
    tenant: str
    arrival_ns: int
    clock: RequestClock
    span: Any = None                 # the request's root span in the engine
    delivery: Any = None             # "stream" span: first delta to terminal
    completion: list[str] | None = None   # only with telemetry.record_content
    pending: NewRequest | None = None     # until admission accepts it: replayable
    traceparent: str | None = None
    idempotent: bool = False
    batched: bool = False            # its client takes Events (Submit.batch_events)
    # with an end-to-end bound (Accepted.e2e_deadline_ms): what the client has had, so the
    # backstop can finish it "deadline" with its usage (output tokens by choice)
    accepted: Accepted | None = None
    choice_tokens: Counter | None = None

    def end(self, terminal: str, reason: str = "", usage: Usage | None = None) -> None:
        attrs = {"weir.terminal": terminal, "weir.reason": reason}
        if usage is not None:
            attrs.update({"gen_ai.usage.input_tokens": usage.prompt_tokens,
                          "gen_ai.usage.output_tokens": usage.completion_tokens,
                          "weir.usage.cached_tokens": usage.cached_tokens})
        if terminal == "finished":
            attrs["gen_ai.response.finish_reasons"] = (reason,)
        elif terminal in ("failed", "rejected"):
            self.span.set_status(Status(StatusCode.ERROR, terminal))
        if self.delivery is not None:
            self.delivery.end()
        if self.completion is not None:
            attrs["gen_ai.completion"] = "".join(self.completion)
        self.span.set_attributes(attrs)
        self.span.end()


def cut_at_deadline(rid: str, accepted: Accepted | None, choice_tokens: Counter) -> Finished:
    """The ``Finished`` the streamer ends a request with at its end-to-end bound when the
    engine's end did not come: every choice finish reason ``deadline``, the usage what the
    client was streamed."""
    prompt, cached = (accepted.prompt_tokens, accepted.cached_tokens) if accepted else (0, 0)
    ends = tuple(ChoiceEnd(i, "deadline", n) for i, n in sorted(choice_tokens.items()))
    return Finished(rid, "deadline", Usage(prompt, sum(choice_tokens.values()), cached),
                    choices=ends)


class StreamerService(Component):
    name = "streamer"

    async def setup(self) -> None:
        self.instance = time.time_ns()
        self.active: dict[str, Active] = {}
        self.per_tenant: Counter[str] = Counter()          # open requests per tenant
        self.tenant_caps = {t.name: t.max_outstanding for t in self.config.admission.tenants}
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
        self.orphans: OrderedDict[str, None] = OrderedDict()   # cancelled late requests
        # (due, request id, end-to-end?): a heap, from Accepted's expires_ms, e2e_deadline_ms
        self.expiry: list[tuple[float, str, bool]] = []
        self.slo = SloStats.for_config(self.config.admission)
        self.counts = {"submitted": 0, "finished": 0, "rejected": 0, "cancelled": 0, "failed": 0,
                       "late_events": 0, "orphans_cancelled": 0, "replayed": 0,
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

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.endpoint.serve)
            tg.start_soon(self._engine_loop)
            tg.start_soon(self._reaper)

    # ------------------------------------------------------------------ clients
    # (the client endpoint's loop, bus/endpoint.py, asks these)
    def is_open(self, request_id: str) -> bool:
        return request_id in self.active

    def holder(self, request_id: str) -> bytes | None:
        req = self.active.get(request_id)
        return None if req is None else req.identity

    def malformed_answered(self, reply: Rejected | ProtocolError) -> None:
        if isinstance(reply, Rejected):
            self.counts["rejected"] += 1

    def change_replicas(self, change: ChangeReplicas) -> ReplicasChanged:
        return ReplicasChanged(
            change.query_id, "this endpoint is an engine, not a router: it has no replicas")

    async def submit(self, who: bytes, sub: Submit, traceparent: str | None) -> None:
        rid = sub.request_id
        p = sub.params
        identity = self.keys.identify(sub.api_key, sub.tenant)
        if isinstance(identity, Refusal):
            self.counts["unauthenticated"] += 1
            n = self.counts["unauthenticated"]
            if n <= 20 or n % 1000 == 0:       # a flood must not become one of log lines
                log.warning("unauthenticated", request_id=rid[:64], count=n)
            return await self._terminal_to(who, Rejected(rid[:256], "unauthenticated",
                                                         identity.message))
        tenant = identity.tenant
        self.counts["retries"] += sub.attempt > 0          # every retry, refused again or not
        # an idempotent retry is checked as any Submit is before it may attach: a malformed
        # one, or one past the engine-wide stream cap, is refused, not replayed
        invalid = self._check_valid(sub)
        digest = request_digest(sub) if invalid is None and sub.idempotency_key else b""
        if digest and await self._attach(who, sub, tenant, digest):
            return
        span = _TRACER.start_span("weir.request", context=tracing.context_from(traceparent),
                                  kind=trace.SpanKind.SERVER, attributes={
            "weir.request_id": rid, "weir.tenant": tenant,
            "gen_ai.operation.name": "chat" if sub.messages is not None else "text_completion",
            "gen_ai.request.max_tokens": p.max_tokens if p.max_tokens is not None else -1,
            "gen_ai.request.temperature": p.temperature, "gen_ai.request.top_p": p.top_p,
            "gen_ai.request.top_k": p.top_k})
        clock = RequestClock(time.monotonic(), sub.deadline_ms,
                             self.slo.class_of(tenant, sub.service_class))
        req = Active(who, tenant, time.time_ns(), clock, span, batched=sub.batch_events)
        if self.config.telemetry.record_content:          # off by default: text stays out
            span.set_attribute("gen_ai.prompt", sub.prompt if sub.prompt is not None else
                               msgspec.json.encode(sub.messages or sub.prompt_token_ids).decode())
            req.completion = []
        if (rejected := invalid or self._check_capacity(sub, tenant)) is not None:
            req.end("rejected", rejected.reason)
            self.slo.ended(clock, rejected, clock.started)
            return await self._terminal_to(who, rejected)
        self.active[rid] = req
        self.per_tenant[tenant] += 1
        self.counts["submitted"] += 1
        if sub.idempotency_key:
            self.idempotency.start(tenant, sub.idempotency_key, rid, digest)
            req.idempotent = True
        req.pending = NewRequest(rid, tenant, sub.prompt, sub.messages, sub.params,
                                 req.arrival_ns, sub.prompt_token_ids, sub.deadline_ms,
                                 sub.priority, sub.service_class, sub.tools,
                                 sub.e2e_deadline_ms)
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
        if not rid or len(rid) > 256 or rid in self.active:
            return Rejected(rid[:256], "invalid_request",
                            "request_id is empty, longer than 256 characters or already in use")
        if sum(x is not None for x in (sub.prompt, sub.messages, sub.prompt_token_ids)) != 1:
            return Rejected(rid, "invalid_request",
                            "set exactly one of prompt, prompt_token_ids or messages")
        if (bad := check_submit(sub, self.config.engine.max_model_len)) is not None:
            return Rejected(rid, bad[0], bad[1])
        if len(self.active) >= self.config.streamer.max_clients_requests:
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
        if len(self.active) >= engine_cap:
            return Rejected(rid, "overloaded", f"the engine holds {engine_cap} requests, its cap",
                            self.ends.retry_after(len(self.active) - engine_cap + 1, now))
        cap = self.tenant_caps.get(tenant)
        if cap is not None and self.per_tenant[tenant] >= cap:
            return Rejected(rid, "tenant_over_budget", f"tenant holds {cap} requests, its cap",
                            self.ends.retry_after(self.per_tenant[tenant] - cap + 1, now))
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
        on the request (the cancel follows the request's own path)."""
        req = self._pop(rid)
        terminal = type(event).__name__.lower()
        reason = event.finish_reason if isinstance(event, Finished) else event.reason
        req.end(terminal, reason, getattr(event, "usage", None))
        self.counts[terminal] += 1
        self.slo.ended(req.clock, event, time.monotonic())
        await self._deliver(rid, req, event, terminal=True)
        await self.to_tokenizer.send(CancelRequest(rid, reason))

    def _pop(self, rid: str) -> Active:
        req = self.active.pop(rid)
        self.per_tenant[req.tenant] -= 1
        if not self.per_tenant[req.tenant]:     # an open endpoint's claimed names: no trail
            del self.per_tenant[req.tenant]
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
            await anyio.sleep(tick if self.active or self.drain_deadline is not None
                              else idle_tick)
            now = time.monotonic()
            self.idempotency.expire(now)
            await self._expire_late(now)
            if self.drain_deadline is not None and now >= self.drain_deadline and self.active:
                for rid in list(self.active):
                    await self._end(rid, Failed(rid, "drain_timeout: the server shut down "
                                                     "before the request finished"))
            stalled, last = now - last > timeout / 2, now
            if stalled:        # we were not running: heartbeats may be queued unread, not late
                continue
            gone = self.endpoint.gone(now, timeout)
            if not gone:
                continue
            for rid, req in list(self.active.items()):
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
        while self.expiry and self.expiry[0][0] <= now:
            _, rid, whole = heapq.heappop(self.expiry)
            req = self.active.get(rid)
            if req is None or (req.clock.first_token is not None and not whole):
                continue
            if req.clock.first_token is None:
                self.counts["deadline_expired"] += 1
                await self._end(rid, Rejected(rid, "deadline_expired", "no first token within "
                                              f"its {'end-to-end ' if whole else ''}deadline; "
                                              "the engine did not end it in time"))
                continue
            self.counts["deadline_finished"] += 1
            await self._end(rid, cut_at_deadline(rid, req.accepted, req.choice_tokens))

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

    async def _on_event(self, event: Any, out: dict[bytes, list] | None = None) -> None:
        rid = event.request_id
        req = self.active.get(rid)
        terminal = isinstance(event, TERMINAL)
        if req is None:
            self.counts["late_events"] += 1
            if not terminal:
                await self._cancel_orphan(rid)
            return
        if isinstance(event, Accepted):
            self.slo.accepted(req.clock, event)
            if event.expires_ms is not None:
                heapq.heappush(self.expiry, (req.clock.started + event.expires_ms / 1e3
                                             + LATE_GRACE_S, rid, False))
            if event.e2e_deadline_ms is not None:
                n = req.pending.params.n if req.pending is not None else 1
                req.accepted, req.choice_tokens = event, Counter(dict.fromkeys(range(n), 0))
                heapq.heappush(self.expiry, (req.clock.started + event.e2e_deadline_ms / 1e3
                                             + LATE_GRACE_S, rid, True))
            req.pending = None
        if isinstance(event, TextDelta):
            req.clock.token(time.monotonic(), event.index)
            if req.choice_tokens is not None:
                req.choice_tokens[event.index] += len(event.token_ids)
        if isinstance(event, TextDelta) and req.completion is not None:
            req.completion.append(event.text)
        if isinstance(event, TextDelta) and req.delivery is None:
            req.delivery = _TRACER.start_span(
                "stream", context=trace.set_span_in_context(req.span))
        if terminal:
            self._pop(rid)
            kind = type(event).__name__.lower()
            self.counts[kind] += 1
            self.slo.ended(req.clock, event, time.monotonic())
            req.end(kind, getattr(event, "finish_reason", None)
                    or getattr(event, "reason", ""), getattr(event, "usage", None))
        await self._deliver(rid, req, event, terminal, out)

    async def _cancel_orphan(self, rid: str) -> None:
        """Work for a request nobody holds (it failed, or this streamer restarted and never
        knew it): stop it in the engine, once."""
        if rid in self.orphans:
            return
        self.orphans[rid] = None
        if len(self.orphans) > 4096:
            self.orphans.popitem(last=False)
        self.counts["orphans_cancelled"] += 1
        await self.to_tokenizer.send(CancelRequest(rid, "orphaned"))

    async def peer_restarted(self, name: str) -> None:
        """Fail only the requests whose state died with ``name``; send again the ones that
        were only in flight through it. The gateway is a client: its death fails nothing
        here (its requests are cancelled when its heartbeats stop)."""
        if name in _HOLDS_ACCEPTED:
            for rid, req in list(self.active.items()):
                if req.pending is None:
                    await self._end(rid, Failed(rid, f"engine component {name} restarted "
                                                     "and lost the request's state"))
        if name in _REPLAYS:
            for req in list(self.active.values()):
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
        return {"active_requests": len(self.active), "clients": len(self.endpoint.last_seen),
                "idempotency_entries": len(self.idempotency),
                "idempotency_bytes": self.idempotency.finished_bytes,
                "idempotency_too_large": self.idempotency.too_large,
                **{f"requests.{k}": v for k, v in self.counts.items()}, **self.slo.stats()}
