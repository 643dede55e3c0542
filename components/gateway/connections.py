"""Which of the gateway's connections give way: the open connections by peer address, and
the idle ones (no byte of a request yet: new, or kept alive between requests) in the order
they became idle. Synchronous and free of I/O: the HTTP protocol (``http.py``) tells it as a
connection opens, goes idle, begins a request and closes, and closes what it names.

Two rules, both about connections that hold a place without a request in it:

- At the global cap, a request that arrives is served by shedding the oldest idle
  connections, not refused. uvicorn counts every open connection against its
  ``limit_concurrency``: 300 connections that never sent a byte (cap 256) made every new
  request a 503 until the read timeout closed them.
- A peer address holds at most ``per_peer`` connections. Past it, the peer's own oldest idle
  connection makes room; if it has none, the new connection is closed before a byte of it
  is read. Closed, not answered: an answer needs the request's head read, and reading
  heads is the very thing being bounded (a peer that never finishes one would hold each
  over-cap connection for ``read_timeout_s``). Loopback peers are exempt: the gateway binds
  loopback by default, so every client would be one peer, and a proxy on the same host
  presents every user as 127.0.0.1.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Hashable
from typing import Generic, TypeVar

C = TypeVar("C", bound=Hashable)
_MISSING: object = object()


def exempt(peer: str | None) -> bool:
    """Loopback (IPv4, IPv6, or IPv4 mapped into IPv6), or no address (a Unix socket)."""
    if peer is None:
        return True
    try:
        addr = ipaddress.ip_address(peer.partition("%")[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


class _Peer(Generic[C]):
    __slots__ = ("open", "idle")

    def __init__(self) -> None:
        self.open = 0
        self.idle: dict[C, None] = {}        # oldest first


class Connections(Generic[C]):
    """Counts by peer and the idle order. ``per_peer`` 0: no per-peer cap."""

    def __init__(self, per_peer: int) -> None:
        self.per_peer = per_peer
        self._peers: dict[str | None, _Peer[C]] = {}
        self._peer_of: dict[C, str | None] = {}
        self._idle: dict[C, None] = {}       # every peer's, oldest first
        self.shed = 0                        # idle connections closed to make room
        self.refused = 0                     # new connections closed: their peer was full

    def __len__(self) -> int:
        return len(self._peer_of)

    def opened(self, conn: C, peer: str | None) -> C | None:
        """Count ``conn`` for ``peer``. What to close for it: the peer's oldest idle
        connection where the peer is past its cap, ``conn`` itself where the peer has none
        idle, else None. What it names is no longer counted (``closed`` when it closes
        does nothing more), so a burst of connections does not shed twice for one."""
        p = self._peers.get(peer)
        if p is None:
            p = self._peers[peer] = _Peer()
        p.open += 1
        self._peer_of[conn] = peer
        if not self.per_peer or p.open <= self.per_peer or exempt(peer):
            return None
        if p.idle:
            victim = next(iter(p.idle))
            self.closed(victim)
            self.shed += 1
            return victim
        self.closed(conn)
        self.refused += 1
        return conn

    def idle(self, conn: C) -> None:
        """``conn`` waits for the first byte of a request (it is the newest idle one)."""
        peer = self._peer_of.get(conn, _MISSING)
        if peer is _MISSING:
            return
        self._idle.pop(conn, None)
        self._idle[conn] = None
        p = self._peers[peer]
        p.idle.pop(conn, None)
        p.idle[conn] = None

    def busy(self, conn: C) -> None:
        """``conn`` began a request (or is being closed): it is no longer idle."""
        if self._idle.pop(conn, _MISSING) is not _MISSING:
            self._peers[self._peer_of[conn]].idle.pop(conn, None)

    def closed(self, conn: C) -> None:
        if conn not in self._peer_of:
            return
        self.busy(conn)
        peer = self._peer_of.pop(conn)
        p = self._peers[peer]
        p.open -= 1
        if not p.open:
            del self._peers[peer]

    def room(self, open_now: int, limit: int) -> list[C]:
        """The idle connections to close, oldest first, so that ``open_now`` open
        connections come under ``limit`` (as few as that takes; fewer where too few are
        idle). They are no longer counted."""
        out: list[C] = []
        while open_now - len(out) >= limit and self._idle:
            victim = next(iter(self._idle))
            self.closed(victim)
            out.append(victim)
        self.shed += len(out)
        return out

