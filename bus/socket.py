"""One typed socket wrapper over pyzmq, used by every process.

Each process has one ``zmq.asyncio.Context`` (``context()``), and each socket
belongs to exactly one task. Receiving sockets decode with a ``Codec`` over the
union they accept; a malformed frame is counted, logged without its payload
and dropped, so bad input never crashes a process.
"""
from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import msgspec
import structlog
import zmq
import zmq.asyncio

from bus import curve
from bus.codec import Codec, encode
from schemas.wire import Envelope

T = TypeVar("T")
log = structlog.get_logger("bus")

_CONTEXT: zmq.asyncio.Context | None = None


def context() -> zmq.asyncio.Context:
    """The process's single ZeroMQ context."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = zmq.asyncio.Context()
    return _CONTEXT


class Received(msgspec.Struct, Generic[T], frozen=True):
    envelope: Envelope[T]
    identity: bytes | None = None

    @property
    def body(self) -> T:
        return self.envelope.body


class MalformedFrame(msgspec.Struct, frozen=True):
    """A frame that failed to decode, handed to ``on_malformed`` for a reply if wanted."""

    identity: bytes | None
    data: bytes
    error: str


class BusSocket(Generic[T]):
    """A ZeroMQ socket that sends Envelope-wrapped Structs and receives a checked union.

    ``accepts`` is the union this socket decodes (None for send-only sockets).
    ROUTER sockets carry the peer identity in ``Received.identity`` and take ``to=`` on send.

    ``max_msg_size`` (bytes) is ZeroMQ's ``MAXMSGSIZE``: a frame larger than it is never
    read into memory, and ZeroMQ drops the connection of the peer that sent it (it reads
    the size first, then closes; the peer's socket reconnects on its own, as a new peer,
    so a ROUTER sees a new identity). Nothing is received and no reply can be sent: the
    bound must lie above every message a legal peer can send, and it limits only what
    this socket receives, never what it sends.
    """

    def __init__(self, kind: int, name: str, accepts: Any = None, *, hwm: int = 100_000,
                 max_msg_size: int | None = None) -> None:
        self.name = name
        self.kind = kind
        self._sock = context().socket(kind)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        if max_msg_size is not None:
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
        if kind == zmq.SUB:
            self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.codec: Codec[T] | None = Codec(accepts) if accepts is not None else None
        self.curve = False

    @property
    def malformed(self) -> int:
        return self.codec.malformed if self.codec else 0

    def bind(self, address: str) -> BusSocket[T]:
        """Bind; a CURVE server on tcp when this process's security says so (bus/curve.py).
        An internal ipc socket file is made private to this user."""
        self.curve = curve.prepare_bind(self._sock, self.kind, address, context())
        self._sock.bind(address)
        if address.startswith("ipc://") and self.kind not in curve.CLIENT_KINDS:
            path = address[len("ipc://"):]
            if os.path.exists(path):
                os.chmod(path, 0o600)
        return self

    def connect(self, address: str) -> BusSocket[T]:
        """Connect; a CURVE client of the cluster's server key on tcp when enabled."""
        self.curve = curve.prepare_connect(self._sock, self.kind, address)
        self._sock.connect(address)
        return self

    async def send(self, body: Any, *, to: bytes | None = None,
                   traceparent: str | None = None) -> None:
        data = encode(body, traceparent)
        if to is not None:
            await self._sock.send_multipart((to, data))
        else:
            await self._sock.send(data)

    async def recv(self, on_malformed: Callable[[MalformedFrame], Awaitable[object]] | None = None
                   ) -> Received[T]:
        """Wait for the next well-formed message. Malformed frames are counted, logged
        (type of error only, never the payload) and passed to ``on_malformed``.

        Nothing a peer sends can make this raise: decoding fails only the counted way, and
        an exception from ``on_malformed`` is logged and swallowed."""
        assert self.codec is not None, "send-only socket"
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            identity = frames[0] if self.kind == zmq.ROUTER and len(frames) >= 2 else None
            data = frames[-1]
            try:
                if len(frames) != (2 if self.kind == zmq.ROUTER else 1):
                    self.codec.malformed += 1
                    error = f"expected one payload frame, got {len(frames)}"
                else:
                    return Received(self.codec.decode(data), identity)
            except Exception as exc:         # Codec.decode raises only DecodeError, counted
                error = str(exc)[:200]
            self._log_malformed(error, len(data))
            if on_malformed is not None:
                try:
                    await on_malformed(MalformedFrame(identity, data, error))
                except Exception as exc:
                    log.error("on_malformed_failed", socket=self.name, error=type(exc).__name__)

    async def recv_raw(self) -> bytes:
        """The next frame as it came (an XPUB's subscription messages: 0x01 or 0x00, then
        the topic), for sockets whose peers speak ZeroMQ's protocol rather than Weir's."""
        return await self._sock.recv()

    async def send_raw(self, data: bytes, *, to: bytes | None = None) -> None:
        """Send an already encoded frame as it is (the router relays replicas' answers)."""
        if to is not None:
            await self._sock.send_multipart((to, data))
        else:
            await self._sock.send(data)

    def resubscribe(self) -> None:
        """A SUB socket subscribes again (to everything): the publisher sees a fresh
        subscription (a kv_manager answers it with a snapshot)."""
        self._sock.setsockopt(zmq.UNSUBSCRIBE, b"")
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")

    def set_option(self, option: int, value: int) -> None:
        self._sock.setsockopt(option, value)

    def _log_malformed(self, error: str, size: int) -> None:
        """The first few malformed frames each, then one line per 1000 (a flood must not
        become a flood of log lines)."""
        count = self.malformed
        if count <= 20 or count % 1000 == 0:
            log.warning("malformed_message", socket=self.name, error=error, size=size,
                        count=count)

    def close(self) -> None:
        self._sock.close(linger=0)
