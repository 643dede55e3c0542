"""The streamer process: the client-facing ROUTER socket, the request registry and
the guarantee of exactly one terminal message per request.

A client's Cancel, or its silence past ``client_timeout_s``, cancels its requests
in the engine. A component restart fails every in-flight request (the engine
cannot vouch for them any more); draining refuses new work.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
import structlog
import zmq

from bus.codec import salvage_request_id
from bus.component import Component
from bus.socket import MalformedFrame
from schemas.wire import (Cancel, Cancelled, CancelRequest, ClientMsg, ClusterStatus,
                          ComponentStatus, EventBatch, Failed, Finished, Heartbeat, NewRequest,
                          ProtocolError, Rejected, StatusQuery, StatusReport, StreamerMsg, Submit)

log = structlog.get_logger("streamer")
TERMINAL = (Finished, Rejected, Cancelled, Failed)


@dataclass
class Active:
    identity: bytes
    tenant: str
    arrival_ns: int


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
        if self.draining:
            return await self._terminal_to(who, Rejected(rid, "draining", "the server is draining",
                                                         self.config.streamer.drain_timeout_s))
        if not rid or rid in self.active:
            return await self._terminal_to(who, Rejected(rid, "invalid_request",
                                                         "request_id is empty or already in use"))
        if sum(x is not None for x in (sub.prompt, sub.messages, sub.prompt_token_ids)) != 1:
            return await self._terminal_to(who, Rejected(
                rid, "invalid_request", "set exactly one of prompt, prompt_token_ids or messages"))
        if len(self.active) >= self.config.streamer.max_clients_requests:
            return await self._terminal_to(who, Rejected(rid, "overloaded",
                                                         "too many open streams", 1.0))
        now = time.time_ns()
        self.active[rid] = Active(who, sub.tenant, now)
        self.counts["submitted"] += 1
        await self.to_tokenizer.send(
            NewRequest(rid, sub.tenant, sub.prompt, sub.messages, sub.params, now,
                       sub.prompt_token_ids),
            traceparent=traceparent)

    async def _terminal_to(self, who: bytes, event) -> None:
        self.counts[type(event).__name__.lower()] += 1
        await self.clients.send(event, to=who)

    async def _cancel(self, rid: str, reason: str) -> None:
        req = self.active.pop(rid)
        self.counts["cancelled"] += 1
        await self.clients.send(Cancelled(rid, reason), to=req.identity)
        await self.to_tokenizer.send(CancelRequest(rid, reason))

    async def _reaper(self) -> None:
        """Cancel the requests of clients that stopped sending (killed, hung, gone)."""
        timeout = self.config.streamer.client_timeout_s
        while True:
            await anyio.sleep(min(0.05, timeout / 4))
            now = time.monotonic()
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
                        if isinstance(event, TERMINAL):
                            del self.active[event.request_id]
                            self.counts[type(event).__name__.lower()] += 1
                        await self.clients.send(event, to=req.identity)
                case ClusterStatus() as status:
                    self.cluster = status

    async def peer_restarted(self, name: str) -> None:
        for rid in list(self.active):
            req = self.active.pop(rid)
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
