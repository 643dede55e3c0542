"""What admission knows before a request runs: how long its output will likely be. Pure.
(A tenant's token budget is ``components/tenancy/bucket.py``.)"""
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
