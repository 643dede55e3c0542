"""Tenant budgets that hold across the fleet: the router's own token rate and outstanding
cap per tenant, enforced before a request is placed on any replica. Pure: no sockets, no
clock of its own (the service passes ``now``, monotonic seconds).

Behind N replicas each replica's admission enforces a tenant's ``token_rate`` and
``max_outstanding`` on what reaches it, so the tenant gets N times its budget. The router
sees all of a tenant's work, so it enforces the fleet's budget (``router.tenants``) and the
replicas' own budgets (``admission.tenants``) stay as a per-replica backstop.

- **Outstanding cap.** A request counts from its placement (its first routing decision)
  to its terminal event from a replica, or the router's ending it (a replica lost). A
  reroute moves it, it does not count it twice. At the cap a new request is refused
  ``tenant_over_budget`` with a retry-after from the tenant's recent drain rate, as a
  replica's admission refuses it.
- **Token rate.** A token bucket per tenant (``components.tenancy.bucket``), charged at
  placement with the request's most: prompt tokens + ``n`` x ``max_tokens`` (the room
  left in the context if it has none), then corrected at its terminal with what it used:
  a ``Finished`` gives back the estimate less its usage (prompt + completion tokens), a
  refusal from the replica gives back all of it, a failure or cancel keeps the charge
  (the router does not know what it used). A request is refused ``tenant_token_budget``
  with the bucket's wait as retry-after while the bucket holds less than its estimate (an
  estimate past the burst waits for a full bucket, and leaves it in debt).
- **Rebuilt, not persisted.** A restarted router knows nothing of the requests the last
  one placed, but the replicas still run them (until they see their client gone). Each
  replica's load report says what its admission holds per tenant (``ledger.outstanding.
  <tenant>`` admitted, ``queued.<tenant>`` queued); what a report counts beyond the
  requests this router placed on that replica before the report was asked is work it did
  not place (``reported``), and counts against the tenant's cap until a later report no
  longer shows it. So the caps hold across a restart with no state of the router's own on
  disk, and state lives where the work is.
- **Buckets rebuilt too.** Each replica's admission also reports the tokens each tenant
  used there over trailing windows of 1 to 64 s (``used_tokens.<w>s.<tenant>``: prompts
  at admission, outputs at release; ``components.tenancy.window``). A tenant's bucket is
  made at its first request through this router, when this router has placed none of its
  work, so what the replicas report then is what came before (the last router's): the
  bucket starts at the level those windows bound (``rebuilt_level``), not full. What the
  requests open across the restart generate after it is not charged (their prompts are):
  at most the tenant's outstanding cap times their outputs. Rebuilt rather than persisted
  for the same reason as the caps: nothing on the router's disk, which a rescheduled pod
  does not keep, and nothing to go stale while the router is down.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from components.tenancy.bucket import TokenBucket
from components.tenancy.retry import DrainRate
from components.tenancy.window import rebuilt_level
from schemas.client import StatusReport
from schemas.config import TenantConfig

OUTSTANDING = "ledger.outstanding."          # a replica admission's per-tenant stats
QUEUED = "queued."
USED = "used_tokens."                        # used_tokens.<window>s.<tenant>
# a replica's admission lets a request go a moment after its terminal reached the router
# (the scheduler's release crosses the bus): a request ended this recently before a report
# was asked may still be counted in it, and is taken as this router's own
RELEASE_LAG_S = 1.0


class Refusal(NamedTuple):
    reason: str
    message: str
    retry_after_s: float


@dataclass
class Placed:
    tenant: str
    replica: str
    charged: int
    placed_at: float
    ended_at: float = 0.0


def estimate(prompt_tokens: int, max_tokens: int | None, n: int, max_model_len: int) -> int:
    """The most a request can use: its prompt and ``n`` times its output cap (the room the
    context leaves it without one)."""
    room = max(max_model_len - prompt_tokens, 1)
    out = room if max_tokens is None else min(max_tokens, room)
    return prompt_tokens + max(n, 1) * out


def reported_outstanding(report: StatusReport | None) -> Counter[str]:
    """Requests per tenant a replica's admission holds by its load report (admitted and
    queued)."""
    out: Counter[str] = Counter()
    for key, v in admission_stats(report):
        if key.startswith(OUTSTANDING):
            out[key[len(OUTSTANDING):]] += int(v)
        elif key.startswith(QUEUED):
            out[key[len(QUEUED):]] += int(v)
    return out


def admission_stats(report: StatusReport | None) -> Iterator[tuple[str, float]]:
    """The stats of the admission components in a replica's load report (none: no report)."""
    for c in report.components if report is not None else ():
        if c.name == "admission":
            yield from c.stats.items()


def reported_used(report: StatusReport | None) -> dict[str, dict[int, float]]:
    """Tokens per tenant a replica's admission says were used there over each trailing
    window (tenant -> window seconds -> tokens)."""
    out: dict[str, dict[int, float]] = {}
    for key, v in admission_stats(report):
        if key.startswith(USED):
            window, _, tenant = key[len(USED):].partition(".")
            if window.endswith("s") and window[:-1].isdigit() and tenant:
                out.setdefault(tenant, {})[int(window[:-1])] = v
    return out


class FleetBudgets:
    """Per tenant named in ``tenants``: its bucket, the requests this router placed, and
    those the replicas report beyond them. A tenant not named is not governed here."""

    def __init__(self, tenants: Iterable[TenantConfig]) -> None:
        self.tenants: dict[str, TenantConfig] = {t.name: t for t in tenants}
        self.buckets: dict[str, TokenBucket] = {}
        self.placed: dict[str, Placed] = {}
        self.recent: list[Placed] = []                 # ended within RELEASE_LAG_S, in order
        self.own: Counter[str] = Counter()
        self.unplaced: dict[str, Counter[str]] = {}    # replica -> tenant -> not ours
        self.drains: dict[str, DrainRate] = {}
        self.used: dict[str, dict[str, dict[int, float]]] = {}   # replica -> reported_used
        self.rebuilt: dict[str, float] = {}    # tenant -> the level its bucket started at
        self.refusals: Counter[str] = Counter()
        self.refunded = 0

    def retune(self, tenants: Iterable[TenantConfig], now: float) -> None:
        """New budgets (a live config change), carried over by tenant name: what each
        tenant holds is counted against its new cap; its bucket keeps its level (refilled
        to ``now`` at the old rate, cut to a smaller new burst) and refills at the new
        rate; a tenant with no rate now has no bucket, and one no longer named is no
        longer governed (its requests in flight end as they would)."""
        self.tenants = {t.name: t for t in tenants}
        for name, b in list(self.buckets.items()):
            t = self.tenants.get(name)
            if t is None or t.token_rate <= 0:
                del self.buckets[name]
                continue
            b.refill(now)
            b.rate, b.burst = t.token_rate, t.token_burst or t.token_rate
            b.level = min(b.level, b.burst)

    def governs(self, tenant: str) -> bool:
        return tenant in self.tenants

    def outstanding(self, tenant: str) -> int:
        """``tenant``'s requests on the fleet: placed by this router and not ended, and
        those replicas report that it did not place."""
        return self.own[tenant] + sum(u[tenant] for u in self.unplaced.values())

    def bucket(self, tenant: str, now: float) -> TokenBucket | None:
        t = self.tenants[tenant]
        if t.token_rate <= 0:
            return None
        b = self.buckets.get(tenant)
        if b is None:
            b = self.buckets[tenant] = TokenBucket(t.token_rate, t.token_burst, now)
            seen: Counter[int] = Counter()
            for used in self.used.values():
                seen.update(used.get(tenant, {}))
            if seen:
                b.level = self.rebuilt[tenant] = rebuilt_level(b.rate, b.burst, dict(seen))
        return b

    # ------------------------------------------------------------------ decisions
    def check(self, tenant: str, cost: int, now: float,
              unreported: bool = False) -> Refusal | None:
        """Why a new request of ``tenant`` estimated at ``cost`` tokens cannot be placed
        now (None: it can). Charges nothing (``place`` does). ``unreported``: a replica
        that is up has not sent its first load report, so what it holds is unknown (the
        moments after the router starts): a governed tenant waits for it."""
        if tenant not in self.tenants:
            return None
        if unreported:
            self.refusals["unreported"] += 1
            return Refusal("overloaded", "the router is rebuilding its fleet budgets from "
                           "the replicas' reports", 0.5)
        t = self.tenants[tenant]
        held = self.outstanding(tenant)
        if held >= t.max_outstanding:
            self.refusals["tenant_over_budget"] += 1
            drain = self.drains.setdefault(tenant, DrainRate())
            return Refusal("tenant_over_budget",
                           f"tenant holds {held} requests across the fleet, its cap is "
                           f"{t.max_outstanding}",
                           drain.retry_after(held - t.max_outstanding + 1, now))
        b = self.bucket(tenant, now)
        if b is not None:
            need = min(cost, b.burst)
            if b.refill(now) < need:
                self.refusals["tenant_token_budget"] += 1
                return Refusal("tenant_token_budget",
                               f"needs {cost} tokens; the tenant's fleet bucket holds "
                               f"{int(b.level)} (rate {t.token_rate:g}/s)",
                               round(b.wait_s(need, now), 3))
        return None

    def place(self, request_id: str, tenant: str, replica: str, cost: int,
              now: float) -> None:
        """A request of ``tenant`` is placed on ``replica``: counted, and charged ``cost``."""
        if tenant not in self.tenants or request_id in self.placed:
            return
        b = self.bucket(tenant, now)
        if b is not None:
            b.take(cost, now)
        self.placed[request_id] = Placed(tenant, replica, cost if b is not None else 0, now)
        self.own[tenant] += 1

    def moved(self, request_id: str, replica: str) -> None:
        """A placed request rerouted to ``replica``: it still counts once."""
        p = self.placed.get(request_id)
        if p is not None:
            p.replica = replica

    def ended(self, request_id: str, used: int | None, now: float) -> None:
        """A placed request's terminal: uncounted, and its charge corrected to ``used``
        tokens (None: unknown, the charge is kept)."""
        p = self.placed.pop(request_id, None)
        if p is None:
            return
        p.ended_at = now
        self.recent.append(p)
        self.own[p.tenant] -= 1
        if not self.own[p.tenant]:
            del self.own[p.tenant]
        self.drains.setdefault(p.tenant, DrainRate()).ended(now)
        b = self.buckets.get(p.tenant)
        if b is not None and used is not None and used < p.charged:
            b.refill(now)
            b.level = min(b.level + p.charged - used, b.burst)
            self.refunded += p.charged - used

    # ------------------------------------------------------------------ reports
    def reported(self, replica: str, held: Mapping[str, int], asked: float,
                 used: dict[str, dict[int, float]] | None = None) -> None:
        """``replica``'s load report, answering a query sent at ``asked``, says its
        admission holds ``held`` requests per tenant: what it counts beyond the requests
        this router had placed there before then, open then or ended less than
        ``RELEASE_LAG_S`` before, is work this router did not place (the last router's,
        before a restart) and counts against the tenant's cap. ``used``: the tokens each
        tenant used there recently (``reported_used``), what a bucket made later starts
        from."""
        if used is not None:
            self.used[replica] = used
        self.recent = [p for p in self.recent if p.ended_at > asked - RELEASE_LAG_S]
        ours: Counter[str] = Counter(
            p.tenant for p in (*self.placed.values(), *self.recent)
            if p.replica == replica and p.placed_at <= asked
            and (not p.ended_at or p.ended_at > asked - RELEASE_LAG_S))
        extra = Counter({t: n - ours[t] for t, n in held.items()
                         if t in self.tenants and n > ours[t]})
        if extra:
            self.unplaced[replica] = extra
        else:
            self.unplaced.pop(replica, None)

    def lost(self, replica: str) -> None:
        """``replica`` is out (or let go): what it reported is gone with it."""
        self.unplaced.pop(replica, None)
        self.used.pop(replica, None)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {f"budget.refused.{k}": v for k, v in self.refusals.items()}
        out["budget.refunded_tokens"] = self.refunded
        for t in self.tenants:
            if (held := self.outstanding(t)) or t in self.buckets:
                out[f"budget.outstanding.{t}"] = held
                out[f"budget.placed.{t}"] = self.own[t]
                out[f"budget.unplaced.{t}"] = held - self.own[t]
            if (b := self.buckets.get(t)) is not None:
                out[f"budget.tokens.{t}"] = round(b.level, 1)
            if t in self.rebuilt:
                out[f"budget.rebuilt_tokens.{t}"] = round(self.rebuilt[t], 1)
        return out
