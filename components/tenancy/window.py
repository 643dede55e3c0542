"""Tokens each tenant used in the last few seconds, in one-second slots: what a replica's
admission reports so that a restarted router can rebuild its fleet token buckets from the
replicas (components/router/budgets.py) instead of starting them full. Pure; the caller
passes the clock.

A token bucket of rate ``r`` and size ``b``, started full and charged ``C(s, t)`` between
``s`` and ``t``, holds at ``t`` the least over ``s`` of ``b + r·(t − s) − C(s, t)`` (and at
most ``b``). So usage over trailing windows is enough to rebuild it: each window gives an
upper bound on the level, and the windows double (``WINDOWS_S``), so the rebuilt level is
at most ``r`` times the gap between two windows above the exact one. A window is read in
whole seconds, up to one second long (never short): that errs the other way, low, by at
most a second's usage."""
from __future__ import annotations

import math
from collections import deque

WINDOWS_S = (1, 2, 4, 8, 16, 32, 64)
SLOTS = WINDOWS_S[-1] + 1


class UsageWindow:
    def __init__(self) -> None:
        self._slots: dict[str, deque[tuple[int, int]]] = {}   # tenant -> (second, tokens)

    def add(self, tenant: str, tokens: int, now: float) -> None:
        if tokens <= 0:
            return
        sec = math.floor(now)
        q = self._slots.setdefault(tenant, deque())
        if q and q[-1][0] == sec:
            q[-1] = (sec, q[-1][1] + tokens)
        else:
            q.append((sec, tokens))
        while q and q[0][0] <= sec - SLOTS:
            q.popleft()

    def used(self, tenant: str, window_s: int, now: float) -> int:
        """Tokens ``tenant`` used in the last ``window_s`` seconds: the current second's
        slot and the ``window_s`` before it (long by up to a second, never short)."""
        sec = math.floor(now)
        return sum(n for s, n in self._slots.get(tenant, ()) if s >= sec - window_s)

    def stats(self, now: float) -> dict[str, float]:
        """``used_tokens.<window>s.<tenant>`` for each tenant that used any in the
        longest window."""
        out: dict[str, float] = {}
        for tenant in list(self._slots):
            if self.used(tenant, WINDOWS_S[-1], now) == 0:
                del self._slots[tenant]
                continue
            for w in WINDOWS_S:
                out[f"used_tokens.{w}s.{tenant}"] = self.used(tenant, w, now)
        return out


def rebuilt_level(rate: float, burst: float, used: dict[int, float]) -> float:
    """A token bucket's level from the tokens used over trailing windows (``used``: window
    seconds -> tokens): the least of the bounds each window gives, at most ``burst``."""
    return min([burst] + [burst + rate * w - n for w, n in used.items()])
