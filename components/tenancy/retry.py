"""Retry-After estimates: how long until a backlog drains at the rate requests have
recently been ending. Pure (the caller passes the clock)."""
from __future__ import annotations

from collections import deque


class DrainRate:
    def __init__(self, window_s: float = 30.0, maxlen: int = 256) -> None:
        self.window_s = window_s
        self._ends: deque[float] = deque(maxlen=maxlen)

    def ended(self, now: float) -> None:
        self._ends.append(now)

    def rate(self, now: float) -> float | None:
        """Requests ended per second over the window; None until two have ended in it."""
        recent = [t for t in self._ends if now - t < self.window_s]
        return len(recent) / max(now - recent[0], 1e-3) if len(recent) >= 2 else None

    def retry_after(self, backlog: int, now: float) -> float:
        """Seconds until ``backlog`` requests would end at the recent rate, in [1, 60];
        0.5 requests/s is assumed until two have ended in the window."""
        recent = [t for t in self._ends if now - t < self.window_s]
        rate = len(recent) / max(now - recent[0], 1.0) if len(recent) >= 2 else 0.5
        return round(min(max(backlog / rate, 1.0), 60.0), 1)
