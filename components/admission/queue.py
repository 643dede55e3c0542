"""Admission's queue: the requests that could not start when they arrived, in the order
they may start, the scheduler's order (``components.scheduler.queues.Queues.fair_order``):
class first across tenants, then within a class the least served tenant (the tenants'
virtual counters, the scheduler's VTC); within a tenant, class, then deadline, then
arrival. A class is its priority aged as the scheduler ages it: less a whole unit per
``1 / aging_per_s`` seconds queued, so batch work that has waited long enough ranks with,
then ahead of, new interactive work and cannot starve, while two tenants' requests of one
class stay in VTC order however long each has waited.

The order is picked one request at a time, as the scheduler picks: the tenant whose head
ranks first by (class, counter, arrival), each pick charging its tenant what admitting it
charges (its prompt and expected output), so one tenant does not take every place because
it was least served when the order was read. The policy decides what leaves the queue and
when; this holds the order. Pure, clock injected."""
from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass

from components.admission.decision import Decision
from components.tenancy.fairness import VirtualCounters
from schemas.wire import Tokenized

# Its place within its tenant: (class level, deadline, queued at, arrival number).
_Key = tuple[float, float, float, float]


@dataclass
class Queued:
    request_id: str
    req: Tokenized
    decision: Decision                # the policy's decision (kind QUEUE)
    queued_at: float
    deadline_at: float                # when it expires
    aging_per_s: float                # its class's priority gain per second
    seq: int
    charge: tuple[int, int] = (0, 0)  # (input, output) tokens admitting it charges its tenant
    rank: int = 0                     # its place in the order as last read (``position``)

    @property
    def tenant(self) -> str:
        return self.req.tenant

    def level(self, now: float) -> int:
        """The class it ranks with at ``now``: its priority less the whole units its
        class's aging has earned since it was queued (``Seq.aged_priority``'s rule)."""
        waited = now - self.queued_at
        if not self.aging_per_s or waited <= 0:
            return self.decision.priority
        return self.decision.priority - int(self.aging_per_s * waited)


class AdmissionQueue:
    """Short (``admission.max_queued``), so the order is made afresh whenever it is read:
    priorities age, and counters move as tenants are served."""

    def __init__(self, vtc: VirtualCounters) -> None:
        self.vtc = vtc
        self._items: dict[str, Queued] = {}           # by request id, in arrival order
        self._seq = itertools.count()
        self._ranks = itertools.count()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, req: Tokenized, decision: Decision, aging_per_s: float, now: float,
            deadline_at: float, charge: tuple[int, int] = (0, 0)) -> Queued:
        # queued here makes a tenant backlogged (admitted work alone does not)
        waiting = {q.tenant for q in self._items.values()}
        if req.tenant not in waiting:
            self.vtc.backlogged(req.tenant, waiting)
        item = Queued(req.request_id, req, decision, now, deadline_at, aging_per_s,
                      next(self._seq), charge, next(self._ranks))
        self._items[req.request_id] = item
        return item

    def remove(self, request_id: str) -> Queued | None:
        return self._items.pop(request_id, None)

    def in_order(self, now: float) -> list[Queued]:
        """Every queued request, first to start first, as of ``now``."""
        order = self._order(now)
        for item in order:
            item.rank = next(self._ranks)
        return order

    def ahead_of(self, tenant: str, priority: int, deadline_at: float,
                 now: float) -> list[Queued]:
        """The queued requests the order puts before a new request of ``tenant`` with
        ``priority`` and ``deadline_at``, arriving ``now`` (after any queued request it
        ties with)."""
        return self._order(now, (tenant, (priority, deadline_at, now, math.inf)))

    def _order(self, now: float, probe: tuple[str, _Key] | None = None) -> list[Queued]:
        """The order at ``now``; with ``probe`` (a tenant, and its key within the tenant),
        only what comes before it."""
        tenants: dict[str, list[tuple[_Key, Queued | None]]] = {}
        for item in self._items.values():
            key: _Key = (item.level(now), item.deadline_at, item.queued_at, item.seq)
            tenants.setdefault(item.tenant, []).append((key, item))
        if probe is not None:
            tenants.setdefault(probe[0], []).append((probe[1], None))
        heads = []
        for tenant, items in tenants.items():
            items.sort(key=lambda entry: entry[0])
            items.reverse()                           # popped from the end
            key = items[-1][0]
            heads.append((key[0], self.vtc.of(tenant), key[2], key[3], tenant))
        heapq.heapify(heads)
        order: list[Queued] = []
        while heads:
            _, counter, _, _, tenant = heapq.heappop(heads)
            items = tenants[tenant]
            _, head = items.pop()
            if head is None:
                return order                          # the probe's place
            order.append(head)
            if items:
                counter += (head.charge[0] * self.vtc.w_in + head.charge[1] * self.vtc.w_out
                            ) / self.vtc.weight(tenant)
                key = items[-1][0]
                heapq.heappush(heads, (key[0], counter, key[2], key[3], tenant))
        return order

    def position(self, request_id: str) -> int:
        """Its place in the order as last read (0: next; one queued since comes after the
        rest), or -1 if it is not queued."""
        item = self._items.get(request_id)
        if item is None:
            return -1
        return sum(q.rank < item.rank for q in self._items.values())

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

    def tenant_depth(self) -> Counter[str]:
        """Queued requests by tenant."""
        return Counter(q.tenant for q in self._items.values())
