"""BusSocket's frame bound (``max_msg_size``, ZeroMQ's MAXMSGSIZE): a frame past it never
reaches the socket's reader (ZeroMQ closes the sender's connection instead), and the socket
goes on taking legal frames, from a new connection and from the same peer reconnected."""
from __future__ import annotations

import anyio
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from bus.codec import encode
from bus.socket import BusSocket
from schemas.client import Cancel, ClientMsg

LIMIT = 4096


class Peer:
    """A raw DEALER outside Weir (its own context), watched for its connection's events."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.reconnect_ivl = 20
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        assert self.event(5.0) == zmq.EVENT_CONNECTED

    def event(self, timeout_s: float) -> int | None:
        if not self.monitor.poll(int(timeout_s * 1000)):
            return None
        return recv_monitor_message(self.monitor)["event"]

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
        self.ctx.term()


def frame_of(size: int, mark: str = "x") -> tuple[Cancel, bytes]:
    """A Cancel whose encoded frame is exactly ``size`` bytes (its id a 16-bit-length
    string: the header is the same for every size here)."""
    overhead = len(encode(Cancel(mark * 300))) - 300
    body = Cancel(mark * (size - overhead))
    frame = encode(body)
    assert len(frame) == size
    return body, frame


async def received(sock: BusSocket, timeout_s: float):
    with anyio.move_on_after(timeout_s):
        return await sock.recv()
    return None


@pytest.mark.anyio
async def test_a_frame_past_the_bound_is_dropped_and_the_socket_goes_on(tmp_path):
    address = f"ipc://{tmp_path}/bound.sock"
    server = BusSocket(zmq.ROUTER, "test.bound", ClientMsg, max_msg_size=LIMIT).bind(address)
    big, legal = Peer(address), Peer(address)
    try:
        big.sock.send(frame_of(LIMIT + 1)[1])
        # ZeroMQ read the size, then closed the sender's connection: a positive sign the
        # frame was refused (not merely slow), and it never reached the reader
        assert big.event(5.0) == zmq.EVENT_DISCONNECTED
        assert await received(server, 0.2) is None
        assert server.malformed == 0                  # never decoded either

        body, at_limit = frame_of(LIMIT, "y")
        legal.sock.send(at_limit)                     # a frame of exactly the bound passes
        got = await received(server, 5.0)
        assert got is not None and got.body == body

        assert big.event(5.0) == zmq.EVENT_CONNECTED  # the dropped peer reconnected ...
        big.sock.send(encode(Cancel("after")))        # ... and is heard again, as a new peer
        got = await received(server, 5.0)
        assert got is not None and got.body == Cancel("after")
    finally:
        big.close()
        legal.close()
        server.close()


@pytest.mark.anyio
async def test_without_a_bound_the_same_frame_is_read(tmp_path):
    """The control: today's sockets (no bound) read and decode it."""
    address = f"ipc://{tmp_path}/open.sock"
    server = BusSocket(zmq.ROUTER, "test.open", ClientMsg).bind(address)
    peer = Peer(address)
    try:
        body, frame = frame_of(LIMIT + 1)
        peer.sock.send(frame)
        got = await received(server, 5.0)
        assert got is not None and got.body == body
    finally:
        peer.close()
        server.close()
