"""Admission's queue: the requests that could not start when they arrived, in the order
they may start. Across tenants the least served first (the tenants' virtual counters, the
scheduler's VTC); within a tenant, class priority with aging, then deadline, then arrival.
The policy decides what leaves it and when; this holds the order. Pure, clock injected."""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from components.scheduler.fairness import VirtualCounters
from schemas.wire import Tokenized


@dataclass(order=True)
class Queued:
    order: tuple                     # (tenant's counter, priority now, deadline, arrival, seq)
    request_id: str = field(compare=False)
    req: Tokenized = field(compare=False)
    decision: object = field(compare=False)       # the policy's Decision (kind QUEUE)
    queued_at: float = field(compare=False)
    deadline_at: float = field(compare=False)     # when it expires
    aging_per_s: float = field(compare=False)     # its class's priority gain per second
    seq: int = field(compare=False)

    @property
    def tenant(self) -> str:
        return self.req.tenant


class AdmissionQueue:
    """Short (``admission.max_queued``), so the order is recomputed whenever it is read:
    priorities age, and counters move as tenants are served."""

    def __init__(self, vtc: VirtualCounters) -> None:
        self.vtc = vtc
        self._items: dict[str, Queued] = {}           # by request id, in arrival order
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._items)

    def order(self, tenant: str, priority: float, deadline_at: float, at: float) -> tuple:
        """Where a request of ``tenant`` with ``priority`` (already aged) and
        ``deadline_at``, queued ``at``, stands: compare with ``Queued.order[:4]``."""
        return (self.vtc.of(tenant), priority, deadline_at, at)

    def add(self, req: Tokenized, decision, aging_per_s: float, now: float,
            deadline_at: float) -> Queued:
        # queued here makes a tenant backlogged (admitted work alone does not)
        waiting = {q.tenant for q in self._items.values()}
        if req.tenant not in waiting:
            self.vtc.backlogged(req.tenant, waiting)
        seq = next(self._seq)
        item = Queued(self.order(req.tenant, decision.priority, deadline_at, now) + (seq,),
                      req.request_id, req, decision, now, deadline_at, aging_per_s, seq)
        self._items[req.request_id] = item
        return item

    def remove(self, request_id: str) -> Queued | None:
        return self._items.pop(request_id, None)

    def in_order(self, now: float) -> list[Queued]:
        """Every queued request, first to start first, as of ``now``."""
        for item in self._items.values():
            aged = item.decision.priority - item.aging_per_s * (now - item.queued_at)
            item.order = self.order(item.tenant, aged, item.deadline_at, item.queued_at) \
                + (item.seq,)
        return sorted(self._items.values())

    def position(self, request_id: str) -> int:
        """Its place in the order as last read (0: next), or -1 if it is not queued."""
        item = self._items.get(request_id)
        return -1 if item is None else sorted(self._items.values()).index(item)

    def expired(self, now: float) -> list[Queued]:
        """Remove and return (in arrival order) the requests whose deadline has come."""
        gone = [q for q in self._items.values() if now >= q.deadline_at]
        for item in gone:
            del self._items[item.request_id]
        return gone

    def count(self, tenant: str) -> int:
        return sum(q.tenant == tenant for q in self._items.values())

    def depth(self) -> Counter[str]:
        """Queued requests by service class."""
        return Counter(q.decision.service_class for q in self._items.values())
