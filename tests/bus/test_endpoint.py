"""The client endpoint's loop (bus/endpoint.py) over a real ROUTER socket and a raw DEALER
client: each message goes to its owner or is answered, a cancel ends only the sender's own
request, a malformed frame is answered (a rejection of the request it names unless that
one is open), and each client's last message is the clock its reaper reads."""
from __future__ import annotations

import anyio
import msgspec
import pytest
import zmq

from bus.codec import Codec, encode
from bus.endpoint import ClientEndpoint
from bus.socket import BusSocket
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
    ServerMsg,
    StatusQuery,
    StatusReport,
    Submit,
)

REPLIES = Codec(ServerMsg)


class Desk:
    """An owner that holds requests by id -> client, and records what it was asked."""

    instance = 42
    draining = True

    def __init__(self) -> None:
        self.open: dict[str, bytes] = {}
        self.calls: list[tuple] = []
        self.malformed: list = []

    def is_open(self, request_id: str) -> bool:
        return request_id in self.open

    def holder(self, request_id: str) -> bytes | None:
        return self.open.get(request_id)

    async def submit(self, who: bytes, sub: Submit, traceparent: str | None) -> None:
        self.open[sub.request_id] = who
        self.calls.append(("submit", sub.request_id, traceparent))

    async def cancel(self, request_id: str, reason: str) -> None:
        del self.open[request_id]
        self.calls.append(("cancel", request_id, reason))

    def status(self, query_id: str, api_key: str | None) -> StatusReport:
        return StatusReport(f"{query_id}:{api_key}", ())

    def change_replicas(self, change: ChangeReplicas) -> ReplicasChanged:
        return ReplicasChanged(change.query_id, "no replicas here")

    async def config_command(self, cmd: ConfigCommand) -> ConfigAnswer:
        return ConfigAnswer(cmd.query_id, f"{cmd.action} {cmd.version} {cmd.api_key}")

    def malformed_answered(self, reply: Rejected | ProtocolError) -> None:
        self.malformed.append(reply)


class Client:
    """A raw DEALER outside Weir, with its own context."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(address)

    def send(self, body, traceparent: str | None = None) -> None:
        self.sock.send(encode(body, traceparent))

    async def reply(self, timeout_s: float = 5.0):
        with anyio.fail_after(timeout_s):
            while not self.sock.poll(0):
                await anyio.sleep(0.005)
        return REPLIES.decode(self.sock.recv()).body

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def malformed_submit(request_id: str) -> bytes:
    """A Submit whose ``params`` is not a map: it does not decode, its id is salvaged."""
    frame = msgspec.msgpack.decode(encode(Submit(request_id, prompt="hi")))
    frame[-1]["params"] = "not a map"
    return msgspec.msgpack.encode(frame)


@pytest.mark.anyio
async def test_the_endpoint_loop(tmp_path):
    address = f"ipc://{tmp_path}/clients.sock"
    desk = Desk()
    endpoint = ClientEndpoint(BusSocket(zmq.ROUTER, "test.clients", ClientMsg).bind(address),
                              desk)
    alice, bob = Client(address), Client(address)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(endpoint.serve)
            alice.send(Heartbeat())
            assert await alice.reply() == ServerHeartbeat(42, True)

            # each peer's frames are handled in order, but the ROUTER fair-queues between
            # peers: each waits for its own heartbeat's answer before the other sends
            alice.send(Submit("a-1", prompt="hi"), traceparent="00-tp")
            alice.send(Heartbeat())
            assert await alice.reply() == ServerHeartbeat(42, True)
            bob.send(Submit("b-1", prompt="hi"))
            bob.send(Heartbeat())
            assert await bob.reply() == ServerHeartbeat(42, True)   # both handled by now
            assert desk.calls == [("submit", "a-1", "00-tp"), ("submit", "b-1", None)]

            bob.send(Cancel("a-1"))           # not bob's: nothing happens
            bob.send(Cancel("nope"))
            alice.send(Cancel("a-1"))
            alice.send(StatusQuery("q", api_key="k"))
            assert await alice.reply() == StatusReport("q:k", ())
            assert desk.calls[2:] == [("cancel", "a-1", "cancelled by client")]

            bob.send(ChangeReplicas("c"))
            assert await bob.reply() == ReplicasChanged("c", "no replicas here")
            bob.send(ConfigCommand("v", "rollback", version=3, api_key="op"))
            assert await bob.reply() == ConfigAnswer("v", "rollback 3 op")

            bob.sock.send(malformed_submit("b-1"))      # open: not ended by a bad frame
            bad = await bob.reply()
            assert isinstance(bad, ProtocolError) and bad.message.startswith("malformed")
            bob.sock.send(malformed_submit("b-2"))
            bad = await bob.reply()
            assert isinstance(bad, Rejected) and (bad.request_id, bad.reason) == (
                "b-2", "invalid_request")
            bob.sock.send(b"\xc1")                      # names nothing
            assert isinstance(await bob.reply(), ProtocolError)
            assert [type(r) for r in desk.malformed] == [ProtocolError, Rejected,
                                                        ProtocolError]
            assert desk.open == {"b-1": desk.open["b-1"]} and len(endpoint.last_seen) == 2
            tg.cancel_scope.cancel()
    finally:
        alice.close()
        bob.close()
        endpoint.sock.close()


def test_who_is_gone_and_a_stall_excused():
    endpoint = ClientEndpoint(BusSocket(zmq.ROUTER, "test.clock", ClientMsg), Desk())
    endpoint.last_seen.update({b"a": 10.0, b"b": 12.0, b"c": 13.5})
    assert endpoint.gone(14.0, 2.0) == {b"a"}
    assert endpoint.gone(14.0, 4.0) == set()                # exactly the timeout: not gone
    endpoint.excuse(1.0, 14.0)
    assert endpoint.last_seen == {b"a": 11.0, b"b": 13.0, b"c": 14.0}   # never past now
    endpoint.forget({b"a", b"c"})
    assert endpoint.last_seen == {b"b": 13.0}
    endpoint.sock.close()
