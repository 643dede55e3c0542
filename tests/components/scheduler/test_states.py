"""The sequence state machine (sequence.py), transition by transition, and the core's
tenant budgets, running caps, victim choice and urgency preemption, with exact inputs."""
from __future__ import annotations

import itertools

import pytest

from components.costs.cost_model import StepShape
from components.kv_manager.ops import apply_ops
from components.kv_manager.pool import BlockPool
from components.model.hashing import block_hashes
from components.scheduler.core import SchedulerCore
from components.scheduler.sequence import TRANSITIONS, Event, IllegalTransition, Seq, State
from schemas.config import KvConfig, SchedulerConfig, TenantConfig
from schemas.wire import Admitted, FreeRequest, KvGrant, SamplingParams, StepResult, SwapOutRequest
from tests import messages as msgs

BS = 8
_clock = itertools.count(1000)


def seq_in(state: State) -> Seq:
    return Seq(1, msgs.header("r", "t", SamplingParams(), 0), 3, [1, 2, 3], [], frozenset(),
               state=state)


# ---------------------------------------------------------------- the table

@pytest.mark.parametrize("state, event, after", [
    (state, event, after) for state, moves in TRANSITIONS.items()
    for event, after in moves.items()])
def test_each_transition_in_the_table(state, event, after):
    seq = seq_in(state)
    assert seq.to(event) is after and seq.state is after


@pytest.mark.parametrize("state, event", [
    (state, event) for state in State for event in Event if event not in TRANSITIONS[state]])
def test_every_other_move_is_refused(state, event):
    seq = seq_in(state)
    with pytest.raises(IllegalTransition):
        seq.to(event)
    assert seq.state is state


def test_the_table_keeps_its_invariants():
    from components.scheduler import sequence as sq
    # a finish always ends it; only an answer in flight makes it CLOSING first
    for state, moves in TRANSITIONS.items():
        if state not in sq.ENDED:
            assert moves[Event.FINISH] is (State.CLOSING if state in sq.AWAITING else State.DONE)
    # every state but DONE can be left, and every state can be reached
    reached = {after for moves in TRANSITIONS.values() for after in moves.values()}
    assert reached | {State.WAITING, State.FORKING} == set(State)
    assert all(TRANSITIONS[s] for s in State if s is not State.DONE)


# ---------------------------------------------------------------- a small cluster

class Kv:
    def __init__(self, num_blocks: int, budgets: dict[str, int] | None = None,
                 num_cpu_blocks: int = 0) -> None:
        self.pool = BlockPool(num_blocks, BS, True, num_cpu_blocks, tenant_blocks=budgets)

    def settle(self, core: SchedulerCore) -> None:
        while (ops := core.take_kv_ops()) is not None:
            core.on_grants(apply_ops(self.pool, ops), self.pool.num_cpu_free)


def make(tenants=(), max_num_seqs=8, num_blocks=64, **kv) -> SchedulerCore:
    return SchedulerCore(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                                         lookahead_tokens=1, fairness="fcfs"),
                         KvConfig(block_size=BS, num_blocks=num_blocks, grow_blocks=1, **kv),
                         512, epoch=1, tenants=tenants)


def req(rid: str, tenant: str, n_tokens: int, *, n=1, max_tokens=100, priority=0,
        deadline_ms=None, arrival_ns=None) -> Admitted:
    toks = list(range(hash(rid) % 1000, hash(rid) % 1000 + n_tokens))
    return msgs.admitted(rid, tenant, toks, block_hashes(toks, BS, tenant, "m"),
                    SamplingParams(max_tokens=max_tokens, n=n),
                    next(_clock) if arrival_ns is None else arrival_ns,
                    deadline_ms=deadline_ms, priority=priority)


def step(core: SchedulerCore, kv: Kv, now_ns: int = 0):
    """Plan, settle KV, run the plan (every sampling row gets token 7)."""
    plan = core.schedule(now_ns)
    kv.settle(core)
    if plan is None:
        return None
    ids = [s.seq_id for s in plan.steps if s.sample for _ in range(s.num_samples)]
    core.on_result(StepResult(plan.step_id, ids, [7] * len(ids), 1), now_ns)
    kv.settle(core)
    return plan


# ---------------------------------------------------------------- budgets

def test_tenant_at_its_kv_budget_is_refused_while_others_proceed():
    core = make(tenants=(TenantConfig("a", kv_blocks=4), TenantConfig("b")))
    kv = Kv(64, {"a": 4})
    core.add(req("a1", "a", 24))           # 4 blocks: a's whole budget
    core.add(req("a2", "a", 24))           # refused: a is at its budget
    core.add(req("b1", "b", 24))           # behind a2 in the queue, not held up by it
    step(core, kv)
    plan = step(core, kv)
    a2 = core.by_request["a2"]
    assert a2.state is State.REFUSED and a2.refusal == "tenant_kv_budget"
    assert {core.by_seq[s.seq_id].request_id for s in plan.steps} == {"a1", "b1"}
    assert kv.pool.tenant_blocks("a") == 4 and kv.pool.tenant_blocks("b") == 4
    # a1 cannot grow past the budget either: it is preempted from its own tenant (no one
    # else is), b1 keeps running
    for _ in range(10):
        step(core, kv)
    assert kv.pool.tenant_blocks("a") <= 4
    assert core.preemption_reasons["tenant_kv_budget"] >= 1
    assert all(p.request_id.startswith("a") for p in core.last_preempted)
    assert core.by_request["b1"].state in (State.RUNNING, State.GROWING)
    assert core.by_request["b1"].preemptions == 0


def test_budget_refusal_is_retried_when_its_tenant_frees():
    core = make(tenants=(TenantConfig("a", kv_blocks=4),))
    kv = Kv(64, {"a": 4})
    core.add(req("a1", "a", 24, max_tokens=1))
    core.add(req("a2", "a", 24, max_tokens=1))
    step(core, kv)
    step(core, kv)                          # a1 runs and finishes; its lease is freed
    assert "a1" not in core.by_request
    a2 = core.by_request["a2"]
    assert a2.state is State.REFUSED
    assert core.schedule() is None and a2.state is State.LEASING   # asked again: a freed
    kv.settle(core)
    assert a2.state is State.READY
    assert step(core, kv) is not None and "a2" not in core.by_request


def test_running_cap_counts_n_and_lets_other_tenants_pass():
    core = make(tenants=(TenantConfig("a", max_running=3), TenantConfig("b")))
    kv = Kv(64)
    core.add(req("a1", "a", 8, n=2))        # counts 2
    core.add(req("a2", "a", 8, n=2))        # 2 + 2 > 3: waits
    core.add(req("b1", "b", 8))
    step(core, kv)
    plan = step(core, kv)
    assert {core.by_seq[s.seq_id].request_id for s in plan.steps} == {"a1", "b1"}
    assert core.running_slots() == {"a": 2, "b": 1}
    assert core.by_request["a2"].state is State.WAITING      # not even leased: it cannot run
    for _ in range(4):                      # a1 forks into 2 sequences: still 2 slots
        step(core, kv)
        assert core.running_slots()["a"] <= 3


def test_a_request_wider_than_the_cap_still_runs_alone():
    core = make(tenants=(TenantConfig("a", max_running=1),))
    kv = Kv(64)
    core.add(req("a1", "a", 8, n=2, max_tokens=2))
    for _ in range(6):
        step(core, kv)
    assert not core.has_work


def test_victim_is_a_tenant_over_its_budget_before_priority():
    core = make(tenants=(TenantConfig("a", kv_blocks=2), TenantConfig("b")))
    seqs = []
    for rid, tenant, prio, blocks in (("a1", "a", 0, 3), ("b1", "b", 1, 1), ("b2", "b", 1, 1)):
        s = core.add(req(rid, tenant, 8, priority=prio))
        core.waiting.remove(s)
        s.state, s.block_ids = State.RUNNING, list(range(blocks))
        core.running.append(s)
        seqs.append(s)
    # a holds 3 > its budget of 2: its sequence goes first although b's are less important
    assert max(core.running, key=core.victim_key()) is seqs[0]
    seqs[0].block_ids = [0]
    assert max(core.running, key=core.victim_key()) is seqs[2]   # then priority, then latest


def test_victim_over_its_weighted_share_before_arrival():
    core = make(tenants=(TenantConfig("a"), TenantConfig("b")), num_blocks=8)
    early_hog, late_small = core.add(req("a1", "a", 8)), core.add(req("b1", "b", 8))
    for s, blocks in ((early_hog, 6), (late_small, 1)):
        core.waiting.remove(s)
        s.state, s.block_ids = State.RUNNING, list(range(blocks))
        core.running.append(s)
    # a holds 6 of 8 blocks, over its half: preempted although it arrived first
    assert max(core.running, key=core.victim_key()) is early_hog


# ---------------------------------------------------------------- rare transitions

def prefilled_with_a_host_tier():
    """One request leased and prefilled, on a core that swaps to a 4-block host tier."""
    core = make(num_cpu_blocks=4, preemption_mode="swap")
    core.on_executor(1, 1e9)
    kv = Kv(64, num_cpu_blocks=4)
    core.add(req("a", "t", 20))
    step(core, kv)                          # leased
    step(core, kv)                          # prefilled
    return core, kv, core.by_request["a"]


def test_swap_out_refused_by_the_pool_recomputes():
    core, kv, a = prefilled_with_a_host_tier()
    old_id, computed = a.seq_id, a.num_computed
    core.preemptor.preempt(a)               # the core believes the host tier has room ...
    assert a.state is State.SWAPPING_OUT
    ops = core.take_kv_ops()
    assert ops.swap_outs == [SwapOutRequest(old_id, a.num_computed)]
    core.on_grants([KvGrant(1, old_id, False, [], 0, "swap_out", reason="pool_full")])
    assert a.state is State.WAITING and a.seq_id != old_id     # ... it had not: recompute
    assert core.take_kv_ops().frees == [FreeRequest(old_id, computed)]


def test_cancel_after_refused_swap_in_frees_the_host_lease():
    core, kv, a = prefilled_with_a_host_tier()
    core.preemptor.preempt(a)
    kv.settle(core)
    assert a.state is State.SWAPPED
    core.schedule()
    core.take_kv_ops()
    core.on_grants([KvGrant(1, a.seq_id, False, [], 0, "swap_in", reason="pool_full")])
    assert a.state is State.SWAP_REFUSED
    out = core.cancel("a")
    assert out.released == ["a"] and a.state is State.DONE
    assert core.take_kv_ops().frees == [FreeRequest(a.seq_id, a.num_computed)]


# ---------------------------------------------------------------- urgency

def urgent_setup(deadline_ms: float, victim_tokens: int):
    """Two slots held by batch-class sequences (priority 1) that have far to go; an
    interactive request (priority 0) arrives with a TTFT deadline and no slot."""
    core = make(max_num_seqs=2)
    kv = Kv(256)
    core.prices.recompute_s = lambda tokens: tokens * 1e-3  # 1 ms a token
    for tokens, ctx, seqs in itertools.product((2, 16, 64), (100, 1000), (1, 2)):
        # the cost model learns: 4 ms + 1 ms a token + 10 us a context token + 1 ms a seq
        core.cost.observe(StepShape(tokens, ctx, seqs, tokens * ctx),
                          0.004 + 1e-3 * tokens + 1e-5 * ctx + 1e-3 * seqs)
    core.add(req("b1", "batch", victim_tokens, priority=1, max_tokens=500, arrival_ns=0))
    core.add(req("b2", "batch", victim_tokens, priority=1, max_tokens=500, arrival_ns=1))
    for _ in range(20):
        step(core, kv, now_ns=1_000_000)
        if len(core.running) == 2 and all(s.remaining == 1 for s in core.running):
            break
    now = 2_000_000_000
    core.add(req("u", "inter", 16, priority=0, deadline_ms=deadline_ms, arrival_ns=now))
    return core, kv, now


def test_urgent_request_preempts_a_lower_class_when_it_pays():
    core, kv, now = urgent_setup(deadline_ms=500, victim_tokens=40)
    plan = step(core, kv, now_ns=now + 1_000_000)
    [d] = core.last_urgency
    assert d.request_id == "u" and d.victim == "b2" and d.preempted
    assert d.reason == "cost_below_loss"
    assert d.intervention_s == pytest.approx(0.040)       # b2 computed its 40 prompt tokens
    # waiting for a slot: ~500 more decode steps, then its prefill: far past its 500 ms
    assert d.lateness_avoided_s > 1.0 > d.intervention_s
    assert [p.reason for p in core.last_preempted] == ["urgency"]
    assert core.waiting[0].request_id == "u"
    step(core, kv, now_ns=now + 2_000_000)
    assert core.by_request["u"].state in (State.RUNNING, State.GROWING)
    assert core.by_request["u"].first_scheduled_ns == now + 2_000_000
    assert plan is not None


def test_urgency_declined_when_redoing_the_victim_costs_more():
    core, kv, now = urgent_setup(deadline_ms=500, victim_tokens=400)
    core.prices.recompute_s = lambda tokens: tokens * 0.1   # 100 ms a token: 40 s to redo
    step(core, kv, now_ns=now + 1_000_000)
    [d] = core.last_urgency
    assert not d.preempted and d.reason == "cost_above_loss"
    assert d.intervention_s > d.lateness_avoided_s
    assert core.preemptions == 0 and core.by_request["u"].state is State.WAITING


def test_urgency_declined_when_the_deadline_is_lost_anyway():
    core, kv, now = urgent_setup(deadline_ms=500, victim_tokens=40)
    step(core, kv, now_ns=now + 600_000_000)              # already 100 ms past the deadline
    [d] = core.last_urgency
    assert not d.preempted and d.reason == "too_late_anyway"
    assert core.preemptions == 0


def test_no_urgency_for_the_same_class_or_without_a_deadline():
    core, kv, now = urgent_setup(deadline_ms=None, victim_tokens=40)
    step(core, kv, now_ns=now + 1_000_000)
    assert core.last_urgency == [] and core.preemptions == 0


# ---------------------------------------------------------------- token rate

@pytest.mark.parametrize("fairness", ["fcfs", "vtc"])
def test_a_tenant_past_its_token_rate_starts_new_work_after_the_others(fairness):
    core = SchedulerCore(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64,
                                         lookahead_tokens=1, fairness=fairness),
                         KvConfig(block_size=BS, num_blocks=64, grow_blocks=1), 512, epoch=1,
                         tenants=(TenantConfig("a", token_rate=10.0, token_burst=20.0),
                                  TenantConfig("b", weight=0.01)))   # VTC alone would pick a
    kv = Kv(64)
    second = 1_000_000_000
    core.add(req("a1", "a", 40, max_tokens=1, arrival_ns=0))   # 41 tokens: 21 past the burst
    step(core, kv, now_ns=second)
    step(core, kv, now_ns=second)
    assert "a1" not in core.by_request and core.over_rate("a", 1.0)
    core.add(req("a2", "a", 8, max_tokens=1, arrival_ns=2))
    core.add(req("b1", "b", 8, max_tokens=1, arrival_ns=3))
    step(core, kv, now_ns=second)
    step(core, kv, now_ns=second)              # one slot: b1 goes first, and finishes
    assert "b1" not in core.by_request and "a2" in core.by_request
    # work-conserving: with only a's work left, it runs though still past its rate
    step(core, kv, now_ns=second)
    step(core, kv, now_ns=second)
    assert core.over_rate("a", 1.0) and "a2" not in core.by_request
    # and the bucket refills: 3 s later a is within its rate again
    assert not core.over_rate("a", 4.0)


def test_within_a_tenant_class_then_deadline_then_arrival():
    core = SchedulerCore(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                         lookahead_tokens=1), KvConfig(block_size=BS,
                                                                      num_blocks=64), 512,
                         epoch=1, tenants=(TenantConfig("a"),))
    core.add(req("late-batch", "a", 8, priority=1, arrival_ns=1))
    core.add(req("no-deadline", "a", 8, priority=0, arrival_ns=2))
    core.add(req("due-later", "a", 8, priority=0, deadline_ms=900, arrival_ns=3))
    core.add(req("due-soon", "a", 8, priority=0, deadline_ms=100, arrival_ns=4))
    core.queues.fair_order(0)
    assert [s.request_id for s in core.waiting] == ["due-soon", "due-later", "no-deadline",
                                                   "late-batch"]
