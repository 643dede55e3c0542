"""Where a request goes: a pure function of what the router knows of each replica.

The first seed's second worked decision: send a request to the replica that holds its
longest cached prefix unless that replica is overloaded; compare the prefill a cached
prefix saves against queue delay and KV pressure. Everything is priced in seconds of time
to first token, so the weights (``RouterWeights``) are plain multipliers:

    score = prefix × saved_prefill_s − queue × queue_s
            − kv_used × used_fraction − active_kv × active_fraction − tenant × tenant_share

A replica whose predicted TTFT (queue delay plus the prefill it would still compute) misses
the request's deadline, or whose pool is nearly full, is *overloaded*: it gets the request
only when every healthy replica is. An unhealthy or draining replica gets nothing.

Sessions are sticky but movable (``SessionTable``): a session stays on its replica while
that replica is healthy and would meet the deadline, and moves, recorded, when not.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from schemas.config import RouterWeights


@dataclass(frozen=True)
class ReplicaState:
    """One replica as one request sees it."""

    name: str
    healthy: bool = True
    draining: bool = False
    cached_tokens: float = 0.0          # the prompt's prefix it holds (cpu tier discounted)
    queue_s: float = 0.0                # predicted wait before this prompt's prefill starts
    prefill_tokens_per_s: float = 2000.0
    kv_used: float = 0.0                # fraction of its KV blocks in use
    active_kv: float = 0.0              # fraction of its KV held by running sequences
    tenant_share: float = 0.0           # fraction of its KV this request's tenant holds

    @property
    def eligible(self) -> bool:
        return self.healthy and not self.draining


@dataclass(frozen=True)
class Score:
    name: str
    score: float
    ttft_s: float                       # predicted time to first token there
    overloaded: bool
    saved_s: float                      # prefill the cached prefix saves


def predicted_queue_s(reported_s: float, asked_s: float,
                      sent: Iterable[tuple[int, float, float]], rate: float) -> float:
    """A replica's queue delay now: its last load report (``reported_s``, for the query
    sent at ``asked_s``) corrected by what the router has seen since. ``sent`` holds
    ``(prompt tokens to prefill, accepted at, prefilled at)`` of prompts the router sent
    there (times on the router's clock, 0 for not yet).

    - A prompt still waiting that the report could not count (not accepted when it was
      asked) adds its tokens: without this, the requests arriving between two reports
      all see the same idle replica and pile onto it.
    - A prompt the report counted as waiting (accepted before it was asked) that has been
      prefilled since takes its tokens off: a stale report would hold a finished
      prompt against the replica that holds its prefix."""
    extra = 0
    for tokens, accepted, prefilled in sent:
        counted = 0.0 < accepted <= asked_s
        if not prefilled and not counted:
            extra += tokens
        elif prefilled and counted and prefilled > asked_s:
            extra -= tokens
    return max(reported_s + extra / max(rate, 1e-9), 0.0)


def score_replica(r: ReplicaState, prompt_tokens: int, deadline_s: float,
                  weights: RouterWeights, kv_high: float, use_prefix: bool = True) -> Score:
    rate = max(r.prefill_tokens_per_s, 1e-9)
    cached = min(r.cached_tokens, float(prompt_tokens)) if use_prefix else 0.0
    saved_s = cached / rate
    ttft_s = r.queue_s + (prompt_tokens - cached) / rate
    score = (weights.prefix * saved_s - weights.queue * r.queue_s
             - weights.kv_used * r.kv_used - weights.active_kv * r.active_kv
             - weights.tenant * r.tenant_share)
    return Score(r.name, score, ttft_s, ttft_s > deadline_s or r.kv_used >= kv_high, saved_s)


def rank(replicas: list[ReplicaState], prompt_tokens: int, deadline_s: float,
         weights: RouterWeights, kv_high: float, use_prefix: bool = True) -> list[Score]:
    """Eligible replicas, best first: not overloaded before overloaded, then by score,
    then by predicted TTFT, then by name (so equal replicas order the same every time)."""
    scores = [score_replica(r, prompt_tokens, deadline_s, weights, kv_high, use_prefix)
              for r in replicas if r.eligible]
    return sorted(scores, key=lambda s: (s.overloaded, -s.score, s.ttft_s, s.name))


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str                         # best | sticky | moved:<why> | round_robin | idempotent
    moved_from: str | None = None


@dataclass
class _Session:
    replica: str
    last_s: float


@dataclass
class SessionTable:
    """session id → its replica, forgotten after ``ttl_s`` idle or past ``max_sessions``
    (the least recently used first). The router keeps a second one keyed by (tenant,
    idempotency key): where a retry must go."""

    ttl_s: float = 900.0
    max_sessions: int = 100_000
    _sessions: OrderedDict[Hashable, _Session] = field(default_factory=OrderedDict)
    moves: int = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: Hashable, now_s: float) -> str | None:
        s = self._sessions.get(session_id)
        if s is None or now_s - s.last_s > self.ttl_s:
            return None
        return s.replica

    def decide(self, session_id: str | None, ranked: list[Score], now_s: float) -> Decision | None:
        """The replica for a request of ``session_id`` given the ranking of the eligible
        replicas; None when there is none. The session stays where it is while that
        replica is eligible and not overloaded, else moves to the best one."""
        if not ranked:
            return None
        best = ranked[0]
        if session_id is None:
            return Decision(best.name, "best")
        current = self.get(session_id, now_s)
        here = next((s for s in ranked if s.name == current), None)
        if here is not None and (not here.overloaded or best.overloaded):
            decision = Decision(here.name, "sticky")
        elif current is None:
            decision = Decision(best.name, "best")
        else:
            why = "unhealthy" if here is None else "overloaded"
            decision = Decision(best.name, f"moved:{why}", moved_from=current)
            self.moves += 1
        self._remember(session_id, decision.replica, now_s)
        return decision

    def _remember(self, session_id: Hashable, replica: str, now_s: float) -> None:
        self._sessions[session_id] = _Session(replica, now_s)
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        self.expire(now_s)

    def expire(self, now_s: float) -> None:
        """Forget the sessions idle past ``ttl_s``: the least recently used come first, so
        this stops at the first one still kept (the router calls it every tick)."""
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if now_s - oldest.last_s <= self.ttl_s:
                break
            self._sessions.popitem(last=False)

    def assign(self, session_id: Hashable, replica: str, now_s: float) -> None:
        """The session's request went to ``replica`` (a reroute after a rejection): it
        lives there now (a move, if it lived elsewhere)."""
        current = self.get(session_id, now_s)
        if current is not None and current != replica:
            self.moves += 1
        self._remember(session_id, replica, now_s)
