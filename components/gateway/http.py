"""HTTP hardening for the gateway, in the app: what a client may send and how long it may
take. (What a connection may do before its request reaches the app is ``protocol.py``'s.)

- :func:`check_content_type` (415), :func:`read_body` (413 as soon as Content-Length or the
  bytes read pass ``max_body_bytes``; 408 if the body does not arrive within
  ``read_timeout_s``), and :class:`GuardedStreamingResponse`, whose every ``send`` is
  bounded by ``stall_timeout_s`` (by one timer per response where the server offers an
  abort, else a cancel scope per send: it works under any ASGI server), and which closes
  its body iterator deterministically, so the stream's ``finally`` cancels the engine
  request.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse

from components.gateway.openai_api import ApiError

log = structlog.get_logger("gateway")

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
