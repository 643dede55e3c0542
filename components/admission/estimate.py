"""What admission knows before a request runs: how long its output will likely be, and how
much of a tenant's token budget is left. Pure; the caller passes the clock."""
from __future__ import annotations

import math
from collections import deque

COLD_START = 8            # outputs seen (per tenant and class) before the percentile is used


class OutputStats:
    """Recent output lengths per (tenant, class). ``expected`` is a high percentile of the
    last ``window`` outputs, capped by the request's ``max_tokens``.

    Cold start (fewer than COLD_START outputs for the pair): the request's ``max_tokens``, or
    ``fallback`` when it has none. Assuming the cap is pessimistic: a new tenant's first few
    requests reserve their whole horizon rather than being admitted on a guess."""

    def __init__(self, percentile: float = 90.0, window: int = 256) -> None:
        self.percentile = percentile
        self.window = window
        self._recent: dict[tuple[str, str], deque[int]] = {}

    def observe(self, tenant: str, service_class: str, output_tokens: int) -> None:
        key = (tenant, service_class)
        if key not in self._recent:
            self._recent[key] = deque(maxlen=self.window)
        self._recent[key].append(output_tokens)

    def expected(self, tenant: str, service_class: str, max_tokens: int | None,
                 fallback: int) -> int:
        seen = self._recent.get((tenant, service_class), ())
        if len(seen) < COLD_START:
            return max_tokens if max_tokens is not None else fallback
        ordered = sorted(seen)
        rank = max(math.ceil(self.percentile / 100 * len(ordered)) - 1, 0)
        value = ordered[rank]
        return min(value, max_tokens) if max_tokens is not None else value


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
