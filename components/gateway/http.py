"""HTTP hardening for the gateway: what a client may send and how long it may take.

Two layers, because uvicorn offers no header timeout and no way to bound a blocked write:

- :func:`guarded_protocol` subclasses uvicorn's HTTP protocol (httptools, else h11). A
  connection must deliver a request's headers within ``read_timeout_s`` of opening (or of
  its previous response ending) and in at most ``MAX_HEADER_BYTES``; else it gets 408 / 431
  and is closed. A connection whose send buffer stays full (the client stopped reading)
  for ``stall_timeout_s`` is aborted — ``close()`` would wait forever to flush — which the
  app sees as a disconnect, so its request is cancelled in the engine.
- In the app: :func:`check_content_type` (415), :func:`read_body` (413 as soon as
  Content-Length or the bytes read pass ``max_body_bytes``; 408 if the body does not arrive
  within ``read_timeout_s``), and :class:`GuardedStreamingResponse`, whose every ``send``
  is bounded by ``stall_timeout_s`` (by one timer per response where the server offers an
  abort, else a cancel scope per send: it works under any ASGI server), and which closes
  its body iterator deterministically, so the stream's ``finally`` cancels the engine
  request.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Any, Callable

import anyio
import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse

from components.gateway.openai_api import ApiError

log = structlog.get_logger("gateway")

MAX_HEADER_BYTES = 64 << 10
ABORT_EXTENSION = "weir.abort"          # scope["extensions"][...]: abort the connection now


def check_content_type(content_type: str | None) -> None:
    """A request body must be declared JSON: ``application/json``, optionally with
    ``charset=utf-8``. Missing or anything else is 415 (a form post or a browser's
    ``text/plain`` simple request never reaches the engine)."""
    if content_type is None:
        raise ApiError(415, "set Content-Type: application/json", code="unsupported_media_type")
    media, _, params = content_type.partition(";")
    ok = media.strip().lower() == "application/json"
    for param in params.split(";") if params.strip() else ():
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
                "utf-8", "utf8"):
            ok = False
    if not ok:
        raise ApiError(415, f"Content-Type must be application/json, got {content_type[:80]!r}",
                       code="unsupported_media_type")


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, read incrementally: refused (413) as soon as ``Content-Length`` or
    the bytes received pass ``max_bytes``, never buffered past it, and 408 if it has not
    all arrived within ``timeout_s``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body is {int(declared)} bytes; at most {max_bytes} "
                            "are accepted", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise ApiError(413, f"the request body is over {max_bytes} bytes",
                                   code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g}s",
                       code="request_timeout") from None
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the body",
                       code="client_disconnected") from None
    return b"".join(chunks)


class _Stalled(Exception):
    pass


class GuardedStreamingResponse(StreamingResponse):
    """A StreamingResponse whose ``send`` may block at most ``stall_timeout_s`` (a client
    that stops reading fills the socket buffer and blocks every send after). On a stall
    it calls ``on_stall``, aborts the connection where the server offers it, and returns.
    Either way the body iterator is closed before the response returns, so its cleanup
    (cancelling the engine request) runs now, not when it is garbage collected."""

    def __init__(self, content: Any, *, stall_timeout_s: float,
                 on_stall: Callable[[], None] | None = None, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.stall_timeout_s = stall_timeout_s
        self.on_stall = on_stall
        self.stalled = False
        self._abort: Callable[[], None] | None = None

    async def __call__(self, scope, receive, send) -> None:
        self._abort = (scope.get("extensions") or {}).get(ABORT_EXTENSION)
        await super().__call__(scope, receive, send)

    def _stall(self) -> None:
        """The client stopped reading: count it, and abort the connection (once)."""
        if self.stalled:
            return
        self.stalled = True
        log.warning("sse_client_stalled", stall_timeout_s=self.stall_timeout_s)
        if self.on_stall is not None:
            self.on_stall()
        if self._abort is not None:
            self._abort()

    def _scoped(self, send):
        """``send`` bounded by a cancel scope each: works under any ASGI server."""
        async def bounded_send(message) -> None:
            with anyio.move_on_after(self.stall_timeout_s) as scope:
                await send(message)
            if scope.cancelled_caught:
                raise _Stalled
        return bounded_send, None

    def _watched(self, send):
        """``send`` bounded by one timer for the whole response, not a cancel scope per
        send (those were ~15% of the gateway's CPU at 64 streams): the timer looks at the
        send in progress, and aborts the connection if it has waited ``stall_timeout_s``,
        which makes the server return from it (a disconnect). Only where the server
        offers an abort."""
        loop = asyncio.get_running_loop()
        limit = self.stall_timeout_s
        pending: float | None = None              # when the send in progress began

        def check() -> None:
            nonlocal timer
            now = loop.time()
            if pending is not None and now - pending >= limit:
                self._stall()
                return
            timer = loop.call_later(limit if pending is None else pending + limit - now, check)

        timer = loop.call_later(limit, check)

        async def bounded_send(message) -> None:
            nonlocal pending
            pending = loop.time()
            try:
                await send(message)
            finally:
                pending = None
            if self.stalled:
                raise _Stalled
        return bounded_send, lambda: timer.cancel()

    async def stream_response(self, send) -> None:
        bounded_send, stop = self._scoped(send) if self._abort is None else self._watched(send)
        try:
            await super().stream_response(bounded_send)
        except _Stalled:
            self._stall()
        finally:
            if stop is not None:
                stop()
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                await anyio.sleep(0)              # let an abort's connection_lost run


_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_TOO_LARGE_431 = (b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                  b"content-type: application/json\r\nconnection: close\r\n"
                  b"content-length: %d\r\n\r\n%s")


def _raw(template: bytes, message: str, code: str) -> bytes:
    body = (b'{"error": {"message": "%s", "type": "invalid_request_error", "param": null, '
            b'"code": "%s"}}' % (message.encode(), code.encode()))
    return template % (len(body), body)


def guarded_protocol(read_timeout_s: float, stall_timeout_s: float,
                     max_header_bytes: int = MAX_HEADER_BYTES,
                     base: type[asyncio.Protocol] | None = None,
                     send_buffer_bytes: int = 0) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with a header deadline, a header size cap and a
    write-stall abort (see the module docstring). Pass it as ``uvicorn.Config(http=...)``.
    ``send_buffer_bytes`` (0: the defaults, the kernel's autotuned up to megabytes) bounds
    what the kernel and the event loop each hold for a client that is not reading, so its
    stall shows sooner."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base   # noqa: N813

    class GuardedProtocol(base):                                     # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None
        _stall_timer: asyncio.TimerHandle | None = None
        _armed_cycle: Any = None
        _header_bytes = 0              # bytes received while waiting for a head

        # -- headers: a deadline from connection (or previous response) to a complete head
        def _arm_headers(self) -> None:
            self._disarm_headers()
            self._armed_cycle = self.cycle
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(read_timeout_s, self._header_timeout)

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

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if send_buffer_bytes:        # the kernel's buffer, and the event loop's above it
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
                transport.set_write_buffer_limits(high=send_buffer_bytes)
            self._arm_headers()

        def data_received(self, data: bytes) -> None:
            waiting = self._header_timer is not None
            if waiting:
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
                self._arm_headers()                  # idle: the next head has a deadline

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
            self._disarm_headers()
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None
            super().connection_lost(exc)

    GuardedProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedProtocol
