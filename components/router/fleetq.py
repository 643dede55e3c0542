"""The fleet queue: fairness between tenants across the whole fleet, at the router. Pure: no
sockets, no clock of its own (the service passes ``now``, monotonic seconds).

Each replica's scheduler orders new work by virtual token counters (VTC,
``components.tenancy.fairness``), but it orders only what reaches it: when every replica is
full, whatever arrives first is placed first (or refused first), so a flooding tenant takes
the whole fleet's admission and a light tenant's request waits behind it or is refused.
So the router holds what the fleet cannot take now and lets it go in VTC order:

- **When a request is held.** A fresh request (not a reroute, not a migration) is held
  when the queue already holds any (none passes those waiting), or when no eligible
  replica can take it now: every one is *overloaded* by the routing core's own signal (its
  predicted TTFT past the request's deadline, or its pool past ``kv_high``;
  ``scoring.rank``). With no eligible replica at all it is refused as before.
- **The order.** The tenant with the least weighted service goes first (its counter;
  ties by its head's arrival), and within a tenant, arrival. A tenant that becomes
  backlogged is lifted to the smallest counter of those backlogged (to the last
  released tenant's counter when none is): idle time earns no credit. Weights are
  ``router.tenants``' ``weight`` (1 for a tenant not named).
- **Charged by what the replicas report.** A request placed on a replica (held or not)
  is charged its prompt at once (``w_in`` per token, over its weight) and set right at
  its terminal by its usage: a ``Finished`` charges prompt and completion tokens
  (``w_out`` per output token), a refusal from a replica nothing, a failure or cancel
  keeps the prompt's charge (what it used is not known).
- **Released as capacity returns.** After each load report, first token, terminal and
  tick the service releases heads while the head's best replica is not overloaded; it
  stops at the first that would be (the routing core's queue estimate grows with each
  prompt it sends, so the release stops itself). Each request that ends on a replica
  while some are held also releases one, overloaded or not: the fleet keeps running as
  much as it ran when it filled, whatever the prediction says.
- **The least served pass** (``passes``). A fresh request whose tenant has none held and
  is the least served of the tenants with work in flight or held goes on to a replica at
  once, full or not: it would be released first anyway, and the replica's own admission
  and VTC start it ahead of a flood, so holding it only added the wait for the next
  release (measured in docs/perf-log.md, 2026-12-05: a light tenant's TTFT p50 rose
  30-70 ms when every request of a full fleet was held). So what the queue holds is the
  over-served tenants' work, and it is on by default (``router.fleet_queue``).
- **Bounded.** At most ``max_held`` in all and a tenant's ``max_queued`` (``router.
  tenants``; 64 for a tenant not named): past either, ``queue_full`` with a retry-after
  from the queue's recent release rate.
- **Deadline-aware.** A request held until ``deadline_at`` (its TTFT deadline, its
  end-to-end deadline, or ``router.fleet_queue_max_wait_s``, the first of them) is
  refused ``deadline_unmeetable`` at once when the requests ahead of it (its own
  tenant's, and each less served tenant's) would not be released before then at the
  recent release rate, and, held, as soon as its deadline would pass before the next
  release could place it (``expiring``): refused with a retry-after, not held to time
  out.
- **Ends once.** Cancel, a client gone, or a refusal takes it out (``remove``); a request
  leaves the queue exactly once, by ``release``, ``remove`` or ``expiring``.
- **Restart: level.** The counters are the router's own and start level (all 0) when it
  restarts. VTC's promise holds over a backlogged period, and the lift already forgets
  what a tenant received before it was backlogged, so a restart forgets at most the
  difference between the tenants backlogged at that moment; rebuilding it from the
  replicas' counters would sum counters that each replica lifted on its own.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

from components.router.budgets import Refusal
from components.tenancy.fairness import VirtualCounters
from components.tenancy.retry import DrainRate
from schemas.config import TenantConfig

MAX_QUEUED_DEFAULT = TenantConfig("_").max_queued     # a tenant not named: 64
WAITS_KEPT = 4096


@dataclass
class Held:
    request_id: str
    tenant: str
    serial: int                         # arrival order
    held_at: float
    deadline_at: float
    prompt_tokens: int


class FleetQueue:
    """Held requests per tenant, released least-served tenant first."""

    def __init__(self, tenants: Iterable[TenantConfig], max_held: int,
                 w_in: float = 1.0, w_out: float = 2.0) -> None:
        named = list(tenants)
        self.limits = {t.name: t.max_queued for t in named}
        self.vtc = VirtualCounters({t.name: t.weight for t in named}, w_in, w_out)
        self.max_held = max_held
        self.queues: dict[str, deque[Held]] = {}
        self.held: dict[str, Held] = {}
        self.charged: dict[str, tuple[str, float]] = {}   # placed request -> (tenant, charge)
        self.floor = 0.0                # the last released tenant's counter
        self.serial = 0
        self.releases = DrainRate(window_s=10.0)
        self.waits: deque[float] = deque(maxlen=WAITS_KEPT)
        self.counts: Counter[str] = Counter()

    def retune(self, tenants: Iterable[TenantConfig], max_held: int) -> None:
        """New weights and bounds (a live config change), carried over by tenant name:
        what is held stays held (a smaller bound refuses new requests until the queue is
        under it), each counter keeps its value and is charged at the new weight from now
        on."""
        named = list(tenants)
        self.limits = {t.name: t.max_queued for t in named}
        self.vtc.weights = {t.name: t.weight for t in named}
        self.max_held = max_held

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.held

    def depth(self, tenant: str) -> int:
        q = self.queues.get(tenant)
        return len(q) if q else 0

    def limit(self, tenant: str) -> int:
        return self.limits.get(tenant, MAX_QUEUED_DEFAULT)

    # ------------------------------------------------------------------ holding
    def ahead(self, tenant: str) -> int:
        """Requests that would be released before a new one of ``tenant``: its own
        tenant's, and all of each tenant backlogged at a smaller counter."""
        mine = max(self.vtc.of(tenant), self._lift_to(tenant))
        return sum(len(q) for t, q in self.queues.items()
                   if t == tenant or self.vtc.of(t) < mine)

    def wait_s(self, ahead: int, now: float) -> float | None:
        """The wait behind ``ahead`` held requests at the recent release rate (None: too
        few releases to tell)."""
        rate = self.releases.rate(now)
        return None if rate is None else ahead / rate

    def offer(self, request_id: str, tenant: str, prompt_tokens: int, now: float,
              deadline_at: float) -> Refusal | None:
        """Hold a request of ``tenant`` until ``deadline_at``; or why not (it is not held)."""
        if len(self.held) >= self.max_held or self.depth(tenant) >= self.limit(tenant):
            self.counts["refused.queue_full"] += 1
            full = "the fleet queue" if len(self.held) >= self.max_held else "the tenant's share"
            return Refusal("queue_full", f"{full} of the fleet queue is full "
                           f"({len(self.held)} held)",
                           self.releases.retry_after(self.ahead(tenant) + 1, now))
        ahead = self.ahead(tenant)
        wait = self.wait_s(ahead, now)
        if wait is not None and now + wait > deadline_at:
            self.counts["refused.deadline"] += 1
            return Refusal("deadline_unmeetable",
                           f"{ahead} requests are held ahead of it in the fleet queue "
                           f"(about {wait:.2f} s); its deadline is in "
                           f"{max(deadline_at - now, 0.0):.2f} s",
                           round(max(wait, 0.1), 3))
        if not self.depth(tenant):
            self.vtc.counters[tenant] = max(self.vtc.of(tenant), self._lift_to(tenant))
        self.serial += 1
        h = Held(request_id, tenant, self.serial, now, deadline_at, prompt_tokens)
        self.queues.setdefault(tenant, deque()).append(h)
        self.held[request_id] = h
        self.counts["held"] += 1
        return None

    def passes(self, tenant: str) -> bool:
        """Whether a fresh request of ``tenant`` goes on to a replica even while the fleet
        is full or others are held: none of its tenant's is held, and its tenant is the
        least served of those with work in flight or held (a tenant with none is first
        lifted to the least of theirs, as a newly backlogged one is). It would be released
        first anyway, and the replica's own admission and VTC start it ahead of a flood,
        so holding it would only add the wait for the next release. Alone, a tenant always
        passes: the queue is for fairness between tenants."""
        if self.depth(tenant):
            return False
        active = {t for t, _ in self.charged.values()} | {t for t, q in self.queues.items() if q}
        others = [self.vtc.of(t) for t in active if t != tenant]
        if not others:
            self.counts["passed"] += 1
            return True
        if tenant not in active:
            self.vtc.counters[tenant] = max(self.vtc.of(tenant), min(others))
        if self.vtc.of(tenant) <= min(others):
            self.counts["passed"] += 1
            return True
        return False

    def _lift_to(self, tenant: str) -> float:
        """The counter a newly backlogged ``tenant`` is lifted to: the smallest of the
        tenants backlogged now, or the last released tenant's when none is."""
        return min((self.vtc.of(t) for t, q in self.queues.items() if q and t != tenant),
                   default=self.floor)

    # ------------------------------------------------------------------ leaving
    def head(self) -> Held | None:
        """The request to release next: the least-served backlogged tenant's first."""
        best = min((q for q in self.queues.values() if q),
                   key=lambda q: (self.vtc.of(q[0].tenant), q[0].serial), default=None)
        return best[0] if best is not None else None

    def release(self, request_id: str, now: float) -> Held:
        """``request_id`` (held) goes to a replica now: out of the queue and charged."""
        h = self._take(request_id)
        self.releases.ended(now)
        self.waits.append(now - h.held_at)
        self.counts["released"] += 1
        self.placed(request_id, h.tenant, h.prompt_tokens)
        self.floor = self.vtc.of(h.tenant)
        return h

    def remove(self, request_id: str) -> Held | None:
        """A held request ended before its release (cancelled, its client gone)."""
        if request_id not in self.held:
            return None
        self.counts["removed"] += 1
        return self._take(request_id)

    def expiring(self, now: float, margin_s: float, prefill_rate: float) -> list[Held]:
        """Held requests whose deadline passes before the next release could place them
        and their prompt be computed (``margin_s``, then ``prompt_tokens`` at
        ``prefill_rate`` tokens/s): out of the queue, to be refused."""
        out = [h for h in self.held.values()
               if h.deadline_at <= now + margin_s + h.prompt_tokens / prefill_rate]
        for h in out:
            self._take(h.request_id)
            self.counts["refused.expiring"] += 1
        return out

    def _take(self, request_id: str) -> Held:
        h = self.held.pop(request_id)
        q = self.queues[h.tenant]
        q.remove(h)
        if not q:
            del self.queues[h.tenant]
        return h

    # ------------------------------------------------------------------ service
    def placed(self, request_id: str, tenant: str, prompt_tokens: int) -> None:
        """A request is placed on a replica (released, or placed without being held):
        charged its prompt until its terminal says what it used."""
        if request_id in self.charged:
            return
        before = self.vtc.of(tenant)
        self.vtc.charge(tenant, input_tokens=prompt_tokens)
        self.charged[request_id] = (tenant, self.vtc.of(tenant) - before)

    def ended(self, request_id: str, usage: tuple[int, int] | None) -> None:
        """A placed request's terminal, with what it used (prompt, completion tokens; None:
        not known, the prompt's charge stays; (0, 0): never ran, nothing charged)."""
        placed = self.charged.pop(request_id, None)
        if placed is None or usage is None:
            return
        tenant, charge = placed
        self.vtc.counters[tenant] = max(self.vtc.of(tenant) - charge, 0.0)
        self.vtc.charge(tenant, usage[0], usage[1])

    def stats(self, now: float) -> dict[str, float]:
        waits = sorted(self.waits)

        def pct(p: float) -> float:
            return waits[min(int(p * len(waits)), len(waits) - 1)] if waits else 0.0

        out: dict[str, float] = {f"fleetq.{k}": v for k, v in self.counts.items()}
        out["fleetq.depth"] = len(self.held)
        out["fleetq.wait_ms.p50"] = round(pct(0.5) * 1e3, 3)
        out["fleetq.wait_ms.p99"] = round(pct(0.99) * 1e3, 3)
        oldest = min((h.held_at for h in self.held.values()), default=now)
        out["fleetq.oldest_ms"] = round((now - oldest) * 1e3, 3)
        for t in set(self.queues) | set(self.vtc.counters):
            out[f"fleetq.depth.{t}"] = self.depth(t)
            out[f"fleetq.counter.{t}"] = round(self.vtc.of(t), 1)
        return out
