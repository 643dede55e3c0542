"""A tenant's token rate (``token_rate``, ``token_burst``) as a token bucket: admission keeps
one per tenant to refuse or shorten what the budget cannot pay for, the scheduler one to
charge the tokens the engine computes. Pure; the caller passes the clock."""
from __future__ import annotations

import math


class TokenBucket:
    """Tokens per second with a burst. ``level`` refills continuously up to ``burst``."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst if burst > 0 else rate
        self.level = self.burst
        self._at = now

    def refill(self, now: float) -> float:
        self.level = min(self.burst, self.level + (now - self._at) * self.rate)
        self._at = now
        return self.level

    def take(self, tokens: float, now: float) -> None:
        self.refill(now)
        self.level -= tokens

    def wait_s(self, tokens: float, now: float) -> float:
        """Seconds until ``tokens`` are available (0 if they are now)."""
        short = tokens - self.refill(now)
        return max(short / self.rate, 0.0) if self.rate > 0 else math.inf
