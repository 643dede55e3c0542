"""The streamer process: the client-facing ROUTER socket, the request registry and
the guarantee of exactly one terminal message per request.

A client's Cancel, or its silence past ``client_timeout_s``, cancels its requests
in the engine. A component restart fails every in-flight request (the engine
cannot vouch for them any more); draining refuses new work.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from typing import Any

import anyio
import msgspec
import structlog
import zmq
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from bus.codec import salvage_request_id
from bus import tracing
from bus.component import Component
from bus.socket import MalformedFrame
from schemas.wire import (Cancel, Cancelled, CancelRequest, ClientMsg, ClusterStatus,
                          ComponentStatus, EventBatch, Failed, Finished, Heartbeat, NewRequest,
                          ProtocolError, Rejected, StatusQuery, StatusReport, StreamerMsg, Submit,
                          TextDelta, Usage)

log = structlog.get_logger("streamer")
_TRACER = trace.get_tracer("weir.streamer")
TERMINAL = (Finished, Rejected, Cancelled, Failed)


@dataclass
class Active:
    identity: bytes
    tenant: str
    arrival_ns: int
    span: Any = None                 # the request's root span in the engine
    delivery: Any = None             # "stream" span: first delta to terminal
    completion: list[str] | None = None   # only with telemetry.record_content

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


class StreamerService(Component):
    name = "streamer"

    async def setup(self) -> None:
        self.active: dict[str, Active] = {}
        self.last_seen: dict[bytes, float] = {}
        self.cluster = ClusterStatus((), False)
        self.draining = False
        self.counts = {"submitted": 0, "finished": 0, "rejected": 0, "cancelled": 0, "failed": 0,
                       "late_events": 0}
        self.clients = self.socket(zmq.ROUTER, "clients", ClientMsg).bind(
            self.topology.client_endpoint)
        self.inbox_sock = self.inbox(StreamerMsg)
        self.to_tokenizer = self.push_to("tokenizer")

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._client_loop)
            tg.start_soon(self._engine_loop)
            tg.start_soon(self._reaper)

    # ------------------------------------------------------------------ clients
    async def _reply_malformed(self, frame: MalformedFrame) -> None:
        if frame.identity is None:
            return
        rid = salvage_request_id(frame.data)
        if rid is not None and rid not in self.active:
            self.counts["rejected"] += 1
            await self.clients.send(Rejected(rid, "invalid_request", f"malformed message: {frame.error}"),
                                    to=frame.identity)
        else:
            await self.clients.send(ProtocolError(f"malformed message: {frame.error}"),
                                    to=frame.identity)

    async def _client_loop(self) -> None:
        while True:
            msg = await self.clients.recv(on_malformed=self._reply_malformed)
            who = msg.identity
            self.last_seen[who] = time.monotonic()
            match msg.body:
                case Submit() as sub:
                    await self._submit(who, sub, msg.envelope.traceparent)
                case Cancel(request_id=rid):
                    req = self.active.get(rid)
                    if req is not None and req.identity == who:
                        await self._cancel(rid, "cancelled by client")
                case Heartbeat():
                    pass
                case StatusQuery(query_id=qid):
                    await self.clients.send(StatusReport(qid, self._components(), self.draining),
                                            to=who)

    async def _submit(self, who: bytes, sub: Submit, traceparent: str | None) -> None:
        rid = sub.request_id
        p = sub.params
        span = _TRACER.start_span("weir.request", context=tracing.context_from(traceparent),
                                  kind=trace.SpanKind.SERVER, attributes={
            "weir.request_id": rid, "weir.tenant": sub.tenant,
            "gen_ai.operation.name": "chat" if sub.messages is not None else "text_completion",
            "gen_ai.request.max_tokens": p.max_tokens if p.max_tokens is not None else -1,
            "gen_ai.request.temperature": p.temperature, "gen_ai.request.top_p": p.top_p,
            "gen_ai.request.top_k": p.top_k})
        req = Active(who, sub.tenant, time.time_ns(), span)
        if self.config.telemetry.record_content:          # off by default: text stays out
            span.set_attribute("gen_ai.prompt", sub.prompt if sub.prompt is not None else
                               msgspec.json.encode(sub.messages or sub.prompt_token_ids).decode())
            req.completion = []
        if (rejected := self._check_submit(sub)) is not None:
            req.end("rejected", rejected.reason)
            return await self._terminal_to(who, rejected)
        self.active[rid] = req
        self.counts["submitted"] += 1
        await self.to_tokenizer.send(
            NewRequest(rid, sub.tenant, sub.prompt, sub.messages, sub.params, req.arrival_ns,
                       sub.prompt_token_ids, sub.deadline_ms, sub.priority),
            traceparent=tracing.traceparent_of(span))

    def _check_submit(self, sub: Submit) -> Rejected | None:
        rid = sub.request_id
        if self.draining:
            return Rejected(rid, "draining", "the server is draining",
                            self.config.streamer.drain_timeout_s)
        if not rid or rid in self.active:
            return Rejected(rid, "invalid_request", "request_id is empty or already in use")
        if sum(x is not None for x in (sub.prompt, sub.messages, sub.prompt_token_ids)) != 1:
            return Rejected(rid, "invalid_request",
                            "set exactly one of prompt, prompt_token_ids or messages")
        if len(self.active) >= self.config.streamer.max_clients_requests:
            return Rejected(rid, "overloaded", "too many open streams", 1.0)
        down = [c.name for c in self.cluster.components if not c.alive]
        if down:                      # it would never be answered: say so now, not never
            return Rejected(rid, "overloaded", f"engine component down: {', '.join(down)}", 5.0)
        return None

    async def _terminal_to(self, who: bytes, event) -> None:
        self.counts[type(event).__name__.lower()] += 1
        await self.clients.send(event, to=who)

    async def _cancel(self, rid: str, reason: str) -> None:
        req = self.active.pop(rid)
        req.end("cancelled", reason)
        self.counts["cancelled"] += 1
        await self.clients.send(Cancelled(rid, reason), to=req.identity)
        await self.to_tokenizer.send(CancelRequest(rid, reason))

    async def _reaper(self) -> None:
        """Cancel the requests of clients that stopped sending (killed, hung, gone)."""
        timeout = self.config.streamer.client_timeout_s
        tick = min(0.05, timeout / 4)
        last = time.monotonic()
        while True:
            await anyio.sleep(tick)
            now = time.monotonic()
            stalled, last = now - last > timeout / 2, now
            if stalled:        # we were not running: heartbeats may be queued unread, not late
                continue
            gone = {who for who, t in self.last_seen.items() if now - t > timeout}
            if not gone:
                continue
            for rid in [rid for rid, r in self.active.items() if r.identity in gone]:
                log.info("client_gone", request_id=rid)
                await self._cancel(rid, "client disconnected")
            for who in gone:
                del self.last_seen[who]

    # ------------------------------------------------------------------ engine
    async def _engine_loop(self) -> None:
        while True:
            match (await self.inbox_sock.recv()).body:
                case EventBatch(events=events):
                    for event in events:
                        req = self.active.get(event.request_id)
                        if req is None:
                            self.counts["late_events"] += 1
                            continue
                        if isinstance(event, TextDelta) and req.completion is not None:
                            req.completion.append(event.text)
                        if isinstance(event, TextDelta) and req.delivery is None:
                            req.delivery = _TRACER.start_span(
                                "stream", context=trace.set_span_in_context(req.span))
                        if isinstance(event, TERMINAL):
                            del self.active[event.request_id]
                            terminal = type(event).__name__.lower()
                            self.counts[terminal] += 1
                            req.end(terminal, getattr(event, "finish_reason", None)
                                    or getattr(event, "reason", ""), getattr(event, "usage", None))
                        await self.clients.send(event, to=req.identity)
                case ClusterStatus() as status:
                    self.cluster = status

    async def peer_restarted(self, name: str) -> None:
        for rid in list(self.active):
            req = self.active.pop(rid)
            req.end("failed", f"{name} restarted")
            self.counts["failed"] += 1
            await self.clients.send(Failed(rid, f"engine component {name} restarted"),
                                    to=req.identity)
            await self.to_tokenizer.send(CancelRequest(rid, "failed"))

    async def drain(self) -> None:
        self.draining = True

    def _components(self) -> tuple[ComponentStatus, ...]:
        return self.cluster.components

    def stats(self) -> dict[str, float]:
        return {"active_requests": len(self.active), "clients": len(self.last_seen),
                **{f"requests.{k}": v for k, v in self.counts.items()}}
