"""Counters the scheduler reports in its heartbeat: batch-size distribution, active KV
tokens, and per-tenant token and KV use (tenants are configured, so labels stay bounded)."""
from __future__ import annotations

from collections import Counter

from components.scheduler.core import SchedulerCore
from schemas.wire import StepPlan, TenantUsage

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class UsageStats:
    def __init__(self) -> None:
        self.batch_buckets = Counter()
        self.batch_sum = 0
        self.batch_count = 0
        self.tenant_processed: Counter[str] = Counter()
        self.tenant_generated: Counter[str] = Counter()

    def planned(self, core: SchedulerCore, plan: StepPlan) -> None:
        size = len(plan.steps)
        self.batch_sum += size
        self.batch_count += 1
        for le in BATCH_BUCKETS:
            if size <= le:
                self.batch_buckets[le] += 1
        for st in plan.steps:
            self.tenant_processed[core.by_seq[st.seq_id].tenant] += st.num_tokens

    def sampled(self, core: SchedulerCore, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            if (seq := core.by_seq.get(sid)) is not None:
                self.tenant_generated[seq.tenant] += 1

    def stats(self, core: SchedulerCore) -> dict[str, float]:
        out: dict[str, float] = {
            "active_kv_tokens": sum(s.num_computed for s in core.running),
            "batch_size.sum": self.batch_sum, "batch_size.count": self.batch_count}
        out.update({f"batch_size.le.{le}": self.batch_buckets[le] for le in BATCH_BUCKETS})
        return out

    def tenants(self, core: SchedulerCore) -> dict[str, TenantUsage]:
        kv_blocks: Counter[str] = Counter()
        for seq in core.by_seq.values():
            kv_blocks[seq.tenant] += len(seq.block_ids)
        running = core.running_slots()
        return {t: TenantUsage(self.tenant_processed[t], self.tenant_generated[t], kv_blocks[t],
                               round(core.vtc.of(t), 1), running[t])
                for t in set(self.tenant_processed) | set(kv_blocks) | set(core.vtc.counters)}
