"""Virtual token counters (VTC): fairness between tenants by weighted service, not requests.

A tenant's counter grows by the service it receives: input tokens × ``w_in`` when they are
computed, output tokens × ``w_out`` when they are sampled, divided by the tenant's weight.
New work starts in counter order, so a tenant that has received less goes first. A tenant
that becomes backlogged again is lifted to the smallest counter among the backlogged
tenants: idle time earns no credit. Pure and synchronous."""
from __future__ import annotations

from collections.abc import Iterable


class VirtualCounters:
    def __init__(self, weights: dict[str, float] | None = None, w_in: float = 1.0,
                 w_out: float = 2.0) -> None:
        self.weights = dict(weights or {})
        self.w_in, self.w_out = w_in, w_out
        self.counters: dict[str, float] = {}

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def charge(self, tenant: str, input_tokens: int = 0, output_tokens: int = 0) -> None:
        cost = input_tokens * self.w_in + output_tokens * self.w_out
        if cost:
            self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weight(tenant)

    def backlogged(self, tenant: str, others: Iterable[str]) -> None:
        """``tenant`` has work again, while ``others`` already had: lift its counter to the
        smallest of theirs (never lower it)."""
        floor = min((self.counters.get(t, 0.0) for t in others if t != tenant), default=None)
        if floor is not None:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def of(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)
