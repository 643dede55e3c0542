"""Idempotency keys: a retried request attaches to the running one, or gets its finished
result within a TTL, instead of running twice. Pure: the streamer feeds it events and
asks it where they go.

An entry is keyed by (tenant, key), so one tenant's key can never reach another's
output. It records every client-bound event of the original request (the text is held
only as long as the entry lives, and only in memory) so that a late subscriber can be
replayed from the start. A request that ends other than ``finished`` drops its entry:
retrying it runs it again. Entries are bounded in number and time.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from schemas.client import Finished


@dataclass
class Entry:
    request_id: str                       # the request that runs
    subscribers: list[tuple[bytes, str]] = field(default_factory=list)   # (client, its id)
    events: list[Any] = field(default_factory=list)
    finished_at: float | None = None


class IdempotencyTable:
    def __init__(self, ttl_s: float = 600.0, max_entries: int = 10_000) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._by_key: OrderedDict[tuple[str, str], Entry] = OrderedDict()
        self._by_request: dict[str, tuple[str, str]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def _expire(self, now: float) -> None:
        while self._by_key:
            key, entry = next(iter(self._by_key.items()))
            done_long_ago = entry.finished_at is not None and now - entry.finished_at > self.ttl_s
            if not done_long_ago and len(self._by_key) <= self.max_entries:
                break
            if entry.finished_at is None and not done_long_ago:
                break                      # never evict a running entry; it ends on its own
            del self._by_key[key]

    def attach(self, tenant: str, key: str, who: bytes, request_id: str,
               now: float) -> list[Any] | None:
        """If (tenant, key) names a running or recently finished request, subscribe
        ``(who, request_id)`` to it and return the events so far, renamed to
        ``request_id``; None if the key is new."""
        self._expire(now)
        entry = self._by_key.get((tenant, key))
        if entry is None:
            return None
        if entry.finished_at is None:
            entry.subscribers.append((who, request_id))
        return [rename(e, request_id) for e in entry.events]

    def start(self, tenant: str, key: str, request_id: str) -> None:
        self._by_key[(tenant, key)] = Entry(request_id)
        self._by_request[request_id] = (tenant, key)

    def subscribers(self, request_id: str) -> list[tuple[bytes, str]]:
        key = self._by_request.get(request_id)
        return self._by_key[key].subscribers if key in self._by_key else []

    def record(self, request_id: str, event: Any, now: float, terminal: bool) -> None:
        """Note an event of a request that has a key; a terminal one ends the entry's
        life as a stream (kept for the TTL if finished, dropped otherwise)."""
        key = self._by_request.get(request_id)
        entry = self._by_key.get(key) if key is not None else None
        if entry is None:
            return
        entry.events.append(event)
        if terminal:
            del self._by_request[request_id]
            entry.subscribers = []
            if isinstance(event, Finished):
                entry.finished_at = now
            else:
                del self._by_key[key]

    def tracks(self, request_id: str) -> bool:
        return request_id in self._by_request


def rename(event: Any, request_id: str) -> Any:
    return msgspec.structs.replace(event, request_id=request_id)
