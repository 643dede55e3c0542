"""A client that stops reading an SSE stream is cut off after stream_stall_timeout_s and its
request is cancelled in the engine, so the gateway never waits on it forever."""
from __future__ import annotations

import socket
import time

import anyio
import httpx
import pytest

from components.gateway.app import build_app
from components.gateway.auth import Authenticator
from components.gateway.http import ABORT_EXTENSION, GuardedStreamingResponse
from components.gateway.state import GatewayState
from schemas.config import GatewayConfig
from tests.components.gateway.fakes import FakeClient, serve

pytestmark = pytest.mark.anyio


def _scope(spec: str, extensions: dict | None = None, path: str = "/",
           headers: list | None = None) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "headers": headers or [],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
            "extensions": extensions or {}}


class BlockingSend:
    """An ASGI send whose peer stops reading after ``accept`` messages: it then blocks,
    until ``abort`` (as uvicorn's: the lost connection resumes writing, and a send on it
    returns without writing)."""

    def __init__(self, accept: int) -> None:
        self.accept, self.messages, self.aborts = accept, [], 0
        self.aborted = anyio.Event()

    def abort(self) -> None:
        self.aborts += 1
        self.aborted.set()

    async def __call__(self, message) -> None:
        if len(self.messages) >= self.accept:
            await self.aborted.wait()
            return
        self.messages.append(message)


async def _never_disconnects():
    await anyio.sleep_forever()


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
async def test_a_blocked_send_is_bounded_and_the_body_is_closed(spec):
    closed = anyio.Event()

    async def body():
        try:
            while True:
                yield b"data: x\n\n"
        finally:
            closed.set()                     # where the gateway cancels the engine request

    stalls = []
    resp = GuardedStreamingResponse(body(), stall_timeout_s=0.2, on_stall=lambda: stalls.append(1),
                                    media_type="text/event-stream")
    send = BlockingSend(accept=4)
    t = time.monotonic()
    with anyio.fail_after(3):
        await resp(_scope(spec, {ABORT_EXTENSION: send.abort}), _never_disconnects, send)
    assert 0.2 <= time.monotonic() - t < 1.5
    assert closed.is_set() and resp.stalled and stalls == [1] and send.aborts == 1
    assert len(send.messages) == 4                     # nothing was written after the stall


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
async def test_without_an_abort_a_blocked_send_is_cancelled(spec):
    """A server that offers no abort: each send is bounded by its own cancel scope."""
    stalls = []

    async def body():
        while True:
            yield b"data: x\n\n"

    resp = GuardedStreamingResponse(body(), stall_timeout_s=0.2, on_stall=lambda: stalls.append(1))
    send = BlockingSend(accept=3)                      # never aborted: a send blocks for good
    with anyio.fail_after(3):
        await resp(_scope(spec), _never_disconnects, send)
    assert resp.stalled and stalls == [1] and len(send.messages) == 3


async def test_a_slow_send_under_the_limit_is_not_a_stall():
    """One timer per response: each send is measured from its own start, so sends that
    each wait most of the limit, back to back for several limits, are never cut off."""
    async def body():
        for _ in range(8):
            yield b"data: x\n\n"

    async def slow_send(message):
        await anyio.sleep(0.06)                      # 0.6 of the limit, every send

    aborts = []
    resp = GuardedStreamingResponse(body(), stall_timeout_s=0.1)
    with anyio.fail_after(3):
        await resp(_scope("2.4", {ABORT_EXTENSION: lambda: aborts.append(1)}),
                   _never_disconnects, slow_send)
    assert not resp.stalled and aborts == []


async def test_a_reading_client_is_never_cut_off():
    async def body():
        for _ in range(50):
            yield b"data: x\n\n"

    async def slow_send(message):
        await anyio.sleep(0.005)             # slow, but always making progress

    resp = GuardedStreamingResponse(body(), stall_timeout_s=0.1)
    await resp(_scope("2.4"), _never_disconnects, slow_send)
    assert not resp.stalled


async def test_the_app_cancels_the_engine_request_of_a_stalled_sse_client():
    """Through the gateway app itself (no server): the SSE generator's cleanup runs and
    calls stream.cancel() once send has blocked for stream_stall_timeout_s."""
    client = FakeClient(deltas=10**6, text="x" * 100)
    state = GatewayState(client, Authenticator(()), "m",
                         GatewayConfig(stream_stall_timeout_s=0.3), 2048)
    app = build_app(state)
    body = b'{"prompt": "hi", "max_tokens": 1000, "stream": true}'
    sent_body = False

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()

    send = BlockingSend(accept=20)
    with anyio.fail_after(5):
        await app(_scope("2.3", path="/v1/completions",
                         headers=[(b"content-type", b"application/json")]), receive, send)
    assert send.messages[0]["status"] == 200
    stream = client.streams[0]
    assert stream.cancelled.is_set() and stream.closed.is_set()


async def test_a_real_socket_that_stops_reading_is_aborted_and_cancelled():
    """n=16-style flood to a client that never reads: within the stall timeout the gateway
    aborts the connection, cancels the request, and keeps serving everyone else."""
    client = FakeClient(deltas=10**6, text="y" * 16384)
    async with serve(client, stream_stall_timeout_s=0.5) as gw:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", gw.port))
        body = b'{"prompt": "hi", "max_tokens": 1900, "n": 16, "stream": true, "ignore_eos": true}'
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        t = time.monotonic()
        with anyio.fail_after(5):
            while not client.streams:
                await anyio.sleep(0.01)
            await client.streams[0].cancelled.wait()
        assert time.monotonic() - t < 3
        async with httpx.AsyncClient() as http:
            assert (await http.get(gw.url + "/health")).status_code == 200
        sock.setblocking(False)              # the server side is gone: drained data then EOF/RST
        gone = False
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not gone:
            try:
                gone = sock.recv(1 << 20) == b""
            except BlockingIOError:
                await anyio.sleep(0.01)
            except ConnectionResetError:
                gone = True
        sock.close()
        assert gone


@pytest.mark.parametrize("first_delay, stream", [(0.0, False), (30.0, False), (30.0, True)])
async def test_a_client_that_leaves_before_its_response_is_cancelled(first_delay, stream):
    """Non-streamed (and not yet started) responses watch for the client leaving too: its
    request is cancelled in the engine instead of running to max_tokens."""
    client = FakeClient(deltas=10**6, text="z", delay=0.01, first_delay=first_delay)
    async with serve(client) as gw:
        body = (b'{"prompt": "hi", "max_tokens": 1000, "stream": %s}'
                % (b"true" if stream else b"false"))
        async with await anyio.connect_tcp("127.0.0.1", gw.port) as conn:
            await conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                            b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            with anyio.fail_after(5):
                while not client.streams:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.2)
        with anyio.fail_after(3):
            await client.streams[0].cancelled.wait()
