"""The ``deadline`` policy's decision (see ``policy.py``'s docstring for the table): for a
new request, accept, degrade, queue or reject from its estimate, its tenant's budgets, the
capacity now and the queue ahead of it; for a queued one, whether it may start now and
with which ``max_tokens``. Reads the ledger (through :class:`Capacity`), the queue and the
token buckets; changes only the buckets' refill. Clock injected.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from components.admission.capacity import Capacity, TenantBuckets
from components.admission.decision import (
    Blocker,
    Decision,
    Estimate,
    Grant,
    Kind,
    first_token_bound_ms,
    headroom_pct,
    reject,
)
from components.admission.queue import AdmissionQueue, Queued
from components.tenancy.retry import DrainRate
from schemas.config import ServiceClass, TenantConfig, WeirConfig
from schemas.wire import Tokenized


class DeadlineRule:
    def __init__(self, config: WeirConfig, capacity: Capacity, queue: AdmissionQueue,
                 buckets: TenantBuckets, releases: DrainRate,
                 tenants: Mapping[str, TenantConfig],
                 classes: Mapping[str, ServiceClass]) -> None:
        self.config = config
        self.capacity = capacity
        self.queue = queue
        self.buckets = buckets
        self.releases = releases           # the retry-after a rejection suggests
        self.tenants = tenants
        self.classes = classes

    def decide(self, req: Tokenized, tenant: TenantConfig, cls: ServiceClass, now: float,
               grant: Grant) -> Decision:
        """The decision for a valid new request of ``tenant`` granted ``cls`` (and the
        rest of ``grant``: its priority, max_tokens and estimate)."""
        cap, est, seqs = self.capacity, grant.estimate, req.params.n
        if tenant.kv_blocks and est.kv_blocks > tenant.kv_blocks:
            if not (cls.may_degrade and cap.tokens_within_blocks(seqs, est, tenant.kv_blocks,
                                                                 cls)):
                return reject(req, "tenant_kv_budget",
                              f"needs {est.kv_blocks} KV blocks; the tenant's budget is "
                              f"{tenant.kv_blocks}", grant=grant)
        bucket = self.buckets.of(tenant, now)
        cost = est.uncached_tokens + seqs * est.expected_output
        if bucket is not None and bucket.refill(now) < cost:
            fit = cap.tokens_within_budget(seqs, est, bucket.level, cls)
            if fit is None:
                return reject(req, "tenant_token_budget",
                              f"needs {cost} tokens; the tenant's bucket holds "
                              f"{int(bucket.level)} (rate {tenant.token_rate:g}/s)",
                              bucket.wait_s(cost, now), grant)
            return self.degrade(req, cls, fit, grant, "tenant_token_budget", now)
        headroom = 1.0 - self.config.admission.ttft_headroom
        bound = first_token_bound_ms(est)
        if bound is not None and est.predicted_ttft_s is not None \
                and est.predicted_ttft_s * 1e3 > bound * headroom:
            which = "deadline" if bound == est.deadline_ms else "end-to-end deadline"
            return reject(req, "deadline_unmeetable",
                          f"predicted TTFT {est.predicted_ttft_s * 1e3:.0f} ms; {which} "
                          f"{bound:.0f} ms less {headroom_pct(headroom)} headroom",
                          est.predicted_ttft_s - bound / 1e3, grant)
        blocker = cap.blocker(tenant, est, seqs, cls.name)
        if blocker is None and self.behind_queue(req.tenant, grant.priority, est, now):
            blocker = Blocker.QUEUE
        if blocker is None:
            return grant.decision(Kind.ACCEPT, "fits")
        if cls.may_degrade and blocker.kv_bound:
            fit = cap.tokens_within_blocks(seqs, est, cap.room(tenant), cls)
            if fit is not None:
                degraded = self.degrade(req, cls, fit, grant, "kv_pressure"
                                        if blocker == Blocker.KV_PRESSURE else "kv_capacity",
                                        now)
                if degraded.kind == Kind.DEGRADE:
                    return degraded
        if cls.max_queue_ms <= 0:
            why = cap.why(blocker, est, cls.name, seqs)
            return reject(req, blocker.rejected_as, f"no capacity now ({why}) and class "
                          f"{cls.name!r} does not queue", self.releases.retry_after(1, now),
                          grant)
        if len(self.queue) >= self.config.admission.max_queued or \
                self.queue.count(req.tenant) >= tenant.max_queued:
            return reject(req, "queue_full", "admission's queue is full",
                          self.releases.retry_after(len(self.queue) + 1, now), grant)
        return grant.decision(Kind.QUEUE, f"waiting_for_{blocker}")

    def degrade(self, req: Tokenized, cls: ServiceClass, max_tokens: int, grant: Grant,
                why: str, now: float) -> Decision:
        """``req`` started with ``max_tokens`` (reason ``why``) if that fits now, else
        rejected ``overloaded``."""
        degraded = self.capacity.degraded(grant.estimate, max_tokens, req.params.n)
        if self.capacity.blocker(self.tenants[req.tenant], degraded, req.params.n,
                                 cls.name) is not None:
            return reject(req, "overloaded", "no capacity even degraded",
                          self.releases.retry_after(1, now), grant)
        return Decision(Kind.DEGRADE, why, cls.name, grant.priority, max_tokens, degraded)

    def behind_queue(self, tenant: str, priority: int, est: Estimate, now: float) -> bool:
        """Is a queued request that waits for the engine's capacity ahead of this one (which
        fits now)? Requests held by their own tenant's caps, and their tenant's later ones,
        are passed over, as the queue's release passes them."""
        if not self.queue:
            return False
        deadline_at = now + est.deadline_ms / 1e3 if est.deadline_ms is not None else math.inf
        capped: set[str] = set()
        for item in self.queue.ahead_of(tenant, priority, deadline_at, now):
            if item.tenant in capped:
                continue
            blocker = self.capacity.blocker(self.tenants[item.tenant], item.decision.estimate,
                                            item.req.params.n, item.decision.service_class)
            if blocker is not None and blocker.tenants_own:
                capped.add(item.tenant)
            elif blocker is not None:
                return True
        return False

    def fits_now(self, item: Queued, now: float) -> tuple[Decision | None, Blocker | None]:
        """The decision a queued request starts with now (degraded if its class may and
        only that fits), or None and what holds it."""
        queued, est = item.decision, item.decision.estimate
        tenant, n = self.tenants[item.tenant], item.req.params.n
        decision = Decision(Kind.ACCEPT, "released", queued.service_class, queued.priority,
                            queued.max_tokens, est)
        blocker = self.capacity.blocker(tenant, est, n, queued.service_class)
        if blocker is None:
            return decision, None
        # a class that may degrade starts with a lower max_tokens once that fits
        cls = self.classes[queued.service_class]
        if not (cls.may_degrade and blocker.kv_bound):
            return None, blocker
        fit = self.capacity.tokens_within_blocks(n, est, self.capacity.room(tenant), cls)
        if fit is None:
            return None, blocker
        decision = self.degrade(item.req, cls, fit, Grant(queued.service_class,
                                queued.priority, queued.max_tokens, est), "released", now)
        return (decision, None) if decision.kind == Kind.DEGRADE else (None, blocker)
