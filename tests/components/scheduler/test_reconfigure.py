"""A live config change in the scheduler (``SchedulerCore.reconfigure``): fairness,
urgency preemption, the tenants' rules and the speculation limits change for the next
step; the tenants' counters and buckets carry over by name."""
from __future__ import annotations

from components.scheduler.core import SchedulerCore
from schemas.config import KvConfig, SchedulerConfig, SpeculativeConfig, TenantConfig


def test_policy_fields_swap_and_tenant_state_carries_by_name():
    boot = SchedulerConfig(max_num_seqs=4, fairness="vtc", urgency_preemption=True)
    core = SchedulerCore(boot, KvConfig(num_blocks=64), 512, tenants=(
        TenantConfig("a", token_rate=100.0, token_burst=400.0, kv_blocks=8),
        TenantConfig("b", weight=2.0)), speculative=SpeculativeConfig(max_k=4))
    core.tenants.charge("a", 1_000_000_000, input_tokens=100)
    core.tenants.charge("b", 1_000_000_000, input_tokens=100)
    level = core.tenants.buckets["a"].level
    new = SchedulerConfig(max_num_seqs=4, fairness="fcfs", urgency_preemption=False)
    core.reconfigure(new, (TenantConfig("a", token_rate=10.0, token_burst=50.0),
                           TenantConfig("b", weight=4.0, max_running=1),
                           TenantConfig("c", token_rate=5.0)),
                     SpeculativeConfig(max_k=1, control="fixed"))
    t = core.tenants
    assert core.cfg is new and core.planner.cfg is new and core.preemptor.cfg is new
    assert (t.fair, core.preemptor.urgency) == (False, False)
    assert (t.vtc.of("a"), t.vtc.of("b")) == (100.0, 50.0)            # counters carried
    assert t.vtc.weights == {"a": 1.0, "b": 4.0, "c": 1.0}
    a = t.buckets["a"]
    assert (a.rate, a.burst, a.level) == (10.0, 50.0, min(level, 50.0))
    assert (t.buckets["c"].rate, t.buckets["c"].level) == (5.0, 5.0)   # a new tenant's bucket
    assert (t.kv_budget, t.max_running) == ({}, {"b": 1})
    assert (core.spec.cfg.max_k, core.spec.cfg.control, core.spec.on) == (1, "fixed", True)
    core.reconfigure(new, (), SpeculativeConfig(max_k=0))
    assert core.spec.on is False and core.tenants.buckets == {}
