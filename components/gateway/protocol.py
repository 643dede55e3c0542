"""What a connection may do before its request reaches the gateway's app: how long it may
wait, how big a head it may send, how long it may leave a response unread, and which
connections give way when there are too many.

:func:`guarded_protocol` subclasses uvicorn's HTTP protocol (httptools, else h11), because
uvicorn offers no header timeout and no way to bound a blocked write:

- A connection that has sent nothing is closed after ``first_byte_timeout_s`` (after
  ``keepalive_timeout_s`` when it is kept alive between requests): an idle connection holds
  a place under ``max_connections`` and costs its sender nothing, so it gets the short wait.
- From a request's first byte its headers must arrive within ``read_timeout_s`` and in at
  most ``MAX_HEADER_BYTES``; else 408 / 431, and it is closed.
- At the global cap idle connections are shed, oldest first, so that a request is served;
  past ``max_connections_per_peer`` a peer's idle connection gives way, or the new one is
  closed (``connections.py`` says which and why).
- A connection whose send buffer stays full (the client stopped reading) for
  ``stream_stall_timeout_s`` is aborted — ``close()`` would wait forever to flush — which
  the app sees as a disconnect, so its request is cancelled in the engine.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Any

import structlog

from components.gateway.connections import Connections
from components.gateway.http import ABORT_EXTENSION
from schemas.config import GatewayConfig

log = structlog.get_logger("gateway")

MAX_HEADER_BYTES = 64 << 10

_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_TOO_LARGE_431 = (b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                  b"content-type: application/json\r\nconnection: close\r\n"
                  b"content-length: %d\r\n\r\n%s")


def _raw(template: bytes, message: str, code: str) -> bytes:
    body = (b'{"error": {"message": "%s", "type": "invalid_request_error", "param": null, '
            b'"code": "%s"}}' % (message.encode(), code.encode()))
    return template % (len(body), body)


def guarded_protocol(config: GatewayConfig, max_header_bytes: int = MAX_HEADER_BYTES,
                     base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with the waits, caps and write-stall abort of
    ``config`` (see the module docstring). Pass it as ``uvicorn.Config(http=...)`` with
    ``limit_concurrency=config.max_connections``; one class per server (its connection
    table is the class's). ``config.send_buffer_bytes`` (0: the defaults, the kernel's
    autotuned up to megabytes) bounds what the kernel and the event loop each hold for a
    client that is not reading, so its stall shows sooner."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base
    read_timeout_s, stall_timeout_s = config.read_timeout_s, config.stream_stall_timeout_s
    send_buffer_bytes = config.send_buffer_bytes
    table: Connections[Any] = Connections(config.max_connections_per_peer)
    logged_at: dict[str, float] = {}

    class GuardedProtocol(base):                                     # type: ignore[misc, valid-type]
        connections_table = table
        _header_timer: asyncio.TimerHandle | None = None
        _stall_timer: asyncio.TimerHandle | None = None
        _armed_cycle: Any = None
        _header_bytes = 0              # bytes received while waiting for a head
        _idle = False                  # waiting, and not a byte of the request yet

        # -- waiting for a request: its first byte within first_byte_timeout_s of connecting
        # (keepalive_timeout_s after a response), its head within read_timeout_s of that
        def _arm_headers(self, first_byte_s: float) -> None:
            self._disarm_headers()
            self._armed_cycle = self.cycle
            self._header_bytes = 0
            self._idle = True
            table.idle(self)
            self._header_timer = self.loop.call_later(first_byte_s, self._header_timeout)

        def _disarm_headers(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self._header_bytes:               # a request was begun and not finished
                self.transport.write(_raw(_TIMEOUT_408, "request headers did not arrive "
                                          f"within {read_timeout_s:g}s", "request_timeout"))
            self.transport.close()

        def _begun(self) -> None:
            """The first byte of a request: from now it has read_timeout_s for its head."""
            self._idle = False
            table.busy(self)
            self._disarm_headers()
            self._header_timer = self.loop.call_later(read_timeout_s, self._header_timeout)

        def _make_room(self) -> None:
            """At the global cap, idle connections close so this request is served
            (uvicorn answers 503 while its open connections reach the limit)."""
            limit = self.limit_concurrency
            if limit is None or len(self.connections) < limit:
                return
            shed = table.room(len(self.connections), limit)
            for other in shed:
                self._close(other)
            if shed:
                self._note("http_idle_connections_shed", open=len(self.connections))

        def _close(self, other: GuardedProtocol) -> None:
            self.connections.discard(other)      # uvicorn's count, before connection_lost
            other._disarm_headers()
            other.transport.close()

        def _note(self, event: str, **fields: Any) -> None:
            """A warning at most every 10 s per kind: a flood must not become a log flood."""
            now = self.loop.time()
            if now - logged_at.get(event, -1e9) >= 10.0:
                logged_at[event] = now
                log.warning(event, shed=table.shed, refused=table.refused, **fields)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = self.client[0] if self.client else None
            victim = table.opened(self, peer)
            if victim is self:                   # its peer is at its cap, none of it idle
                self._note("http_peer_over_connection_cap", peer=peer,
                           cap=config.max_connections_per_peer)
                self._close(self)
                return
            if victim is not None:
                self._close(victim)
            sock = transport.get_extra_info("socket")
            if send_buffer_bytes:        # the kernel's buffer, and the event loop's above it
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
                transport.set_write_buffer_limits(high=send_buffer_bytes)
            self._arm_headers(config.first_byte_timeout_s)

        def data_received(self, data: bytes) -> None:
            waiting = self._header_timer is not None
            if waiting:
                if self._idle and data:
                    self._begun()
                self._make_room()
                before = self._header_bytes
                self._header_bytes += len(data)
                end = data.find(b"\r\n\r\n")             # a head ends in this chunk
                if end >= 0 and before + end > max_header_bytes:
                    self._disarm_headers()
                    return self._send_431()
            super().data_received(data)
            if not waiting or self.transport.is_closing():
                return
            if self.cycle is not self._armed_cycle:          # a request's head is complete
                self._disarm_headers()
                scope = self.cycle.scope
                scope.setdefault("extensions", {})[ABORT_EXTENSION] = self.transport.abort
            elif self._header_bytes > max_header_bytes:
                self._disarm_headers()
                self._send_431()

        def _send_431(self) -> None:
            self.transport.write(_raw(_TOO_LARGE_431, "request headers are over "
                                      f"{max_header_bytes} bytes", "headers_too_large"))
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None
                                                    or self.cycle.response_complete):
                self._unset_keepalive_if_required()      # the one idle timer is ours
                self._arm_headers(config.keepalive_timeout_s)

        # -- writes: a client that stops reading is cut off after stall_timeout_s
        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall_timer is None:
                self._stall_timer = self.loop.call_later(stall_timeout_s, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None

        def _stalled(self) -> None:
            self._stall_timer = None
            log.warning("http_write_stalled", stall_timeout_s=stall_timeout_s)
            self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            table.closed(self)
            self._disarm_headers()
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None
            super().connection_lost(exc)

    GuardedProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedProtocol
