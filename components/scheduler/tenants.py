"""The tenants' rules as the scheduler applies them: each tenant's virtual token counter
(VTC, fairness.py), its token bucket, its KV budget and its running-sequence cap.

The counters and buckets are charged with the tokens the engine really computes (a
request's uncached prompt when it starts) and samples; the queues' fair order reads them,
and the lease book and planning read the caps. Owns no sequence."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from components.scheduler.sequence import Seq
from components.tenancy.bucket import TokenBucket
from components.tenancy.fairness import VirtualCounters
from schemas.config import SchedulerConfig, TenantConfig


class Tenants:
    def __init__(self, cfg: SchedulerConfig, tenants: Sequence[TenantConfig] = (),
                 weights: dict[str, float] | None = None) -> None:
        limits = {t.name: t for t in tenants}
        self.kv_budget = {name: t.kv_blocks for name, t in limits.items() if t.kv_blocks}
        self.max_running = {name: t.max_running for name, t in limits.items() if t.max_running}
        # the tenant's token rate, as admission's bucket, charged with the tokens the engine
        # really computes and samples: a tenant past it starts new work after the others
        self.buckets = {name: TokenBucket(t.token_rate, t.token_burst, 0.0)
                        for name, t in limits.items() if t.token_rate}
        if weights is None:
            weights = {name: t.weight for name, t in limits.items()}
        self.vtc = VirtualCounters(weights)
        self.fair = cfg.fairness == "vtc"

    def retune(self, cfg: SchedulerConfig, tenants: Sequence[TenantConfig]) -> None:
        """A live config change's tenants and fairness: budgets, caps, rates and weights
        by tenant name; each counter and each bucket's level carried over (a bucket is cut
        to its new burst; a tenant with no rate now has none)."""
        limits = {t.name: t for t in tenants}
        self.kv_budget = {name: t.kv_blocks for name, t in limits.items() if t.kv_blocks}
        self.max_running = {name: t.max_running for name, t in limits.items() if t.max_running}
        old, self.buckets = self.buckets, {}
        for name, t in limits.items():
            if not t.token_rate:
                continue
            bucket = old.get(name) or TokenBucket(t.token_rate, t.token_burst, 0.0)
            bucket.rate = t.token_rate
            bucket.burst = t.token_burst if t.token_burst > 0 else t.token_rate
            bucket.level = min(bucket.level, bucket.burst)
            self.buckets[name] = bucket
        self.vtc.weights = {name: t.weight for name, t in limits.items()}
        self.fair = cfg.fairness == "vtc"

    def over_rate(self, tenant: str, now_s: float) -> bool:
        """Has ``tenant`` used more than its token bucket holds?"""
        bucket = self.buckets.get(tenant)
        return bucket is not None and bucket.refill(now_s) < 0

    def charge(self, tenant: str, now_ns: int, input_tokens: int = 0,
               output_tokens: int = 0) -> None:
        self.vtc.charge(tenant, input_tokens=input_tokens, output_tokens=output_tokens)
        if (bucket := self.buckets.get(tenant)) is not None:
            bucket.take(input_tokens + output_tokens, now_ns / 1e9)

    def at_running_cap(self, seq: Seq, claimed: Counter[str]) -> bool:
        """Would starting ``seq`` take its tenant past its running-sequence cap? A tenant
        with nothing running may always start one request (n > cap would never run)."""
        cap = self.max_running.get(seq.tenant)
        if not cap:
            return False
        return claimed[seq.tenant] > 0 and claimed[seq.tenant] + seq.slots > cap
