"""What a request's reservation may take now: the ledger's room (the pool less the watermark
and what admitted requests reserve), the live pool's (``live.py``), its tenant's caps and
budgets, and the decode horizon; what holds a request that does not fit (a
:class:`~components.admission.decision.Blocker`), and the largest ``max_tokens`` that would
fit instead (degrade). Reads the ledger and the live engine; changes neither.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from components.admission.decision import Blocker, Estimate
from components.admission.ledger import Ledger
from components.admission.live import Horizon, LiveEngine
from components.tenancy.bucket import TokenBucket
from schemas.config import ServiceClass, TenantConfig, WeirConfig


class Capacity:
    def __init__(self, config: WeirConfig, ledger: Ledger, live: LiveEngine) -> None:
        self.config = config
        self.ledger = ledger
        self.live = live
        self.checks_horizon = config.admission.policy == "deadline"
        kv = config.kv
        self.block_size = kv.block_size
        self.kv_capacity = kv.num_blocks - kv.watermark_blocks   # what reservations share

    def blocks(self, uncached: int, output: int, n: int) -> int:
        """The KV reservation of a request: its uncached prompt, and ``n`` sequences of
        ``output`` tokens grown by ``admission.kv_safety``."""
        grow = output * (1 + self.config.admission.kv_safety)
        return math.ceil((uncached + n * grow) / self.block_size)

    def horizon(self, cls: str, n: int, context: int) -> Horizon | None:
        """The decode horizon of ``n`` more sequences of ``cls`` (``LiveEngine.horizon``);
        checked under the deadline policy only."""
        if not self.checks_horizon:
            return None
        return self.live.horizon(cls, n, context, self.ledger.class_seqs)

    def room(self, tenant: TenantConfig) -> int:
        """The blocks a new reservation of ``tenant`` may take now."""
        reserved = self.ledger.reserved_blocks
        room = self.kv_capacity - reserved
        live = self.live.kv_room(reserved)
        if live is not None:
            room = min(room, live)
        if tenant.kv_blocks:
            room = min(room, tenant.kv_blocks - self.ledger.tenant_blocks(tenant.name))
        return room

    def blocker(self, tenant: TenantConfig, est: Estimate, seqs: int,
                cls: str) -> Blocker | None:
        """What keeps a request of ``tenant`` and class ``cls`` with estimate ``est`` and
        ``seqs`` sequences from starting now, or None. The decode horizon (``TPOT``) comes
        before the KV checks: a lower max_tokens does not shorten a step."""
        ledger, name, blocks = self.ledger, tenant.name, est.kv_blocks
        if len(ledger) >= self.config.admission.max_outstanding:
            return Blocker.ENGINE_CAP
        if ledger.tenant_requests(name) >= tenant.max_outstanding:
            return Blocker.TENANT_CAP
        if tenant.max_running and ledger.tenant_seqs(name) + seqs > tenant.max_running:
            return Blocker.TENANT_RUNNING
        if tenant.kv_blocks and ledger.tenant_blocks(name) + blocks > tenant.kv_blocks:
            return Blocker.TENANT_KV
        horizon = self.horizon(cls, seqs, est.decode_context)
        if horizon is not None and horizon.at_risk:
            return Blocker.TPOT
        if ledger.reserved_blocks + blocks > self.kv_capacity:
            return Blocker.KV
        live = self.live.kv_room(ledger.reserved_blocks)
        if live is not None and blocks > live:
            return Blocker.KV_PRESSURE
        return None

    def why(self, blocker: Blocker, est: Estimate, cls: str, seqs: int) -> str:
        """What holds a request, for its rejection's message."""
        if blocker == Blocker.KV_PRESSURE:
            return (f"it needs {est.kv_blocks} KV blocks; the pool has "
                    f"{self.live.load.kv_free_blocks} free, "
                    f"{self.live.kv_room(self.ledger.reserved_blocks)} of them neither owed "
                    f"to admitted requests nor the watermark")
        horizon = self.horizon(cls, seqs, est.decode_context) \
            if blocker == Blocker.TPOT else None
        return horizon.why(self.live.load) if horizon is not None else blocker

    # ------------------------------------------------------------------ degrade
    def tokens_within_blocks(self, n: int, est: Estimate, blocks: int,
                             cls: ServiceClass) -> int | None:
        """The largest max_tokens whose reservation fits ``blocks``, below the expected
        output and at least the class's ``min_max_tokens``; None if there is none."""
        per = n * (1 + self.config.admission.kv_safety)
        fit = int((blocks * self.block_size - est.uncached_tokens) / per) if per else 0
        fit = min(fit, est.expected_output - 1)
        return fit if fit >= cls.min_max_tokens else None

    @staticmethod
    def tokens_within_budget(n: int, est: Estimate, level: float,
                             cls: ServiceClass) -> int | None:
        """The largest max_tokens whose cost (prompt and ``n`` outputs) fits a token bucket
        holding ``level``, below the expected output and at least the class's
        ``min_max_tokens``; None if there is none or the class may not degrade."""
        if not cls.may_degrade:
            return None
        fit = int((level - est.uncached_tokens) / n)
        fit = min(fit, est.expected_output - 1)
        return fit if fit >= cls.min_max_tokens else None

    def degraded(self, est: Estimate, max_tokens: int, n: int) -> Estimate:
        """``est`` as it is with ``max_tokens`` expected: its reservation and decode
        context shrunk to it."""
        return replace(est, expected_output=max_tokens,
                       kv_blocks=self.blocks(est.uncached_tokens, max_tokens, n),
                       decode_context=est.decode_context - est.expected_output // 2
                       + max_tokens // 2)


class TenantBuckets:
    """Each tenant's token bucket (``token_rate`` tokens a second up to ``token_burst``),
    made on its first use; a tenant with no rate has none."""

    def __init__(self) -> None:
        self._buckets: dict[str, TokenBucket] = {}

    def of(self, tenant: TenantConfig, now: float) -> TokenBucket | None:
        if tenant.token_rate <= 0:
            return None
        if tenant.name not in self._buckets:
            self._buckets[tenant.name] = TokenBucket(tenant.token_rate, tenant.token_burst, now)
        return self._buckets[tenant.name]

    def retune(self, tenants: Mapping[str, TenantConfig]) -> None:
        """New rates and bursts, each bucket's level kept (cut to its new burst); the
        bucket of a tenant with no rate now, or no longer configured, is dropped."""
        for name, bucket in list(self._buckets.items()):
            t = tenants.get(name)
            if t is None or t.token_rate <= 0:
                del self._buckets[name]
                continue
            bucket.rate = t.token_rate
            bucket.burst = t.token_burst if t.token_burst > 0 else t.token_rate
            bucket.level = min(bucket.level, bucket.burst)

    def get(self, name: str) -> TokenBucket | None:
        """The bucket of tenant ``name`` if it has been made (no bucket is made here)."""
        return self._buckets.get(name)

