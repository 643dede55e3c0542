"""The client endpoint: the ROUTER socket that clients (the SDK, the HTTP gateway,
``weir status``) speak the client protocol to (docs/PROTOCOL.md). An engine's streamer
serves it for one engine, a router for several; this loop is the part they share.

Per frame, one at a time:

- a frame that does not decode is answered (when its sender is known): a rejection of the
  request it names, salvaged from the frame, unless that request is open (it is not the
  sender's to end by a bad frame), else a protocol error;
- every well-formed frame marks its sender seen now (``last_seen``: the owner's reaper
  cancels the requests of a client silent past its timeout, ``gone``);
- ``Submit`` goes to the owner; ``Cancel`` ends a request only for the client that holds
  it; ``Heartbeat`` is answered with the owner's instance and whether it drains;
  ``StatusQuery``, ``ChangeReplicas`` and ``ConfigCommand`` with the owner's answers.

What a request is, who may submit it and how it ends is the owner's (``EndpointOwner``).
"""
from __future__ import annotations

import time
from typing import Protocol

import anyio

from bus.codec import salvage_request_id
from bus.socket import BusSocket, MalformedFrame
from schemas.client import (
    Cancel,
    ChangeReplicas,
    ClientMsg,
    ConfigAnswer,
    ConfigCommand,
    Heartbeat,
    ProtocolError,
    Rejected,
    ReplicasChanged,
    ServerHeartbeat,
    StatusQuery,
    StatusReport,
    Submit,
    malformed_reply,
)


class EndpointOwner(Protocol):
    """What the process behind a client endpoint answers."""

    @property
    def instance(self) -> int:
        """This process's instance (it changes on a restart: clients notice)."""
        ...

    @property
    def draining(self) -> bool: ...

    def is_open(self, request_id: str) -> bool:
        """Whether ``request_id`` is a request this process holds open."""
        ...

    def holder(self, request_id: str) -> bytes | None:
        """The client that may cancel ``request_id`` (None: nobody, now)."""
        ...

    async def submit(self, who: bytes, sub: Submit, traceparent: str | None) -> None: ...

    async def cancel(self, request_id: str, reason: str) -> None:
        """End ``request_id`` for its client (who has been checked to hold it)."""
        ...

    def status(self, query_id: str, api_key: str | None) -> StatusReport: ...

    def change_replicas(self, change: ChangeReplicas) -> ReplicasChanged: ...

    async def config_command(self, cmd: ConfigCommand) -> ConfigAnswer: ...

    def malformed_answered(self, reply: Rejected | ProtocolError) -> None:
        """A malformed frame was answered with ``reply`` (for the owner's counts)."""
        ...


class ClientEndpoint:
    """The loop over a bound ROUTER socket of ``ClientMsg``, and when each client was
    last heard from."""

    def __init__(self, sock: BusSocket[ClientMsg], owner: EndpointOwner) -> None:
        self.sock = sock
        self.owner = owner
        self.last_seen: dict[bytes, float] = {}    # client identity -> monotonic seconds

    async def serve(self) -> None:
        while True:
            # a receive with frames queued completes without giving the loop up: a flood of
            # client frames would run here back to back while every stream's events, relay
            # and heartbeat waits. One message, then the others' turn.
            await anyio.lowlevel.checkpoint()
            msg = await self.sock.recv(on_malformed=self._reply_malformed)
            who = msg.identity
            assert who is not None              # a ROUTER socket names every sender
            self.last_seen[who] = time.monotonic()
            await self.handle(who, msg.body, msg.envelope.traceparent)

    async def handle(self, who: bytes, body: ClientMsg, traceparent: str | None) -> None:
        """One well-formed client message."""
        owner = self.owner
        match body:
            case Submit() as sub:
                await owner.submit(who, sub, traceparent)
            case Cancel(request_id=rid):
                if owner.holder(rid) == who:
                    await owner.cancel(rid, "cancelled by client")
            case Heartbeat():
                await self.sock.send(ServerHeartbeat(owner.instance, owner.draining), to=who)
            case StatusQuery(query_id=qid, api_key=key):
                await self.sock.send(owner.status(qid, key), to=who)
            case ChangeReplicas() as change:
                await self.sock.send(owner.change_replicas(change), to=who)
            case ConfigCommand() as cmd:
                await self.sock.send(await owner.config_command(cmd), to=who)

    async def _reply_malformed(self, frame: MalformedFrame) -> None:
        if frame.identity is None:
            return
        rid = salvage_request_id(frame.data)
        reply = malformed_reply(frame.error,
                                rid if rid is not None and not self.owner.is_open(rid)
                                else None)
        self.owner.malformed_answered(reply)
        await self.sock.send(reply, to=frame.identity)

    def gone(self, now: float, timeout_s: float) -> set[bytes]:
        """The clients not heard from for more than ``timeout_s`` by ``now``."""
        return {who for who, t in self.last_seen.items() if now - t > timeout_s}

    def forget(self, clients: set[bytes]) -> None:
        for who in clients:
            del self.last_seen[who]

    def excuse(self, stalled_s: float, now: float) -> None:
        """The owner's loop did not run for ``stalled_s``: what clients sent meanwhile may
        wait unread, so each is heard that much later than it was (never later than now)."""
        for who, t in self.last_seen.items():
            self.last_seen[who] = min(t + stalled_s, now)
