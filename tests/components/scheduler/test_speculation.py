"""Speculation as the scheduler's decision (speculation.py): k per decode row per step from
the step-cost model, the acceptance, the budget, TPOT and priority, with exact step times;
then through ``SchedulerCore``: draft_k in the plan, a verify's tokens in order, a stop
among them, max_tokens and the model's length capping k, a cancel with a verify in flight,
and blocks never short for the drafts. The randomized whole-loop test
(test_whole_loop.py) draws speculation on too."""
from __future__ import annotations

import itertools
import random

import msgspec
import pytest

from components.costs.cost_model import StepCostModel, StepShape, row_pairs
from components.kv_manager.ops import apply_ops
from components.kv_manager.pool import BlockPool
from components.model.hashing import block_hashes
from components.scheduler.core import SchedulerCore
from components.scheduler.sequence import Seq
from components.scheduler.speculation import EXPLORE_AFTER, PRIOR_WEIGHT, Speculation
from schemas.config import KvConfig, SchedulerConfig, SpeculativeConfig
from schemas.wire import (
    Admitted,
    FreeRequest,
    KvOps,
    RequestTiming,
    SamplingParams,
    SeqStep,
    StepPlan,
    StepResult,
    TokenOut,
    Usage,
)
from tests import messages as msgs

BS = 8
EPOCH = 1
MS = 1e-3
# a CPU's step: a large fixed cost (the weights read once per step), a small one per token
CPU = [12 * MS, 0.12 * MS, 1e-8, 0.0, 1e-8]
# a compute-bound step: a token's marginal cost near the step's time per token
BOUND = [12 * MS, 2 * MS, 1e-8, 0.0, 1e-8]
_clock = itertools.count(1000)


def cost(coef=CPU) -> StepCostModel:
    return StepCostModel(prior=coef)


def spec(**kw) -> Speculation:
    kw.setdefault("method", "ngram")
    kw.setdefault("acceptance_prior", 0.8)
    return Speculation(SpeculativeConfig(**kw))


def seq(i: int, ctx: int = 100, cls: str | None = None, priority: int = 0,
        tpot_ms: float | None = None, speculate: bool = True) -> Seq:
    h = msgs.header(f"r{i}", "t", SamplingParams(), 0, granted_class=cls, priority=priority,
                    tpot_slo_ms=tpot_ms)
    if not speculate:
        h = msgspec.structs.replace(h, speculate=False)
    return Seq(i, h, ctx, list(range(ctx)), [], frozenset())


def decodes(seqs: list[Seq], ctx: int = 100, room: int = 16):
    """Rows of plain decodes at context ``ctx`` and the step's shape without drafts."""
    n = len(seqs)
    return ([(s, ctx, room) for s in seqs],
            StepShape(n, n * (ctx + 1), n, n * row_pairs(1, ctx)))


def predicted(coef, tokens, context, seqs, pairs) -> float:
    return coef[0] + coef[1] * tokens + coef[2] * pairs + coef[3] * seqs + coef[4] * context


# ---------------------------------------------------------------- choose()

def test_batch_of_one_on_a_cpu_drafts_max_k():
    sp = spec(max_k=4)
    rows, shape = decodes([seq(1)])
    c = sp.choose(rows, shape, cost(), budget=100)
    assert c.k == {1: 4} and c.acceptance == {1: pytest.approx(0.8)}
    # 12 + 0.12 + (101 pairs + 101 context) * 1e-5 ms; with 4 drafts: 5 tokens, 105
    # positions read, 5 * 100 + 15 pairs
    assert c.base_s == pytest.approx(12.12202 * MS, abs=1e-9)
    assert c.with_drafts_s == pytest.approx(12.6062 * MS, abs=1e-9)
    assert c.with_drafts_s == pytest.approx(predicted(CPU, 5, 105, 1, 515))
    assert c.expected_tokens == pytest.approx(1 + 0.8 + 0.8 ** 2 + 0.8 ** 3 + 0.8 ** 4)
    assert c.budget_left == 100 and c.reason == ""
    assert sp.stats.k_hist == {4: 1} and not sp.stats.reasons


def test_a_compute_bound_batch_of_64_drafts_nothing():
    sp = spec(max_k=4)
    seqs = [seq(i) for i in range(64)]
    rows, shape = decodes(seqs)
    c = sp.choose(rows, shape, cost(BOUND), budget=1000)
    # 12 + 64 * 2 + 64 * 202 * 1e-5 ms: a token's share 2.19 ms, a draft's price 2.0 ms
    # while it is worth 0.8 of a token: 0.8 * 140.13 <= 64 * 2.0
    assert c.base_s == pytest.approx(140.12928 * MS, abs=1e-9)
    assert c.k == {} and c.reason == "no_gain"
    assert c.with_drafts_s == c.base_s
    assert sp.stats.k_hist == {0: 64} and sp.stats.reasons == {"no_gain": 1}
    assert all(s.spec_idle == 1 for s in seqs)


def test_on_a_cpu_a_batch_of_64_still_drafts_but_less_than_max_k():
    """What the rule says for the CPU step: at 64 rows the fixed cost still dominates, so a
    draft pays, up to 2 per row (a third's 0.8^3 of a token is worth less than its price)."""
    c = spec(max_k=4).choose(*decodes([seq(i) for i in range(64)]), cost(), budget=1000)
    assert set(c.k.values()) == {2} and len(c.k) == 64 and c.reason == "no_gain"
    assert c.base_s == pytest.approx(19.80928 * MS, abs=1e-9)


def test_no_budget_no_drafts():
    c = spec().choose(*decodes([seq(1)]), cost(), budget=0)
    assert c.k == {} and c.reason == "budget"


def test_the_budget_left_caps_the_drafts():
    c = spec(max_k=4).choose(*decodes([seq(1)]), cost(), budget=2)
    assert c.k == {1: 2} and c.budget_left == 2
    assert c.reason == ""                     # (a reason says why no row, or no more, drafts)


def test_the_tightest_tpot_is_never_passed():
    rows, shape = decodes([seq(1, tpot_ms=12.3)])
    c = spec(max_k=4).choose(rows, shape, cost(), budget=100, tpot_cap_s=12.3 * MS)
    # one draft: 12.24305 ms; a second would make 12.36409 ms > 12.3
    assert c.k == {1: 1} and c.reason == "tpot"
    assert c.with_drafts_s == pytest.approx(12.24305 * MS, abs=1e-9)
    assert c.with_drafts_s <= 12.3 * MS
    c = spec(max_k=4).choose(rows, shape, cost(), budget=100, tpot_cap_s=12.2 * MS)
    assert c.k == {} and c.reason == "tpot"


def test_a_request_that_may_not_speculate_is_left_out():
    c = spec(max_k=4).choose(*decodes([seq(1, speculate=False), seq(2)]), cost(), budget=100)
    assert c.k == {2: 4} and 1 not in c.acceptance
    c = spec(max_k=4).choose(*decodes([seq(1, speculate=False)]), cost(), budget=100)
    assert c.k == {} and c.reason == "no_row"


def test_rows_without_room_are_left_out_and_room_caps_k():
    rows, shape = decodes([seq(1), seq(2)])
    rows = [(rows[0][0], 100, 0), (rows[1][0], 100, 2)]
    c = spec(max_k=4).choose(rows, shape, cost(), budget=100)
    assert c.k == {2: 2}


def test_fixed_control_drafts_max_k_for_every_row_whatever_the_cost():
    sp = spec(max_k=3, control="fixed")
    c = sp.choose(*decodes([seq(i) for i in range(64)]), cost(BOUND), budget=1000)
    assert c.k == {i: 3 for i in range(64)} and c.reason == ""
    # and without any cost model; the budget still caps it, row by row
    c = spec(max_k=3, control="fixed").choose(*decodes([seq(1), seq(2)]), StepCostModel(),
                                              budget=4)
    assert c.k == {1: 3, 2: 1}


def test_without_a_cost_model_nothing_is_drafted():
    assert StepCostModel().predict(StepShape(1, 101, 1, 101)) == 0.0
    c = spec().choose(*decodes([seq(1)]), StepCostModel(), budget=100)
    assert c.k == {} and c.reason == "no_cost_model"


def test_off_drafts_nothing():
    sp = Speculation(SpeculativeConfig(method="off"))
    assert not sp.on
    c = sp.choose(*decodes([seq(1)]), cost(), budget=100)
    assert c.k == {} and c.reason == "off"
    assert not Speculation(SpeculativeConfig(method="ngram", max_k=0)).on


def test_priority_weighs_the_rows():
    # the budget's 3 drafts: gains 0.8, 0.64, 0.512 for the interactive row against
    # 0.4, 0.32 for a priority-1 row (its tokens count half)
    rows, shape = decodes([seq(1), seq(2, priority=1)])
    assert spec(max_k=4).choose(rows, shape, cost(), budget=3).k == {1: 3}
    rows, shape = decodes([seq(1), seq(2)])
    assert spec(max_k=4).choose(rows, shape, cost(), budget=3).k == {1: 2, 2: 1}
    # where drafts stop paying, the less important row stops first
    rows, shape = decodes([seq(i, priority=3 * (i % 2)) for i in range(8)])
    c = spec(max_k=4).choose(rows, shape, cost(BOUND), budget=1000)
    assert {i % 2 for i in c.k} == {0} and c.reason == "no_gain"


def test_acceptance_priors_per_class_then_measured():
    sp = spec(acceptance_prior=0.5, class_priors={"batch": 0.2, "code": 0.9})
    assert sp.prior("batch") == 0.2 and sp.prior("code") == 0.9 and sp.prior("chat") == 0.5
    s = seq(1, cls="code")
    assert sp.acceptance(s) == 0.9
    sp.verified(s, 4, 2)                      # 2 accepted, then a rejection
    assert (s.spec_hits, s.spec_misses, s.spec_idle) == (2, 1, 0)
    # the class's rate: (2 + 4 * 0.9) / (3 + 4) = 0.8; the sequence's, on top of it
    assert sp.prior("code") == pytest.approx((2 + PRIOR_WEIGHT * 0.9) / (3 + PRIOR_WEIGHT))
    assert sp.acceptance(s) == pytest.approx((2 + PRIOR_WEIGHT * 0.8) / (3 + PRIOR_WEIGHT))
    # a new sequence of the class starts from the class's rate
    assert sp.acceptance(seq(2, cls="code")) == pytest.approx(sp.prior("code"))
    sp.verified(s, 3, 3)                      # all accepted: no rejection
    assert (s.spec_hits, s.spec_misses) == (5, 1)
    st = sp.stats
    assert st.drafted == {"code": 7} and st.accepted == {"code": 5}
    assert st.passes == 2 and st.emitted == 7


def test_a_row_that_stopped_drafting_is_given_a_draft_again_after_explore_after():
    # batch of 1, 2 ms fixed and 2 ms per token: a draft pays at a > 0.5 only
    coef = [2 * MS, 2 * MS, 0.0, 0.0, 0.0]
    sp = spec(max_k=1, acceptance_prior=0.8)
    s = seq(1)
    s.spec_misses = 10                        # a long run of rejections: (0 + 3.2) / 14
    assert sp.acceptance(s) == pytest.approx(3.2 / 14)
    rows, shape = decodes([s])
    for i in range(EXPLORE_AFTER):
        c = sp.choose(rows, shape, cost(coef), budget=10)
        assert c.k == {} and c.reason == "no_gain" and s.spec_idle == i + 1
    c = sp.choose(rows, shape, cost(coef), budget=10)
    assert c.k == {1: 1} and c.acceptance == {1: 0.8}
    sp.verified(s, 1, 1)                      # it explored, and its estimate starts again
    assert (s.spec_hits, s.spec_misses, s.spec_idle) == (1, 0, 0)


# ---------------------------------------------------------------- through the core

class Kv:
    def __init__(self, num_blocks: int = 64) -> None:
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks, BS, True)

    def settle(self, core: SchedulerCore) -> None:
        while (ops := core.take_kv_ops()) is not None:
            core.on_grants(apply_ops(self.pool, ops), self.pool.num_cpu_free)


def make(max_k=3, depth=1, coef=CPU, control="scheduler", max_model_len=256,
         num_blocks=64) -> SchedulerCore:
    core = SchedulerCore(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                         lookahead_tokens=1, async_depth=depth),
                         KvConfig(block_size=BS, num_blocks=num_blocks, grow_blocks=1),
                         max_model_len, epoch=EPOCH,
                         speculative=SpeculativeConfig(method="ngram", max_k=max_k,
                                                       control=control,
                                                       acceptance_prior=0.8))
    core.cost.set_prior(coef)
    return core


def admitted(rid: str, n: int, eos=(), **params) -> Admitted:
    params.setdefault("max_tokens", 100)
    toks = list(range(100, 100 + n))
    return msgs.admitted(rid, "t1", toks, block_hashes(toks, BS, "t1", "m"),
                         SamplingParams(**params), next(_clock), tuple(eos))


def verify(plan: StepPlan, tokens: dict[int, list[int]], accepted: dict[int, int]) -> StepResult:
    """The executor's answer: each sampling row's tokens in order (a speculating row's
    accepted drafts, then the target's own), and (seq id, drafted, accepted) per verify."""
    ids, toks, drafts = [], [], []
    for st in plan.steps:
        if st.sample:
            ids += [st.seq_id] * len(tokens[st.seq_id])
            toks += tokens[st.seq_id]
            if st.draft_k:
                drafts.append((st.seq_id, st.draft_k, accepted[st.seq_id]))
                assert len(tokens[st.seq_id]) == 1 + accepted[st.seq_id]
    return StepResult(plan.step_id, ids, toks, 1, drafts=drafts)


def prefilled(core: SchedulerCore, kv: Kv, *reqs: Admitted) -> StepPlan:
    """Admit, prefill (each prompt samples its first token 1), return the first decode plan."""
    for r in reqs:
        core.add(r)
    kv.settle(core)
    plan = core.schedule()
    assert plan is not None and all(st.draft_k == 0 for st in plan.steps)
    kv.settle(core)
    core.on_result(verify(plan, {st.seq_id: [1] for st in plan.steps}, {}))
    plan = core.schedule()
    kv.settle(core)
    return plan


def test_a_decode_plan_carries_k_and_a_verify_advances_by_one_plus_accepted():
    core, kv = make(max_k=3), Kv()
    plan = prefilled(core, kv, admitted("a", 10))
    s = core.by_seq[1]
    # prompt 10 + 1 token: its first 2 blocks hold the verify's positions 10..13 (the
    # growth asked keeps room for lookahead 1 + the 3 drafts: 10 + 1 + 3 <= 16)
    assert plan == StepPlan(2, [], [SeqStep(1, 1, [], True, 1, 3)], [])
    assert core.planner.last_spec.k == {1: 3}
    assert s.capacity(BS) >= s.num_computed + 1 + 3   # the verify's positions 10..13
    assert core.in_flight == {2: {1: 1}}
    # growth is asked from where the verify may leave it, 14, with room for the next
    # step's drafts: 14 + 1 + 3 > 16, one block more
    assert s.capacity(BS) == 24
    charged = core.vtc.of("t1")
    out = core.on_result(verify(plan, {1: [5, 6, 7]}, {1: 2}))
    assert [t.token_ids for t in out.tokens] == [[5], [6], [7]]
    assert s.num_computed == 10 + 1 + 2 and s.token_ids[10:] == [1, 5, 6, 7]
    assert s.remaining == 1 and (s.spec_hits, s.spec_misses) == (2, 1)
    assert core.vtc.of("t1") - charged == pytest.approx(3 * core.vtc.w_out)
    assert core.spec_stats()["spec.verifies"] == 1 and core.spec_stats()["spec.emitted"] == 3
    assert core.spec_stats()["spec.accepted."] == 2
    # the next step decodes from the new length
    plan = core.schedule()
    assert plan.steps[0].num_tokens == 1 and plan.steps[0].draft_k == 3


def test_all_drafts_accepted_and_an_executor_that_found_none():
    core, kv = make(max_k=2), Kv()
    plan = prefilled(core, kv, admitted("a", 10))
    out = core.on_result(verify(plan, {1: [5, 6, 7]}, {1: 2}))
    assert len(out.tokens) == 3 and core.by_seq[1].spec_misses == 0
    plan = core.schedule()
    kv.settle(core)
    assert plan.steps[0].draft_k == 2
    # the n-gram source proposed nothing: no verify listed, one token
    out = core.on_result(StepResult(plan.step_id, [1], [8], 1))
    assert [t.token_ids for t in out.tokens] == [[8]]
    assert core.by_seq[1].num_computed == 10 + 3 + 1


def test_a_stop_among_the_accepted_drafts_ends_the_choice_and_discards_the_rest():
    core, kv = make(max_k=3), Kv()
    plan = prefilled(core, kv, admitted("a", 10, eos=(7,)))
    charged = core.vtc.of("t1")
    out = core.on_result(verify(plan, {1: [5, 7, 8, 9]}, {1: 3}))
    assert out.tokens == [TokenOut("a", [5]),
                          TokenOut("a", [7], None, "stop", Usage(10, 3, 0), RequestTiming())]
    assert out.released == ["a"] and core.discarded_samples == 2
    assert core.vtc.of("t1") - charged == pytest.approx(2 * core.vtc.w_out)
    assert "a" not in core.by_request
    # its lease goes back with what it computed: the prompt, its first token, 3 drafts
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 14)], [])


def test_max_tokens_caps_k_and_the_verify_ends_at_the_length():
    core, kv = make(max_k=4), Kv()
    plan = prefilled(core, kv, admitted("a", 10, max_tokens=3))
    assert plan.steps[0].draft_k == 1            # 2 tokens left: one draft and its check
    out = core.on_result(verify(plan, {1: [5, 6]}, {1: 1}))
    assert [t.token_ids for t in out.tokens] == [[5], [6]]
    assert out.tokens[-1].finish_reason == "length" and out.released == ["a"]
    assert out.tokens[-1].usage == Usage(10, 3, 0) and core.discarded_samples == 0


def test_the_models_length_caps_k():
    core, kv = make(max_k=4, max_model_len=14), Kv()
    plan = prefilled(core, kv, admitted("a", 10, max_tokens=None))
    s = core.by_seq[1]
    assert s.num_tokens == 11
    # 3 tokens left to the model's length: two drafts and the target's own
    assert plan.steps[0].draft_k == 2
    out = core.on_result(verify(plan, {1: [5, 6, 7]}, {1: 2}))
    assert [t.token_ids for t in out.tokens] == [[5], [6], [7]]
    assert out.tokens[-1].finish_reason == "length" and core.discarded_samples == 0


def test_a_cancel_with_a_verify_in_flight_discards_its_tokens_and_frees_the_lease():
    core, kv = make(max_k=3), Kv()
    plan = prefilled(core, kv, admitted("a", 10), admitted("b", 5))
    assert [(st.seq_id, st.draft_k) for st in plan.steps] == [(1, 3), (2, 3)]
    out = core.cancel("a")
    assert out.released == ["a"] and out.forget == ["a"]
    ops = core.take_kv_ops()
    assert ops == KvOps(EPOCH, [FreeRequest(1, 10)], [])
    apply_ops(kv.pool, ops)
    out = core.on_result(verify(plan, {1: [5, 6, 7, 8], 2: [9, 10]}, {1: 3, 2: 1}))
    assert [t.token_ids for t in out.tokens] == [[9], [10]]   # a's 4 tokens discarded
    assert core.discarded_samples == 4
    assert core.spec.stats.passes == 1                       # only b's verify counted
    assert core.by_seq[2].num_computed == 5 + 1 + 1
    assert kv.pool.blocks_of(1) == []
    core.cancel("b")
    kv.settle(core)
    assert kv.pool.num_free == kv.num_blocks


def test_a_verify_in_flight_sits_its_row_out_at_depth_2():
    core, kv = make(max_k=3, depth=2), Kv()
    plan = prefilled(core, kv, admitted("a", 10))
    assert plan.steps[0].draft_k == 3
    assert not core.by_seq[1].may_plan_ahead(256)
    assert core.schedule() is None                # how many tokens it emits is unknown
    core.on_result(verify(plan, {1: [5, 6]}, {1: 1}))
    kv.settle(core)
    assert core.schedule().steps[0].draft_k == 3


def test_fixed_control_drafts_max_k_where_the_scheduler_drafts_none():
    plans = {}
    for control in ("scheduler", "fixed"):
        # 4 rows at 1 ms fixed and 2 ms per token: a draft, worth 0.8 of a token, costs
        # more than 0.8 of the step's 2.25 ms per token
        core, kv = make(max_k=2, coef=[1 * MS, 2 * MS, 0.0, 0.0, 0.0], control=control), Kv()
        plans[control] = prefilled(core, kv, *(admitted(f"r{i}", 6) for i in range(4)))
    assert [st.draft_k for st in plans["scheduler"].steps] == [0, 0, 0, 0]
    assert [st.draft_k for st in plans["fixed"].steps] == [2, 2, 2, 2]


@pytest.mark.parametrize("seed", range(20))
def test_blocks_are_never_short_for_the_drafts_and_all_come_back(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([12, 24, 64])
    core = make(max_k=rng.randint(1, 6), control=rng.choice(["scheduler", "fixed"]),
                max_model_len=rng.choice([40, 96]), num_blocks=num_blocks,
                depth=rng.choice([1, 2]))
    kv = Kv(num_blocks)
    for i in range(rng.randint(1, 6)):
        core.add(admitted(f"r{i}", rng.randint(1, 30), eos=(3,),
                          max_tokens=rng.choice([None, 1, 5, 20])))
    pending: list[StepPlan] = []
    verifies = 0
    for _ in range(2000):
        kv.settle(core)
        while len(core.in_flight) < core.cfg.async_depth and (plan := core.schedule()):
            kv.settle(core)
            for st in plan.steps:
                s = core.by_seq[st.seq_id]
                start = s.planned - st.num_tokens
                # the step's positions and its drafts' lie in blocks the sequence holds
                assert start + st.num_tokens + st.draft_k <= s.capacity(BS), seed
                assert st.draft_k == 0 or (st.num_tokens == 1 and st.sample)
            pending.append(plan)
        if not pending:
            if not core.has_work:
                break
            continue                          # a lease asked: granted at the next settle
        plan = pending.pop(0)
        tokens, accepted = {}, {}
        for st in plan.steps:
            if st.sample:
                a = rng.randint(0, st.draft_k)
                accepted[st.seq_id] = a
                tokens[st.seq_id] = [rng.choice([3, 4, 5, 6]) for _ in range(1 + a)]
                verifies += bool(st.draft_k)
        core.on_result(verify(plan, tokens, accepted))
    assert not core.has_work, seed
    kv.settle(core)
    assert kv.pool.num_free == num_blocks and kv.pool.stats().leased_seqs == 0
