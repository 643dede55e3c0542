"""SchedulerCore driven directly: exact AllocRequests, StepPlans, stop handling,
cancellation, prefix-cache grants and preemption by recompute (the randomized whole-loop
check is test_whole_loop.py)."""
from __future__ import annotations

import itertools

import pytest

from components.kv_manager.ops import apply_ops
from components.kv_manager.pool import BlockPool
from components.model.hashing import block_hashes
from components.scheduler.core import SchedulerCore
from components.scheduler.planning import penalties_of
from components.scheduler.sequence import State
from schemas.config import KvConfig, SchedulerConfig
from schemas.wire import (
    Admitted,
    AllocRequest,
    DetokParams,
    FreeRequest,
    KvGrant,
    KvOps,
    NewSeq,
    Penalties,
    PromptChunkLogprobs,
    RequestTiming,
    SampleLogprobs,
    SamplingParams,
    SeqStep,
    StepPlan,
    StepResult,
    TokenOut,
    Usage,
    carried_tail,
)
from tests import messages as msgs

T0 = RequestTiming()    # timings are zero when the test passes no clock

BS = 8
EPOCH = 1


class Kv:
    """The kv_manager's handling of KvOps, over a real BlockPool."""

    def __init__(self, num_blocks: int, prefix_cache: bool = True) -> None:
        self.pool = BlockPool(num_blocks, BS, prefix_cache)

    def apply(self, ops: KvOps | None) -> list[KvGrant]:
        return [] if ops is None else apply_ops(self.pool, ops)


_clock = itertools.count(1000)


def make(max_num_seqs=4, max_tokens_per_step=32, lookahead=4, grow_blocks=2,
         max_model_len=256) -> SchedulerCore:
    return SchedulerCore(SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=max_tokens_per_step,
                                         lookahead_tokens=lookahead),
                         KvConfig(block_size=BS, num_blocks=64, grow_blocks=grow_blocks),
                         max_model_len, epoch=EPOCH)


def prompt(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def admitted(rid: str, tokens: list[int], *, tenant="t1", eos=(), **params) -> Admitted:
    params.setdefault("max_tokens", 100)
    return msgs.admitted(rid, tenant, list(tokens), block_hashes(tokens, BS, tenant, "m"),
                    SamplingParams(**params), next(_clock), tuple(eos))


def alloc_for(seq_id: int, tokens: list[int], tenant="t1") -> AllocRequest:
    hs = block_hashes(tokens, BS, tenant, "m")
    return AllocRequest(seq_id, -(-(len(tokens) + 1) // BS), tenant, hs, tokens[:len(hs) * BS],
                        (len(tokens) - 1) // BS)


def new_seq(seq_id, tokens, prompt_len, num_computed, block_ids, params=SamplingParams()):
    return NewSeq(seq_id, list(tokens), prompt_len, num_computed, list(block_ids),
                  params.temperature, params.top_p, params.top_k, params.seed,
                  penalties_of(params), params.logprobs)


def grant(seq_id, block_ids, cached=0, ok=True, epoch=EPOCH, reason="pool_full") -> KvGrant:
    return KvGrant(epoch, seq_id, ok, list(block_ids), cached, reason="" if ok else reason)


def result(plan: StepPlan, tokens: dict[int, int]) -> StepResult:
    """The executor's answer: one token for each sampling step, in plan order."""
    ids = [s.seq_id for s in plan.steps if s.sample]
    assert sorted(ids) == sorted(tokens), (ids, tokens)
    return StepResult(plan.step_id, ids, [tokens[i] for i in ids], 1)


def start(core: SchedulerCore, kv: Kv, *reqs: Admitted) -> StepPlan:
    """Admit requests, let their first allocation round-trip, return the first plan."""
    for r in reqs:
        core.add(r)
    assert core.schedule() is None
    core.on_grants(kv.apply(core.take_kv_ops()))
    plan = core.schedule()
    assert plan is not None
    return plan


# ---------------------------------------------------------------- first allocation and plan

def test_first_schedule_requests_blocks_and_waits():
    core, toks = make(), prompt(20)
    seq = core.add(admitted("r1", toks))
    assert seq.seq_id == 1 and seq.state is State.LEASING     # asked on arrival
    assert core.schedule() is None
    ops = core.take_kv_ops()
    hs = block_hashes(toks, BS, "t1", "m")
    assert len(hs) == 2
    assert ops == KvOps(EPOCH, [], [AllocRequest(1, 3, "t1", hs, toks[:16], 2)])
    assert core.take_kv_ops() is None
    assert core.schedule() is None                       # request in flight: not repeated
    assert core.take_kv_ops() is None
    assert core.in_flight == {}


@pytest.mark.parametrize("n, blocks, max_cached", [(7, 1, 0), (8, 2, 0), (9, 2, 1), (16, 3, 1),
                                                   (17, 3, 2)])
def test_first_allocation_sizes(n, blocks, max_cached):
    core, toks = make(), prompt(n)
    core.add(admitted("r1", toks))
    core.schedule()
    (a,) = core.take_kv_ops().allocs
    assert (a.num_blocks, a.max_cached_blocks) == (blocks, max_cached)
    assert a.token_ids == toks[:len(a.block_hashes) * BS] and len(a.block_hashes) == n // BS


def test_plan_after_grant():
    core, kv, toks = make(), Kv(16), prompt(10)
    params = SamplingParams(max_tokens=100, temperature=0.5, top_p=0.9, top_k=7, seed=3)
    core.add(msgs.admitted("r1", "t1", toks, block_hashes(toks, BS, "t1", "m"), params, 1))
    assert core.schedule() is None
    grants = kv.apply(core.take_kv_ops())
    assert grants == [grant(1, [0, 1])]
    core.on_grants(grants)
    plan = core.schedule()
    assert plan == StepPlan(1, [NewSeq(1, toks, 10, 0, [0, 1], 0.5, 0.9, 7, 3)],
                            [SeqStep(1, 10, [], True)], [])
    assert core.in_flight == {1: {1: 10}}
    assert core.take_kv_ops() is None                    # 10 + lookahead 4 fits 2 blocks

    out = core.on_result(result(plan, {1: 555}))
    assert out.tokens == [TokenOut("r1", [555], DetokParams((), True, 10, 0))]
    assert out.released == [] and out.forget == []
    assert core.by_request["r1"].token_ids == toks + [555]
    assert core.by_request["r1"].num_computed == 10


def test_penalties_travel_with_a_new_sequence_only_when_asked_for():
    assert penalties_of(SamplingParams()) is None
    assert penalties_of(SamplingParams(logit_bias={})) is None
    params = SamplingParams(max_tokens=100, presence_penalty=0.5, repetition_penalty=1.2,
                            logit_bias={9: -100.0, 3: 2.0})
    assert penalties_of(params) == Penalties(0.5, 0.0, 1.2, [(3, 2.0), (9, -100.0)])
    assert penalties_of(SamplingParams(frequency_penalty=-1.0)) == Penalties(0.0, -1.0)
    # min_tokens bans what would end the choice: EOS (unless ignored) and stop_token_ids
    p = SamplingParams(min_tokens=4, stop_token_ids=(7, 2))
    assert penalties_of(p, (2, 0)) == Penalties(min_tokens=4, stop_ids=[0, 2, 7])
    p = SamplingParams(min_tokens=4, stop_token_ids=(7,), ignore_eos=True)
    assert penalties_of(p, (2,)) == Penalties(min_tokens=4, stop_ids=[7])
    core, kv, toks = make(), Kv(16), prompt(10)
    core.add(msgs.admitted("r1", "t1", toks, block_hashes(toks, BS, "t1", "m"), params, 1))
    core.schedule()
    core.on_grants(kv.apply(core.take_kv_ops()))
    (ns,) = core.schedule().new_seqs
    assert ns.penalties == Penalties(0.5, 0.0, 1.2, [(3, 2.0), (9, -100.0)])


def test_logprobs_ride_with_their_token_or_not_at_all():
    core, kv, toks = make(), Kv(16), prompt(10)
    plan = start(core, kv, admitted("a", toks), admitted("b", prompt(9, 300)))
    lp = SampleLogprobs(-0.5, [7], [-0.5])
    out = core.on_result(StepResult(plan.step_id, [1, 2], [7, 8], 1, logprobs=[lp, None]))
    assert [(t.token_ids, t.logprobs) for t in out.tokens] == [([7], [lp]), ([8], None)]
    plan = core.schedule()
    # a list of another length (a corrupt message) is dropped, and no token with it
    out = core.on_result(StepResult(plan.step_id, [1, 2], [5, 6], 1, logprobs=[lp]))
    assert [(t.token_ids, t.logprobs) for t in out.tokens] == [([5], None), ([6], None)]


def test_known_sequences_travel_as_diffs_and_growth_is_batched():
    core, kv, toks = make(lookahead=4, grow_blocks=2), Kv(16), prompt(10)
    plan = start(core, kv, admitted("r1", toks))
    assert [n.block_ids for n in plan.new_seqs] == [[0, 1]]
    tokens = iter(range(500, 600))
    plans = []
    for _ in range(3):                                   # decodes of tokens 10, 11, 12
        core.on_result(result(plan, {1: next(tokens)}))
        plan = core.schedule()
        plans.append((plan, core.take_kv_ops()))
    # 11 and 12 tokens (+4 lookahead) still fit in 16 slots; at 13 growth is asked ahead,
    # while the step itself still fits the current blocks, and in a batch of 2 blocks
    assert plans[0] == (StepPlan(2, [], [SeqStep(1, 1, [], True)], []), None)
    assert plans[1] == (StepPlan(3, [], [SeqStep(1, 1, [], True)], []), None)
    assert plans[2] == (StepPlan(4, [], [SeqStep(1, 1, [], True)], []),
                        KvOps(EPOCH, [], [AllocRequest(1, 2)]))
    core.on_grants(kv.apply(plans[2][1]))
    assert core.by_request["r1"].block_ids == [0, 1, 2, 3]
    core.on_result(result(plan, {1: next(tokens)}))
    plan = core.schedule()
    assert plan == StepPlan(5, [], [SeqStep(1, 1, [2, 3], True)], [])   # only the new blocks
    core.on_result(result(plan, {1: next(tokens)}))
    plan = core.schedule()
    assert plan == StepPlan(6, [], [SeqStep(1, 1, [], True)], [])
    assert core.take_kv_ops() is None                    # 15 + 4 fits 32 slots


def test_growth_not_repeated_while_pending():
    core, kv, toks = make(lookahead=8, grow_blocks=1), Kv(16), prompt(10)
    plan = start(core, kv, admitted("r1", toks))
    # 10 + 8 lookahead needs 3 blocks: one more asked right away, grow_blocks=1
    assert core.take_kv_ops() == KvOps(EPOCH, [], [AllocRequest(1, 1)])
    core.on_result(result(plan, {1: 7}))
    plan = core.schedule()
    assert plan.steps == [SeqStep(1, 1, [], True)]
    assert core.take_kv_ops() is None                    # still pending: not asked twice
    core.on_grants([grant(1, [9])])
    core.on_result(result(plan, {1: 8}))
    plan = core.schedule()
    assert plan.steps == [SeqStep(1, 1, [9], True)]


# ---------------------------------------------------------------- budget

def test_chunked_prefill():
    core, kv, toks = make(max_tokens_per_step=16), Kv(16), prompt(40)
    plan = start(core, kv, admitted("r1", toks))
    assert plan == StepPlan(1, [new_seq(1, toks, 40, 0, [0, 1, 2, 3, 4, 5])],
                            [SeqStep(1, 16, [], False)], [])
    assert core.on_result(result(plan, {})).tokens == []
    assert core.by_request["r1"].num_computed == 16
    plan = core.schedule()
    assert plan == StepPlan(2, [], [SeqStep(1, 16, [], False)], [])
    core.on_result(result(plan, {}))
    plan = core.schedule()
    assert plan == StepPlan(3, [], [SeqStep(1, 8, [], True)], [])
    out = core.on_result(result(plan, {1: 9}))
    assert out.tokens == [TokenOut("r1", [9], DetokParams((), True, 40, 0))]
    assert core.schedule().steps == [SeqStep(1, 1, [], True)]


def test_decode_first_then_prefill_gets_the_rest():
    core, kv = make(max_tokens_per_step=16), Kv(32)
    a_toks, b_toks = prompt(4), prompt(40, base=300)
    plan = start(core, kv, admitted("a", a_toks))
    assert plan.steps == [SeqStep(1, 4, [], True)]
    core.add(admitted("b", b_toks))
    core.on_result(result(plan, {1: 1}))
    plan = core.schedule()                               # b's blocks are not granted yet
    assert plan == StepPlan(2, [], [SeqStep(1, 1, [], True)], [])
    ops = core.take_kv_ops()            # b's first lease (asked on arrival), a grows (5 + 4 > 8)
    assert ops == KvOps(EPOCH, [], [alloc_for(2, b_toks), AllocRequest(1, 2)])
    core.on_grants(kv.apply(ops))
    core.on_result(result(plan, {1: 2}))
    plan = core.schedule()
    assert plan == StepPlan(3, [new_seq(2, b_toks, 40, 0, [1, 2, 3, 4, 5, 6])],
                            [SeqStep(1, 1, [7, 8], True), SeqStep(2, 15, [], False)], [])
    core.on_result(result(plan, {1: 3}))
    plan = core.schedule()
    assert plan.steps == [SeqStep(1, 1, [], True), SeqStep(2, 15, [], False)]
    core.on_result(result(plan, {1: 4}))
    plan = core.schedule()
    assert plan.steps == [SeqStep(1, 1, [], True), SeqStep(2, 10, [], True)]


def test_max_num_seqs_limits_admission():
    core, kv = make(max_num_seqs=2), Kv(32)
    reqs = [admitted(f"r{i}", prompt(3, base=10 * i)) for i in range(3)]
    for r in reqs:
        core.add(r)
    assert core.schedule() is None
    ops = core.take_kv_ops()
    assert [a.seq_id for a in ops.allocs] == [1, 2]      # only as many leases as slots
    core.on_grants(kv.apply(ops))
    plan = core.schedule()
    assert [s.seq_id for s in plan.steps] == [1, 2]
    assert [s.seq_id for s in core.waiting] == [3]
    assert core.take_kv_ops() is None


def test_admission_in_arrival_order_within_budget():
    core, kv = make(max_tokens_per_step=16), Kv(32)
    plan = start(core, kv, admitted("a", prompt(10)), admitted("b", prompt(10, base=50)))
    # a takes 10, b gets the remaining 6 as a first chunk
    assert plan.steps == [SeqStep(1, 10, [], True), SeqStep(2, 6, [], False)]
    assert [n.seq_id for n in plan.new_seqs] == [1, 2]


# ---------------------------------------------------------------- stop conditions

def run_to_sample(core, kv, *reqs):
    plan = start(core, kv, *reqs)
    assert all(s.sample for s in plan.steps)
    return plan


def test_eos_stops_and_frees():
    core, kv = make(), Kv(16)
    toks = prompt(10)
    plan = run_to_sample(core, kv, admitted("a", toks, eos=(2,)), admitted("b", prompt(3, 50)))
    out = core.on_result(result(plan, {1: 2, 2: 2}))       # b has no eos ids
    assert out.tokens == [
        TokenOut("a", [2], DetokParams((), True, 10, 0), "stop", Usage(10, 1, 0), T0),
        TokenOut("b", [2], DetokParams((), True, 3, 0))]
    assert out.released == ["a"] and out.forget == []
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 10)], [])
    assert "a" not in core.by_request and 1 not in core.by_seq
    plan = core.schedule()
    assert plan == StepPlan(2, [], [SeqStep(2, 1, [], True)], [1])
    kv.apply(KvOps(EPOCH, [FreeRequest(1, 10)], []))
    assert kv.pool.blocks_of(1) == []


def test_ignore_eos():
    core, kv = make(), Kv(16)
    plan = run_to_sample(core, kv, admitted("a", prompt(10), eos=(2,), ignore_eos=True,
                                            max_tokens=2))
    out = core.on_result(result(plan, {1: 2}))
    assert out.tokens[0].finish_reason is None and out.released == []
    plan = core.schedule()
    out = core.on_result(result(plan, {1: 2}))
    assert out.tokens == [TokenOut("a", [2], None, "length", Usage(10, 2, 0), T0)]


def test_stop_token_ids():
    core, kv = make(), Kv(16)
    plan = run_to_sample(core, kv, admitted("a", prompt(10), stop_token_ids=(7, 8)))
    assert core.on_result(result(plan, {1: 9})).released == []
    plan = core.schedule()
    out = core.on_result(result(plan, {1: 8}))
    assert out.tokens == [TokenOut("a", [8], None, "stop", Usage(10, 2, 0), T0)]
    assert out.released == ["a"]
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 11)], [])


def test_min_tokens_holds_off_eos_and_stop_ids():
    core, kv = make(), Kv(16)
    plan = run_to_sample(core, kv, admitted("a", prompt(10), eos=(2,), stop_token_ids=(8,),
                                            min_tokens=2))
    assert plan.new_seqs[0].penalties == Penalties(min_tokens=2, stop_ids=[2, 8])
    out = core.on_result(result(plan, {1: 2}))            # a sampler that ignored the ban
    assert out.tokens == [TokenOut("a", [2], DetokParams((), True, 10, 0, min_tokens=2))]
    plan = core.schedule()
    assert core.on_result(result(plan, {1: 8})).released == []      # 2 tokens: not yet
    plan = core.schedule()
    out = core.on_result(result(plan, {1: 8}))            # the third may stop
    assert out.tokens == [TokenOut("a", [8], None, "stop", Usage(10, 3, 0), T0)]


def test_a_continuation_s_first_output_carries_its_output_tail_to_the_detokenizer():
    """A migrated stream's prompt ends in ``output_offset`` tokens of output: its first
    TokenOut hands the detokenizer their tail (``carried_tail(stop)`` at most) and the
    executor the offset."""
    for stop, offset, want in (((), 3, 3), (("ab",), 30, carried_tail(("ab",))),
                               ((), 0, 0), ((), 50, carried_tail(())),
                               (("x" * 10,), 50, 20)):        # no more than the prompt
        core, kv = make(), Kv(16)
        toks = prompt(20)
        plan = run_to_sample(core, kv, admitted("a", toks, stop=stop, output_offset=offset))
        assert plan.new_seqs[0].output_offset == offset
        out = core.on_result(result(plan, {1: 8}))
        assert out.tokens[0].params.carried == tuple(toks[len(toks) - want:] if want else ())


def _prompt_run(core: SchedulerCore, kv: Kv, toks: list[int], chunk_for) -> list[TokenOut]:
    """Run request "a" (prompt_logprobs 1) through its prompt, answering each step with
    ``chunk_for(first position, tokens)``'s PromptChunkLogprobs; its first output."""
    plan = start(core, kv, admitted("a", toks, prompt_logprobs=1))
    assert plan.new_seqs[0].prompt_logprobs == 1
    done = 0
    while True:
        (st,) = plan.steps
        chunks = chunk_for(done, st.num_tokens)
        done += st.num_tokens
        out = core.on_result(StepResult(plan.step_id, [1] if st.sample else [],
                                        [5] if st.sample else [], 1, prompt_logprobs=chunks))
        if st.sample:
            return out.tokens
        plan = core.schedule()


def _entry(pos: int) -> SampleLogprobs:
    return SampleLogprobs(-float(pos), [pos], [-float(pos)])


def test_prompt_logprobs_computed_whole_and_sent_with_the_first_token():
    """A prompt owed prompt_logprobs reads nothing from the prefix cache (it may match
    no cached block, where the same prompt without them may match two), its chunks'
    entries are gathered once each (a chunk computed again, as after preemption, repeats
    positions) and ride on the first token."""
    core, toks = make(), prompt(20)
    core.add(admitted("n", toks))
    core.add(admitted("a", toks, prompt_logprobs=1))
    core.schedule()
    assert [a.max_cached_blocks for a in core.take_kv_ops().allocs] == [2, 0]
    core, kv = make(max_tokens_per_step=8), Kv(32)

    def chunks(first: int, n: int) -> list[PromptChunkLogprobs]:
        last = min(first + n, len(toks) - 1)              # the prompt's last row samples
        start_at = max(first + 1 - 3, 1)                  # 3 positions again, as recomputed
        return [PromptChunkLogprobs(1, start_at, [_entry(p) for p in range(start_at, last + 1)])]

    (tok,) = _prompt_run(core, kv, toks, chunks)
    assert tok.prompt == (toks, [_entry(p) for p in range(1, 20)])
    plan = core.schedule()
    assert plan.new_seqs == [] and core.on_result(result(plan, {1: 6})).tokens[0].prompt is None


def test_prompt_logprobs_with_a_gap_are_not_sent():
    core, kv, toks = make(max_tokens_per_step=8), Kv(32), prompt(20)
    skip = {9}                                            # a chunk that starts past the next

    def chunks(first: int, n: int) -> list[PromptChunkLogprobs]:
        at = first + 1 + (first + 1 in skip)
        return [PromptChunkLogprobs(1, at, [_entry(p) for p in range(at, min(first + n, 19) + 1)])]

    (tok,) = _prompt_run(core, kv, toks, chunks)
    assert tok.prompt is None and tok.token_ids == [5]


def test_prompt_logprobs_go_with_the_first_choice_out():
    """n = 2: the fork's first token goes out first and carries the prompt's entries."""
    core, kv, toks = make(), Kv(32), prompt(4)
    plan = start(core, kv, admitted("a", toks, prompt_logprobs=0, n=2, max_tokens=4))
    res = StepResult(plan.step_id, [1, 1], [7, 8], 1, prompt_logprobs=[
        PromptChunkLogprobs(1, 1, [_entry(1), _entry(2), _entry(3)])])
    out = core.on_result(res)
    assert [(t.index, t.prompt) for t in out.tokens] == [
        (1, (toks, [_entry(1), _entry(2), _entry(3)])), (0, None)]


def test_max_tokens_length():
    core, kv = make(), Kv(16)
    plan = run_to_sample(core, kv, admitted("a", prompt(10), max_tokens=3))
    outs = []
    for tok in (5, 6, 7):
        outs.append(core.on_result(result(plan, {1: tok})))
        plan = core.schedule()
    assert [o.tokens[0].finish_reason for o in outs] == [None, None, "length"]
    assert outs[2].tokens[0].usage == Usage(10, 3, 0)
    assert outs[2].released == ["a"]
    assert plan is None and not core.has_work
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 12)], [])


def test_max_model_len_length():
    core, kv = make(max_model_len=12), Kv(16)
    plan = run_to_sample(core, kv, admitted("a", prompt(10)))
    assert core.on_result(result(plan, {1: 5})).tokens[0].finish_reason is None
    out = core.on_result(result(core.schedule(), {1: 6}))
    assert out.tokens[0].finish_reason == "length"
    assert out.tokens[0].usage == Usage(10, 2, 0)


# ---------------------------------------------------------------- cancellation

def test_cancel_while_waiting_before_any_request():
    core = make()
    core.add(admitted("a", prompt(10)))                  # its lease is asked on arrival
    out = core.cancel("a")
    assert out.released == ["a"] and out.forget == [] and out.tokens == []
    assert not core.has_work and core.by_request == {}
    assert core.by_seq[1].state is State.CLOSING         # until the lease's answer comes
    assert [a.seq_id for a in core.take_kv_ops().allocs] == [1]
    core.on_grants([grant(1, [0, 1])])
    assert core.by_seq == {} and core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 0)], [])
    assert core.schedule() is None and core.take_kv_ops() is None
    assert core.cancel("a").released == []               # unknown: no-op


def test_cancel_while_allocation_in_flight_frees_late_grant():
    core, kv = make(), Kv(16)
    core.add(admitted("a", prompt(10)))
    core.schedule()
    ops = core.take_kv_ops()
    out = core.cancel("a")
    assert out.released == ["a"]
    assert core.take_kv_ops() is None                    # nothing leased yet
    core.on_grants(kv.apply(ops))                        # the grant arrives late
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 0)], [])
    assert core.by_seq == {}


def test_cancel_while_allocation_in_flight_denied():
    core = make()
    core.add(admitted("a", prompt(10)))
    core.schedule()
    core.take_kv_ops()
    core.cancel("a")
    core.on_grants([grant(1, [], ok=False)])
    assert core.take_kv_ops() is None and core.by_seq == {}


def test_cancel_ready_sequence():
    core, kv = make(), Kv(16)
    core.add(admitted("a", prompt(10)))
    core.schedule()
    core.on_grants(kv.apply(core.take_kv_ops()))
    assert core.by_request["a"].state is State.READY
    out = core.cancel("a")
    assert out.released == ["a"] and out.forget == []
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 0)], [])
    assert list(core.waiting) == []


def test_cancel_while_running_between_steps():
    core, kv = make(), Kv(16)
    plan = start(core, kv, admitted("a", prompt(10)), admitted("b", prompt(3, 50)))
    core.on_result(result(plan, {1: 1, 2: 2}))
    out = core.cancel("a")
    assert out.released == ["a"] and out.forget == ["a"]  # the detokenizer saw output
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 10)], [])
    assert core.schedule() == StepPlan(2, [], [SeqStep(2, 1, [], True)], [1])


def test_cancel_while_step_in_flight():
    core, kv = make(), Kv(16)
    plan = start(core, kv, admitted("a", prompt(10)), admitted("b", prompt(3, 50)))
    core.on_result(result(plan, {1: 1, 2: 2}))
    plan = core.schedule()
    assert core.in_flight == {2: {1: 1, 2: 1}}
    out = core.cancel("a")
    assert out.released == ["a"] and out.forget == ["a"]
    # its blocks go back at once, with only what was computed before the step in flight:
    # the executor runs that step before any plan that uses them again
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 10)], [])
    out = core.on_result(result(plan, {1: 3, 2: 4}))
    assert out.tokens == [TokenOut("b", [4])]            # a's token is discarded
    assert out.released == [] and core.discarded_samples == 1
    assert core.take_kv_ops() is None
    assert core.schedule() == StepPlan(3, [], [SeqStep(2, 1, [], True)], [1])
    assert core.by_request["b"].num_computed == 4


def test_cancel_in_flight_with_pending_growth():
    core, kv = make(lookahead=8, grow_blocks=1), Kv(16)
    plan = start(core, kv, admitted("a", prompt(10)))
    growth = core.take_kv_ops()
    assert growth == KvOps(EPOCH, [], [AllocRequest(1, 1)])
    core.cancel("a")
    frees = core.take_kv_ops()                           # at once, its step in flight or not
    assert frees == KvOps(EPOCH, [FreeRequest(1, 0)], [])
    core.on_result(result(plan, {1: 5}))
    assert core.take_kv_ops() is None
    # the kv_manager saw the growth before the free; its grant comes back to a dead seq
    grants = kv.apply(growth)
    kv.apply(frees)
    assert kv.pool.num_free == 16
    core.on_grants(grants)
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 0)], [])   # harmless repeat
    assert core.by_seq == {} and core.schedule() is None


# ---------------------------------------------------------------- prefix cache

def test_prefix_cache_grant_starts_at_cached_tokens():
    core, kv = make(), Kv(16)
    toks = prompt(20)
    plan = start(core, kv, admitted("a", toks, max_tokens=1))
    out = core.on_result(result(plan, {1: 9}))
    assert out.released == ["a"]
    kv.apply(core.take_kv_ops())                         # FreeRequest(1, 20): 2 blocks cached
    assert list(kv.pool._cached) == [0, 1]

    core.add(admitted("b", toks, max_tokens=1))
    assert core.schedule() is None
    ops = core.take_kv_ops()
    assert ops == KvOps(EPOCH, [], [alloc_for(2, toks)])
    grants = kv.apply(ops)
    assert grants == [grant(2, [0, 1, 3], cached=16)]
    core.on_grants(grants)
    seq = core.by_request["b"]
    assert seq.num_computed == 16 and seq.cached_tokens == 16
    plan = core.schedule()
    assert plan == StepPlan(2, [new_seq(2, toks, 20, 16, [0, 1, 3])],
                            [SeqStep(2, 4, [], True)], [1])
    out = core.on_result(result(plan, {2: 9}))
    assert out.tokens == [TokenOut("b", [9], DetokParams((), True, 20, 16), "length",
                                   Usage(20, 1, 16), T0)]


def test_other_tenant_gets_no_cache():
    core, kv = make(), Kv(16)
    toks = prompt(20)
    plan = start(core, kv, admitted("a", toks, max_tokens=1))
    core.on_result(result(plan, {1: 9}))
    kv.apply(core.take_kv_ops())
    core.add(admitted("b", toks, tenant="t2", max_tokens=1))
    core.schedule()
    grants = kv.apply(core.take_kv_ops())
    assert grants[0].num_cached_tokens == 0


# ---------------------------------------------------------------- preemption

@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_by_recompute(prefix_cache):
    core = make(max_tokens_per_step=32, lookahead=1, grow_blocks=1)
    kv = Kv(4, prefix_cache)                             # 32 token slots in all
    a_toks, b_toks = prompt(15), prompt(15, base=300)
    plan = start(core, kv, admitted("a", a_toks, max_tokens=4), admitted("b", b_toks))
    assert plan == StepPlan(1, [new_seq(1, a_toks, 15, 0, [0, 1]),
                                new_seq(2, b_toks, 15, 0, [2, 3])],
                            [SeqStep(1, 15, [], True), SeqStep(2, 15, [], True)], [])
    assert kv.pool.num_free == 0
    core.on_result(result(plan, {1: 1, 2: 2}))
    plan = core.schedule()                               # both decode into their last slot
    assert plan == StepPlan(2, [], [SeqStep(1, 1, [], True), SeqStep(2, 1, [], True)], [])
    ops = core.take_kv_ops()
    assert ops == KvOps(EPOCH, [], [AllocRequest(1, 1), AllocRequest(2, 1)])
    grants = kv.apply(ops)
    assert grants == [grant(s, [], ok=False, reason="pool_full") for s in (1, 2)]
    core.on_grants(grants)
    core.on_result(result(plan, {1: 11, 2: 22}))

    # neither can go on: the latest arrival (b) is preempted and its blocks freed
    b = core.by_request["b"]
    assert core.schedule() is None
    assert core.preemptions == 1 and b.preemptions == 1
    assert core.wasted_tokens == 16                      # b had computed 15 + 1 tokens
    assert [(p.request_id, p.reason, p.choice, p.wasted_tokens) for p in core.last_preempted] \
        == [("b", "kv_growth_denied", "recompute", 16)]
    assert b.seq_id == 3 and 2 not in core.by_seq and core.by_seq[3] is b
    assert list(core.waiting) == [b] and core.running == [core.by_request["a"]]
    assert b.state is State.LEASING and b.num_computed == 0 and b.block_ids == []
    assert b.token_ids == b_toks + [2, 22]
    ops = core.take_kv_ops()
    assert ops == KvOps(EPOCH, [FreeRequest(2, 16)],
                        [AllocRequest(1, 1),
                         AllocRequest(3, 3, "t1", block_hashes(b_toks, BS, "t1", "m"),
                                      b_toks[:8], 2)])
    grants = kv.apply(ops)
    # with the prefix cache b's first block stays cached, so a gets b's partial block
    assert grants[0] == grant(1, [3] if prefix_cache else [2])
    assert grants[1] == grant(3, [], ok=False, reason="pool_full")   # b cannot come back yet
    core.on_grants(grants)

    # a new request arrives; it is not admitted while b waits
    c_toks = prompt(3, base=700)
    core.add(admitted("c", c_toks))
    plan = core.schedule()
    assert plan == StepPlan(3, [], [SeqStep(1, 1, grants[0].block_ids, True)], [2])  # drop old id
    assert core.take_kv_ops() is None                    # b denied, nothing freed: no retry
    core.on_result(result(plan, {1: 12}))
    plan = core.schedule()
    assert plan == StepPlan(4, [], [SeqStep(1, 1, [], True)], [])
    out = core.on_result(result(plan, {1: 13}))
    assert out.released == ["a"]
    assert out.tokens[0].usage == Usage(15, 4, 0)

    # a's blocks come back: b asks again (first in line) and recomputes everything
    assert core.schedule() is None
    ops = core.take_kv_ops()
    assert ops == KvOps(EPOCH, [FreeRequest(1, 18)],
                        [AllocRequest(3, 3, "t1", block_hashes(b_toks, BS, "t1", "m"),
                                      b_toks[:8], 2), alloc_for(4, c_toks)])
    grants = kv.apply(ops)
    if prefix_cache:   # b's first block survived in the cache; c evicts a's cached block
        assert grants == [grant(3, [2, 1, 3], cached=8), grant(4, [0])]
    else:
        assert grants == [grant(3, [3, 0, 1]), grant(4, [2])]
    core.on_grants(grants)
    plan = core.schedule()
    done = 8 if prefix_cache else 0
    assert plan == StepPlan(5, [new_seq(3, b_toks + [2, 22], 15, done, grants[0].block_ids),
                                new_seq(4, c_toks, 3, 0, grants[1].block_ids)],
                            [SeqStep(3, 17 - done, [], True), SeqStep(4, 3, [], True)], [1])
    out = core.on_result(result(plan, {3: 33, 4: 44}))
    # b's stream continues where it stopped: no second DetokParams
    assert out.tokens == [TokenOut("b", [33]), TokenOut("c", [44], DetokParams((), True, 3, 0))]
    assert b.token_ids == b_toks + [2, 22, 33] and b.num_output == 3


def test_ready_sequence_gives_blocks_back_before_running_one_is_preempted():
    core = make(max_tokens_per_step=16, lookahead=1, grow_blocks=1)
    a_toks, b_toks, c_toks = prompt(15), prompt(40, base=300), prompt(4, base=700)
    core.add(admitted("a", a_toks))
    core.schedule()
    core.take_kv_ops()
    core.on_grants([grant(1, [0, 1])])
    plan = core.schedule()
    core.on_result(result(plan, {1: 1}))
    core.add(admitted("b", b_toks))
    core.add(admitted("c", c_toks))
    plan = core.schedule()
    assert plan.steps == [SeqStep(1, 1, [], True)]
    assert core.take_kv_ops() == KvOps(EPOCH, [], [alloc_for(2, b_toks), alloc_for(3, c_toks),
                                                   AllocRequest(1, 1)])
    core.on_grants([grant(1, [], ok=False), grant(2, [2, 3, 4, 5, 6, 7]), grant(3, [8])])
    core.on_result(result(plan, {1: 2}))
    c = core.by_request["c"]
    # a is out of slots and denied: the latest READY sequence (c) returns its lease
    # instead of a running sequence losing its work; b is admitted, c asks again
    plan = core.schedule()
    assert plan == StepPlan(3, [new_seq(2, b_toks, 40, 0, [2, 3, 4, 5, 6, 7])],
                            [SeqStep(2, 16, [], False)], [])
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(3, 0)],
                                       [AllocRequest(1, 1), alloc_for(4, c_toks)])
    assert c.seq_id == 4 and c.state is State.LEASING and c.block_ids == []
    assert core.preemptions == 0 and c.preemptions == 0
    assert list(core.waiting) == [c]
    assert [s.request_id for s in core.running] == ["a", "b"]


def test_denied_head_takes_back_leases_of_ready_sequences_behind_it():
    core = make()
    a_toks, b_toks = prompt(10), prompt(3, base=50)
    core.add(admitted("a", a_toks))
    core.add(admitted("b", b_toks))
    assert core.schedule() is None
    assert core.take_kv_ops() == KvOps(EPOCH, [], [alloc_for(1, a_toks), alloc_for(2, b_toks)])
    core.on_grants([grant(1, [], ok=False), grant(2, [0])])
    b = core.by_request["b"]
    assert b.state is State.READY
    # b may not overtake a; it hands its lease back so that a can be served, and both ask again
    assert core.schedule() is None
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(2, 0)],
                                       [alloc_for(1, a_toks), alloc_for(3, b_toks)])
    assert b.seq_id == 3 and b.state is State.LEASING and b.block_ids == []
    assert core.preemptions == 0 and b.preemptions == 0
    assert [s.request_id for s in core.waiting] == ["a", "b"]
    core.on_grants([grant(1, [0, 1]), grant(3, [2])])
    plan = core.schedule()
    assert [s.seq_id for s in plan.steps] == [1, 3] and plan.drop == []


def test_new_prefill_blocked_while_preempted_sequence_waits():
    core = make(max_tokens_per_step=32, lookahead=1, grow_blocks=1)
    a_toks, b_toks = prompt(15), prompt(15, base=300)
    core.add(admitted("a", a_toks))
    core.add(admitted("b", b_toks))
    core.schedule()
    core.take_kv_ops()
    core.on_grants([grant(1, [0, 1]), grant(2, [2, 3])])
    plan = core.schedule()
    core.on_result(result(plan, {1: 1, 2: 2}))
    plan = core.schedule()
    core.take_kv_ops()
    core.on_grants([grant(1, [], ok=False), grant(2, [], ok=False)])
    core.on_result(result(plan, {1: 3, 2: 4}))
    core.add(admitted("c", prompt(3, base=700)))
    assert core.schedule() is None                       # b preempted
    ops = core.take_kv_ops()
    assert core.by_request["b"].seq_id == 4 and core.by_request["c"].seq_id == 3
    assert [a.seq_id for a in ops.allocs] == [3, 1, 4]   # c asks on arrival; a grows; b asks
    # c's lease comes first; b's is still outstanding
    core.on_grants([grant(1, [4]), grant(3, [5])])
    plan = core.schedule()
    assert plan == StepPlan(3, [], [SeqStep(1, 1, [4], True)], [2])   # c READY, not admitted
    assert [s.request_id for s in core.waiting] == ["b", "c"]
    core.on_grants([grant(4, [6, 7, 8])])
    core.on_result(result(plan, {1: 5}))
    plan = core.schedule()
    assert [n.seq_id for n in plan.new_seqs] == [4, 3]   # b first, then c
    assert plan.steps == [SeqStep(1, 1, [], True), SeqStep(4, 17, [], True),
                          SeqStep(3, 3, [], True)]


# ---------------------------------------------------------------- retries and races

def test_denied_first_lease_retried_after_free():
    core = make(lookahead=1)
    core.add(admitted("a", prompt(10), max_tokens=2))
    core.schedule()
    core.take_kv_ops()
    core.on_grants([grant(1, [0, 1])])
    plan = core.schedule()
    core.add(admitted("b", prompt(10, base=50)))
    core.on_result(result(plan, {1: 5}))
    plan = core.schedule()
    (b_alloc,) = core.take_kv_ops().allocs
    core.on_grants([grant(2, [], ok=False)])             # denial comes back first
    assert core.take_kv_ops() is None
    core.on_result(result(plan, {1: 6}))                 # a finishes: its blocks come back
    assert core.schedule() is None
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 11)], [b_alloc])


def test_denial_arriving_after_the_free_is_still_retried():
    """The executor can answer before the kv_manager: the step that frees memory may be
    processed before the denial of a request the pool judged without that memory."""
    core = make(lookahead=1)
    core.add(admitted("a", prompt(10), max_tokens=2))
    core.schedule()
    core.take_kv_ops()
    core.on_grants([grant(1, [0, 1])])
    plan = core.schedule()
    core.add(admitted("b", prompt(10, base=50)))
    core.on_result(result(plan, {1: 5}))
    plan = core.schedule()
    (b_alloc,) = core.take_kv_ops().allocs               # sent before a's free
    core.on_result(result(plan, {1: 6}))                 # a finishes
    assert core.schedule() is None
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 11)], [])
    core.on_grants([grant(2, [], ok=False)])             # judged before the free
    assert core.schedule() is None
    assert core.take_kv_ops() == KvOps(EPOCH, [], [b_alloc])   # must ask again


def test_denial_retried_after_late_grant_is_returned():
    core = make()
    core.add(admitted("a", prompt(10)))
    core.add(admitted("b", prompt(10, base=50)))
    core.schedule()
    allocs = core.take_kv_ops().allocs
    core.cancel("a")
    # the pool gave a's blocks to a (now cancelled) and so refused b
    core.on_grants([grant(1, [0, 1]), grant(2, [], ok=False)])
    assert core.schedule() is None
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 0)], [allocs[1]])


def test_denied_request_not_retried_without_frees():
    core = make()
    core.add(admitted("a", prompt(10)))
    core.add(admitted("b", prompt(10, base=50)))
    core.schedule()
    core.take_kv_ops()
    core.on_grants([grant(1, [], ok=False), grant(2, [], ok=False)])
    assert core.schedule() is None
    assert core.take_kv_ops() is None                    # head denied: whole queue waits


# ---------------------------------------------------------------- epochs and reset

def test_grants_from_another_epoch_are_ignored():
    core = make()
    core.add(admitted("a", prompt(10)))
    core.schedule()
    core.take_kv_ops()
    core.on_grants([grant(1, [0, 1], epoch=EPOCH + 1)])
    assert core.by_request["a"].state is State.LEASING
    assert core.schedule() is None and core.take_kv_ops() is None


def test_reset_after_kv_loss_starts_new_epoch():
    core, kv = make(), Kv(16)
    plan = start(core, kv, admitted("a", prompt(10)))
    out = core.reset(kv_lost=True)
    assert out.released == ["a"] and out.forget == ["a"]
    assert core.epoch == EPOCH + 1 and core.in_flight == {}
    assert core.take_kv_ops() is None                    # the old pool is gone
    assert not core.has_work
    core.on_result(result(plan, {1: 5}))                 # stale: ignored
    core.add(admitted("b", prompt(5)))
    core.schedule()
    assert core.take_kv_ops().epoch == EPOCH + 1


def test_stale_step_result_after_reset_is_ignored():
    core = make()
    core.add(admitted("a", prompt(10)))
    core.schedule()
    core.take_kv_ops()
    core.on_grants([grant(1, [0, 1])])
    old = core.schedule()
    core.reset(kv_lost=True)                             # old step still on the executor
    core.add(admitted("b", prompt(5)))
    core.schedule()
    core.take_kv_ops()
    core.on_grants([grant(2, [0], epoch=EPOCH + 1)])
    plan = core.schedule()
    assert plan.steps == [SeqStep(2, 5, [], True)] and plan.step_id != old.step_id
    out = core.on_result(StepResult(old.step_id, [1], [9], 1))   # the old step's answer
    assert out.tokens == [] and core.in_flight == {plan.step_id: {2: 5}}
    assert core.by_request["b"].num_computed == 0
    out = core.on_result(result(plan, {2: 7}))
    assert out.tokens == [TokenOut("b", [7], DetokParams((), True, 5, 0))]
    assert core.by_request["b"].num_computed == 5


def test_reset_without_kv_loss_frees_blocks_but_caches_nothing():
    core, kv = make(), Kv(16)
    plan = start(core, kv, admitted("a", prompt(20)), admitted("b", prompt(3, base=50)))
    core.on_result(result(plan, {1: 5, 2: 6}))
    assert core.schedule() is not None
    core.on_grants(kv.apply(core.take_kv_ops()))         # a's growth
    out = core.reset(kv_lost=False)                      # the executor restarted
    assert sorted(out.released) == ["a", "b"] and sorted(out.forget) == ["a", "b"]
    assert core.epoch == EPOCH and core.in_flight == {} and not core.has_work
    # same epoch, so the leases are returned; the executor's KV is gone, so a's 20
    # computed tokens must not be offered to the prefix cache
    ops = core.take_kv_ops()
    assert sorted(ops.frees, key=lambda f: f.seq_id) == [FreeRequest(1, 0), FreeRequest(2, 0)]
    kv.apply(ops)
    assert kv.pool.stats().cached == 0 and kv.pool.num_free == 16
    plan = core.schedule()
    assert plan is None or plan.drop == []               # nothing to drop on a new executor


def test_request_timing_from_the_clock():
    core = make()
    # arrived at 1.0 s, held 0.03 s in admission's queue, here at 1.05 s: 0.02 s of ingress
    req = msgs.admitted("tm", "t1", prompt(5), [], SamplingParams(max_tokens=2), 1_000_000_000,
                   queued_ns=30_000_000)
    core.add(req, now_ns=1_050_000_000)
    assert core.schedule(now_ns=1_100_000_000) is None
    ops = core.take_kv_ops()
    pool = BlockPool(64, BS)
    a = ops.allocs[0]
    g = pool.allocate(a.seq_id, a.num_blocks, epoch=ops.epoch)
    core.on_grants([KvGrant(ops.epoch, a.seq_id, True, g.block_ids, 0)])
    plan = core.schedule(now_ns=1_250_000_000)                   # queued 0.25 s
    out = core.on_result(result(plan, {a.seq_id: 7}), now_ns=1_400_000_000)
    assert out.tokens[0].timing is None and out.tokens[0].params.queue_time_s == 0.25
    core.take_kv_ops()
    plan = core.schedule(now_ns=1_450_000_000)
    out = core.on_result(result(plan, {a.seq_id: 8}), now_ns=1_900_000_000)
    assert out.tokens[0].timing == RequestTiming(0.25, 0.15, 0.5, 0, 0.02)
