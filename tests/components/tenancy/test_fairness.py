"""VTC: counters charge weighted service, lift on re-backlog, and order new work."""
from __future__ import annotations

from components.scheduler.core import SchedulerCore
from components.tenancy.fairness import VirtualCounters
from schemas.config import KvConfig, SchedulerConfig
from schemas.wire import Admitted, SamplingParams
from tests import messages as msgs


def test_charge_weights_and_lift():
    v = VirtualCounters({"a": 2.0})
    v.charge("a", input_tokens=100, output_tokens=10)      # (100 + 20) / 2
    v.charge("b", input_tokens=30)
    assert (v.of("a"), v.of("b")) == (60.0, 30.0)
    v.backlogged("c", ["a", "b"])                          # idle time earns no credit
    assert v.of("c") == 30.0
    v.backlogged("a", ["b", "c"])                          # never lowered
    assert v.of("a") == 60.0
    v.backlogged("d", [])
    assert v.of("d") == 0.0


def admitted(rid: str, tenant: str, prompt: int = 16, max_tokens: int = 4) -> Admitted:
    return msgs.admitted(rid, tenant, list(range(1000, 1000 + prompt)), [],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0, ())




def test_new_work_starts_in_counter_order():
    # b arrives after a's four, lifted to a's counter (0); then a is served: b goes first
    core = SchedulerCore(SchedulerConfig(max_num_seqs=2), KvConfig(), 512)
    for i in range(4):
        core.add(admitted(f"a{i}", "a"))
    core.add(admitted("b0", "b"))                          # lifted to a's counter (0)
    core.vtc.charge("a", input_tokens=64)                  # a is then served
    core.queues.fair_order(0)
    assert [s.request_id for s in core.waiting] == ["b0", "a0", "a1", "a2", "a3"]


def test_fcfs_keeps_arrival_order():
    core = SchedulerCore(SchedulerConfig(max_num_seqs=2, fairness="fcfs"), KvConfig(), 512)
    for rid, tenant in [("a0", "a"), ("a1", "a"), ("b0", "b")]:
        core.add(admitted(rid, tenant))
    core.vtc.charge("a", input_tokens=64)
    assert not core.fair
    assert [s.request_id for s in core.waiting] == ["a0", "a1", "b0"]


def test_scheduling_charges_input_and_output():
    core = SchedulerCore(SchedulerConfig(), KvConfig(), 512)
    core.add(admitted("r", "t", prompt=20, max_tokens=3))
    from schemas.wire import KvGrant
    core.schedule()
    ops = core.take_kv_ops()
    core.on_grants([KvGrant(core.epoch, ops.allocs[0].seq_id, True, [0, 1], 0)])
    plan = core.schedule()
    assert core.vtc.of("t") == 20.0                        # 20 prompt tokens x 1
    from schemas.wire import StepResult
    core.on_result(StepResult(plan.step_id, [plan.steps[0].seq_id], [7], 0))
    assert core.vtc.of("t") == 22.0                        # + 1 output token x 2
