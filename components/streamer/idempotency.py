"""Idempotency keys: a retried request attaches to the running one, or gets its finished
result within a TTL, instead of running twice. Pure: the streamer feeds it events and
asks it where they go.

An entry is keyed by (tenant, key), so one tenant's key can never reach another's
output. Beside it is a digest of what the request asked (:func:`request_digest`): a
retry under the same key that asks something else (another prompt, ``max_tokens``, ``n``)
is refused as a reuse of the key (HTTP 422, as the IETF Idempotency-Key draft says),
never answered with the first request's output.

The entry keeps what its request sent clients, compacted: the events before the first
token (``Accepted``), then per choice the text, token ids and logprobs so far, then the
terminal. A late subscriber is replayed from the start in at most ``n + 2`` events,
however long the output, so a retry costs the same whether it lands at the first token
or the thousandth (one event per token made 10,000 retries of a finished 400-token
request four million sends, and froze every other stream). The text is held only as long
as the entry lives, and only in memory.

Bounds, all enforced here:

- ``max_subscribers`` clients attached to one running request;
- ``attach_rate`` attaches per second per tenant (a burst of twice that): a replay is
  cheap, but it is output the tenant asked for once, sent again per small frame;
- finished entries expire after ``ttl_s``, and the oldest go first past ``max_entries`` or
  past ``max_bytes`` of recorded events together (running entries are bounded by the
  engine's own caps on open requests, and never evicted: a client is waiting on them);
- a finished entry whose record exceeds ``max_entry_bytes`` is not kept: a retry of it
  runs again (an 8k-token echo with top-20 logprobs records ~25 MB).

A request that ends other than ``finished`` drops its entry: retrying it runs it again.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from schemas.client import Finished, TextDelta

_encoder = msgspec.msgpack.Encoder()


def request_digest(sub: Any) -> bytes:
    """What a ``Submit`` asks for, as a digest: its prompt (text, messages or ids), its
    sampling parameters and its tools. Not its id, attempt, key, deadline, priority or
    class: a retry may change those and is still the same request."""
    body = (sub.prompt, sub.messages, sub.prompt_token_ids, sub.params, sub.tools)
    return hashlib.sha256(_encoder.encode(body)).digest()


@dataclass
class _Choice:
    """One choice's deltas so far, kept as parts (joined once per replay, not per token)."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    prompt: Any = None


@dataclass
class Entry:
    request_id: str                       # the request that runs
    digest: bytes
    subscribers: list[tuple[bytes, str]] = field(default_factory=list)   # (client, its id)
    head: list[Any] = field(default_factory=list)       # events before any delta (Accepted)
    choices: dict[int, _Choice] = field(default_factory=dict)
    terminal: Any = None
    bytes: int = 0                        # the recorded events' encoded size
    finished_at: float | None = None
    _replay: list[Any] | None = None      # the compacted record, until the next event

    def replay(self) -> list[Any]:
        if self._replay is None:
            deltas = [TextDelta(self.request_id, "".join(c.texts), tuple(c.token_ids), i,
                                tuple(c.logprobs), c.prompt)
                      for i, c in sorted(self.choices.items())]
            self._replay = [*self.head, *deltas] + ([self.terminal] if self.terminal else [])
        return self._replay


class Refused(msgspec.Struct, frozen=True):
    """Why an attach was refused: ``reused`` (the key names a different request),
    ``crowded`` (``max_subscribers`` clients are attached already) or ``rate`` (the tenant
    attached more than ``attach_rate`` per second)."""

    kind: str
    message: str


class IdempotencyTable:
    def __init__(self, ttl_s: float = 600.0, max_entries: int = 10_000,
                 max_bytes: int = 256 << 20, max_entry_bytes: int = 8 << 20,
                 max_subscribers: int = 8, attach_rate: float = 50.0) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self.max_bytes, self.max_entry_bytes = max_bytes, max_entry_bytes
        self.max_subscribers, self.attach_rate = max_subscribers, attach_rate
        self._attaches: dict[str, tuple[float, float]] = {}   # tenant -> (bucket, when)
        self._running: dict[tuple[str, str], Entry] = {}
        self._finished: OrderedDict[tuple[str, str], Entry] = OrderedDict()  # by finish time
        self._by_request: dict[str, tuple[str, str]] = {}
        self.finished_bytes = 0
        self.too_large = 0                # finished records dropped for max_entry_bytes

    def __len__(self) -> int:
        return len(self._running) + len(self._finished)

    def _get(self, key: tuple[str, str]) -> Entry | None:
        return self._running.get(key) or self._finished.get(key)

    def expire(self, now: float) -> None:
        """Drop finished entries past the TTL, then the oldest past the count or byte cap.
        Finished entries are kept in the order they finished, so a running entry (in its
        own map) never stops expiry behind it."""
        while self._finished:
            key, entry = next(iter(self._finished.items()))
            assert entry.finished_at is not None        # set as it joined _finished
            stale = now - entry.finished_at > self.ttl_s
            if not stale and len(self) <= self.max_entries \
                    and self.finished_bytes <= self.max_bytes:
                break
            del self._finished[key]
            self.finished_bytes -= entry.bytes

    def attach(self, tenant: str, key: str, who: bytes, request_id: str, now: float,
               digest: bytes) -> list[Any] | Refused | None:
        """If (tenant, key) names a running or recently finished request that asked the
        same (``digest``), subscribe ``(who, request_id)`` to it and return its record so
        far, renamed to ``request_id``; a :class:`Refused` if it asked something else or
        is crowded; None if the key is new."""
        self.expire(now)
        entry = self._get((tenant, key))
        if entry is None:
            return None
        if not self._take(tenant, now):
            return Refused("rate", f"more than {self.attach_rate:g} idempotent retries a "
                                   "second from this tenant")
        if entry.digest != digest:
            return Refused("reused", "this idempotency key was used for a different request "
                                     "(prompt or parameters differ)")
        if entry.finished_at is None:
            if len(entry.subscribers) >= self.max_subscribers:
                return Refused("crowded", f"{self.max_subscribers} retries are attached to "
                                          "this idempotency key's request already")
            entry.subscribers.append((who, request_id))
        return [rename(e, request_id) for e in entry.replay()]

    def _take(self, tenant: str, now: float) -> bool:
        """One attach from ``tenant``'s bucket (``attach_rate`` a second, a burst of twice
        that). Buckets that are full again are forgotten once many tenants have one, so
        claimed tenant names (an open endpoint) cannot grow the map without bound."""
        burst = 2 * self.attach_rate
        level, at = self._attaches.get(tenant, (burst, now))
        level = min(burst, level + (now - at) * self.attach_rate)
        if level < 1:
            return False
        self._attaches[tenant] = (level - 1, now)
        if len(self._attaches) > 1024:
            self._attaches = {t: (lv, a) for t, (lv, a) in self._attaches.items()
                              if lv + (now - a) * self.attach_rate < burst}
        return True

    def start(self, tenant: str, key: str, request_id: str, digest: bytes) -> None:
        self._running[(tenant, key)] = Entry(request_id, digest)
        self._by_request[request_id] = (tenant, key)

    def subscribers(self, request_id: str) -> list[tuple[bytes, str]]:
        key = self._by_request.get(request_id)
        entry = self._running.get(key) if key is not None else None
        return entry.subscribers if entry is not None else []

    def record(self, request_id: str, event: Any, now: float, terminal: bool) -> None:
        """Note an event of a request that has a key; a terminal one ends the entry's
        life as a stream (kept for the TTL if finished and small enough, dropped
        otherwise)."""
        key = self._by_request.get(request_id)
        entry = self._running.get(key) if key is not None else None
        if key is None or entry is None:
            return
        entry.bytes += len(_encoder.encode(event))
        entry._replay = None
        if isinstance(event, TextDelta):
            c = entry.choices.setdefault(event.index, _Choice())
            c.texts.append(event.text)
            c.token_ids.extend(event.token_ids)
            c.logprobs.extend(event.logprobs)
            c.prompt = c.prompt if c.prompt is not None else event.prompt
        elif not terminal:
            entry.head.append(event)
        if not terminal:
            return
        entry.terminal = event
        del self._by_request[request_id]
        del self._running[key]
        entry.subscribers = []
        if isinstance(event, Finished) and entry.bytes <= self.max_entry_bytes:
            entry.finished_at = now
            self._finished[key] = entry
            self.finished_bytes += entry.bytes
            self.expire(now)
        elif isinstance(event, Finished):
            self.too_large += 1

    def tracks(self, request_id: str) -> bool:
        return request_id in self._by_request


def rename(event: Any, request_id: str) -> Any:
    return msgspec.structs.replace(event, request_id=request_id)
