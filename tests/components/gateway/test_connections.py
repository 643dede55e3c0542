"""Which of the gateway's connections give way: the connection table alone (exact shed
order, per-peer refusal, loopback exempt, nothing left behind), and against a real uvicorn
server over a fake engine: idle connections past the cap do not lock a request out, an
idle connection waits first_byte_timeout_s (keepalive_timeout_s between requests) while a
begun request has read_timeout_s, and one client address holds at most
max_connections_per_peer."""
from __future__ import annotations

import socket
import time

import anyio
import httpx
import psutil
import pytest

from components.gateway.connections import Connections, exempt
from tests.components.gateway.fakes import FakeClient, serve

JSON = {"content-type": "application/json"}
OK_BODY = b'{"prompt": "hi", "max_tokens": 2}'
REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(OK_BODY), OK_BODY))
PARTIAL = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "


# -- the table ------------------------------------------------------------------------------

def test_the_oldest_idle_connections_make_room_at_the_cap():
    t: Connections[str] = Connections(per_peer=0)
    for c in "abcde":
        assert t.opened(c, "10.0.0.1") is None
    for c in "cabe":                      # idle in this order; d carries a request
        t.idle(c)
    t.busy("a")                           # a began one
    assert t.room(open_now=5, limit=4) == ["c", "b"]      # 5 - 2 < 4
    assert t.room(open_now=3, limit=4) == []              # under it: nothing
    assert t.room(open_now=9, limit=4) == ["e"]           # fewer than needed: all idle
    assert t.shed == 3 and len(t) == 2
    t.idle("a")
    t.idle("a")                           # twice: still one entry, the newest
    assert t.room(open_now=99, limit=1) == ["a"]
    for c in "abcde":
        t.closed(c)                       # the shed ones again: nothing happens
    assert len(t) == 0 and not t._peers and not t._idle


def test_a_peer_past_its_cap_gives_up_its_own_idle_connection_or_the_new_one():
    t: Connections[str] = Connections(per_peer=2)
    assert t.opened("a1", "10.0.0.1") is None and t.opened("b1", "10.0.0.2") is None
    t.idle("b1")                          # another peer's idle connection is not a candidate
    assert t.opened("a2", "10.0.0.1") is None
    assert t.opened("a3", "10.0.0.1") == "a3"             # none of its own idle: refused
    assert t.refused == 1 and len(t) == 3
    t.idle("a2")
    t.idle("a1")
    assert t.opened("a4", "10.0.0.1") == "a2"             # its oldest idle one
    assert t.opened("a5", "10.0.0.1") == "a1"
    assert t.opened("a6", "10.0.0.1") == "a6"
    assert t.shed == 2 and t.refused == 2
    assert t.room(open_now=10, limit=1) == ["b1"]          # a1, a2 were counted out
    for c in ("a1", "a2", "a3", "a4", "a5", "a6", "b1"):
        t.closed(c)
    assert len(t) == 0 and not t._peers


def test_loopback_and_socket_peers_have_no_cap():
    assert exempt("127.0.0.1") and exempt("127.8.9.10") and exempt("::1")
    assert exempt("::ffff:127.0.0.1") and exempt(None)
    assert not exempt("10.0.0.1") and not exempt("::ffff:10.0.0.1") and not exempt("fe80::1%eth0")
    assert not exempt("not an address")
    t: Connections[int] = Connections(per_peer=1)
    assert all(t.opened(i, "127.0.0.1") is None for i in range(50))


# -- the server -----------------------------------------------------------------------------

async def closed_within(conn, seconds: float) -> bytes:
    """What ``conn`` received until the server closed it; fails after ``seconds``."""
    data = b""
    with anyio.fail_after(seconds):
        try:
            while True:
                data += await conn.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
            return data


async def still_open(conn, seconds: float) -> bool:
    """Nothing arrives and the connection stays open for ``seconds``."""
    with anyio.move_on_after(seconds):
        try:
            await conn.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
            return False
        return False
    return True


@pytest.mark.anyio
async def test_idle_connections_past_the_cap_do_not_lock_out_a_request():
    """The issue's numbers: 300 connections that send nothing, cap 256. A request is
    served at once (it was a 503 until read_timeout_s closed them); the oldest idle ones
    were shed for it, and the rest close after first_byte_timeout_s."""
    async with serve(FakeClient(), max_connections=256, read_timeout_s=10.0,
                     first_byte_timeout_s=2.0) as gw:
        conns = [await anyio.connect_tcp("127.0.0.1", gw.port) for _ in range(300)]
        table = gw.protocol.connections_table
        with anyio.fail_after(5):
            while len(table) < 300:       # every connection accepted
                await anyio.sleep(0.01)
        t = time.monotonic()
        async with httpx.AsyncClient() as http:
            for _ in range(3):
                r = await http.post(gw.url + "/v1/completions", content=OK_BODY, headers=JSON)
                assert r.status_code == 200, r.text
        assert time.monotonic() - t < 1.5
        assert table.shed == 300 - 256 + 1 + 1          # room for the request's connection
        for conn in conns[:46]:                          # the oldest: already closed
            assert await closed_within(conn, 1.0) == b""
        for conn in conns[46:]:                          # the rest, by first_byte_timeout_s
            assert await closed_within(conn, 4.0) == b""
        assert time.monotonic() - t < 4.0
        for conn in conns:
            await conn.aclose()


@pytest.mark.anyio
async def test_a_silent_connection_waits_first_byte_timeout_and_a_begun_request_read_timeout():
    async with serve(FakeClient(), read_timeout_s=3.0, first_byte_timeout_s=0.5,
                     keepalive_timeout_s=1.0) as gw:
        silent = await anyio.connect_tcp("127.0.0.1", gw.port)
        begun = await anyio.connect_tcp("127.0.0.1", gw.port)
        t = time.monotonic()
        await begun.send(PARTIAL)
        assert await closed_within(silent, 2.5) == b""
        assert 0.4 < time.monotonic() - t < 2.5
        reply = await closed_within(begun, 5.0)              # 408, from its first byte
        assert reply.startswith(b"HTTP/1.1 408") and 2.9 < time.monotonic() - t < 5.0
        kept = await anyio.connect_tcp("127.0.0.1", gw.port)
        await kept.send(REQUEST)
        reply = b""
        while b'"finish_reason"' not in reply:
            reply += await kept.receive()
        t = time.monotonic()
        assert reply.startswith(b"HTTP/1.1 200")
        assert await still_open(kept, 0.6)                   # past first_byte_timeout_s
        assert await closed_within(kept, 2.0) == b""         # by keepalive_timeout_s
        assert 0.9 < time.monotonic() - t < 2.0
        for conn in (silent, begun, kept):
            await conn.aclose()


def _outside_address() -> str | None:
    """An IPv4 address of this machine that is not loopback: a peer the cap applies to."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not exempt(a.address):
                return a.address
    return None


@pytest.mark.anyio
async def test_one_address_holds_at_most_max_connections_per_peer():
    """From a non-loopback address, cap 4: with four requests under way a fifth connection
    is closed unanswered at once; with idle ones among them, the oldest gives way and the
    new one is served. Loopback, past the same cap, is served."""
    outside = _outside_address()
    if outside is None:
        pytest.skip("no non-loopback IPv4 address on this machine")
    async with serve(FakeClient(), host="0.0.0.0", max_connections_per_peer=4,
                     first_byte_timeout_s=5.0) as gw:
        busy = [await anyio.connect_tcp(outside, gw.port) for _ in range(4)]
        for conn in busy:
            await conn.send(PARTIAL)                         # begun: not idle
        over = await anyio.connect_tcp(outside, gw.port)
        t = time.monotonic()
        assert await closed_within(over, 1.0) == b""
        assert time.monotonic() - t < 1.0
        table = gw.protocol.connections_table
        assert table.refused == 1
        for conn in busy:
            await conn.aclose()
        with anyio.fail_after(5):
            while len(table):
                await anyio.sleep(0.01)
        idle = [await anyio.connect_tcp(outside, gw.port) for _ in range(4)]
        with anyio.fail_after(5):
            while len(table) < 4:
                await anyio.sleep(0.01)
        new = await anyio.connect_tcp(outside, gw.port)
        assert await closed_within(idle[0], 1.0) == b""     # the oldest idle gave way
        await new.send(REQUEST)
        reply = b""
        with anyio.fail_after(5):
            while b'"finish_reason"' not in reply:
                reply += await new.receive()
        assert reply.startswith(b"HTTP/1.1 200")
        assert all([await still_open(c, 0.05) for c in idle[1:]])
        assert table.shed == 1 and table.refused == 1
        for conn in (*idle, new):
            await conn.aclose()
        local = [await anyio.connect_tcp("127.0.0.1", gw.port) for _ in range(8)]
        for conn in local:
            await conn.send(PARTIAL)
        async with httpx.AsyncClient() as http:
            r = await http.post(gw.url + "/v1/completions", content=OK_BODY, headers=JSON)
            assert r.status_code == 200
        assert table.refused == 1
        for conn in local:
            await conn.aclose()
