"""Steps overlapped with the forward pass (``scheduler.async_depth`` 2): planning from each
sequence's planned position, the sit-out rules, the sample discarded after an end, releases
sent at once though a step in flight still names the sequence, failure paths, and the
step-time accounting of ``SchedulerLoop``. Exact inputs; the randomized whole-loop
test (test_whole_loop.py, ``Cluster``) covers the interleavings."""
from __future__ import annotations

import itertools

import msgspec
import pytest

from components.kv_manager.ops import apply_ops
from components.kv_manager.pool import BlockPool
from components.model.hashing import block_hashes
from components.scheduler.core import SchedulerCore
from components.scheduler.loop import SchedulerLoop, StepDone
from components.scheduler.sequence import InFlight, Seq, State
from schemas.config import EngineConfig, KvConfig, SchedulerConfig, Topology, WeirConfig
from schemas.wire import (
    Admitted,
    AllocRequest,
    CancelRequest,
    DetokParams,
    EventBatch,
    Failed,
    ForkRequest,
    FreeRequest,
    KvGrants,
    KvOps,
    Released,
    SamplingParams,
    SeqStep,
    StepPlan,
    StepResult,
    SwapOutRequest,
    TokenBatch,
    TokenOut,
    Usage,
)
from tests import messages as msgs

BS = 8
EPOCH = 1
_clock = itertools.count(1000)


class Kv:
    def __init__(self, num_blocks: int = 16, num_cpu_blocks: int = 0) -> None:
        self.pool = BlockPool(num_blocks, BS, True, num_cpu_blocks)

    def settle(self, core: SchedulerCore) -> None:
        while (ops := core.take_kv_ops()) is not None:
            core.on_grants(apply_ops(self.pool, ops), self.pool.num_cpu_free)


def make(depth=2, max_tokens_per_step=32, lookahead=1, max_model_len=256, **kv) -> SchedulerCore:
    return SchedulerCore(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_tokens_per_step,
                                         lookahead_tokens=lookahead, async_depth=depth),
                         KvConfig(block_size=BS, num_blocks=16, grow_blocks=2, **kv),
                         max_model_len, epoch=EPOCH)


def admitted(rid: str, n_tokens: int, *, tenant="t1", eos=(), base=100, **params) -> Admitted:
    params.setdefault("max_tokens", 100)
    toks = list(range(base, base + n_tokens))
    return msgs.admitted(rid, tenant, toks, block_hashes(toks, BS, tenant, "m"),
                    SamplingParams(**params), next(_clock), tuple(eos))


def result(plan: StepPlan, tokens: dict[int, int | list[int]]) -> StepResult:
    """The executor's answer: the tokens of every sampling row, in plan order."""
    ids, toks = [], []
    for st in plan.steps:
        if st.sample:
            drawn = tokens[st.seq_id]
            drawn = drawn if isinstance(drawn, list) else [drawn]
            assert len(drawn) == st.num_samples
            ids += [st.seq_id] * st.num_samples
            toks += drawn
    assert set(ids) == set(tokens)
    return StepResult(plan.step_id, ids, toks, 1)


def started(core: SchedulerCore, kv: Kv, *reqs: Admitted) -> StepPlan:
    for r in reqs:
        core.add(r)
    kv.settle(core)
    plan = core.schedule()
    assert plan is not None
    return plan


# ---------------------------------------------------------------- planning ahead

def test_a_decode_is_planned_while_the_step_sampling_its_input_runs():
    core, kv = make(lookahead=4), Kv()
    p1 = started(core, kv, admitted("a", 10))
    assert p1.steps == [SeqStep(1, 10, [], True)]
    p2 = core.schedule()                   # p1 in flight: decode the token p1 samples
    assert p2 == StepPlan(2, [], [SeqStep(1, 1, [], True)], [])
    a = core.by_request["a"]
    assert core.in_flight == {1: {1: 10}, 2: {1: 1}}
    assert list(a.in_flight) == [InFlight(1, 10, 1), InFlight(2, 1, 1)]
    assert (a.num_computed, a.planned, a.num_tokens, a.planned_tokens, a.todo) == (0, 11, 10, 12, 1)
    with pytest.raises(AssertionError):
        core.schedule()                    # async_depth 2: no third step
    out = core.on_result(result(p1, {1: 5}))
    assert out.tokens == [TokenOut("a", [5], DetokParams((), True, 10, 0))]
    assert (a.num_computed, a.planned, a.token_ids[-1]) == (10, 11, 5)
    assert core.take_kv_ops() is None      # 11 + 1 + lookahead 4 fits its 2 blocks
    p3 = core.schedule()
    assert p3.steps == [SeqStep(1, 1, [], True)]         # position 11
    assert core.take_kv_ops() is None      # 12 + 4
    core.on_result(result(p2, {1: 6}))
    # growth is asked from the planned position: position 12 (after p3) + 1 + lookahead 4
    assert core.schedule().steps == [SeqStep(1, 1, [], True)]
    assert core.take_kv_ops() == KvOps(EPOCH, [], [AllocRequest(1, 2)])


def test_prefill_chunks_follow_each_other_and_the_last_one_is_decoded_past():
    core, kv = make(max_tokens_per_step=16), Kv()
    p1 = started(core, kv, admitted("a", 40))
    p2 = core.schedule()
    assert [p.steps for p in (p1, p2)] == [[SeqStep(1, 16, [], False)], [SeqStep(1, 16, [], False)]]
    core.on_result(result(p1, {}))
    p3 = core.schedule()
    assert p3.steps == [SeqStep(1, 8, [], True)]
    core.on_result(result(p2, {}))
    p4 = core.schedule()
    assert p4.steps == [SeqStep(1, 1, [], True)]
    out = core.on_result(result(p3, {1: 9}))
    assert out.tokens == [TokenOut("a", [9], DetokParams((), True, 40, 0))]
    assert core.by_request["a"].num_computed == 40


def test_depth_one_plans_nothing_while_a_step_runs():
    core, kv = make(depth=1), Kv()
    started(core, kv, admitted("a", 10))
    with pytest.raises(AssertionError):
        core.schedule()


# ---------------------------------------------------------------- sit-out rules

def test_a_sequence_whose_sample_in_flight_reaches_max_tokens_sits_out():
    core, kv = make(), Kv()
    p1 = started(core, kv, admitted("a", 10, max_tokens=1), admitted("b", 3, base=50,
                                                                     max_tokens=2))
    p2 = core.schedule()
    assert p2.steps == [SeqStep(2, 1, [], True)]         # a's sample ends it: a sits out
    core.on_result(result(p1, {1: 7, 2: 8}))             # a ends ("length"), b has 1 of 2
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 10)], [])   # in no step: now
    assert core.schedule() is None                       # b's sample in flight is its last
    out = core.on_result(result(p2, {2: 9}))
    assert out.tokens[0].finish_reason == "length" and out.released == ["b"]
    assert core.discarded_samples == 0                   # nothing was computed in vain


def test_a_sequence_whose_sample_in_flight_reaches_max_model_len_sits_out():
    core, kv = make(max_model_len=12), Kv()
    p1 = started(core, kv, admitted("a", 10))
    p2 = core.schedule()                                 # token 11 of 12: may go on
    assert p2.steps == [SeqStep(1, 1, [], True)]
    core.on_result(result(p1, {1: 5}))
    assert core.schedule() is None                       # p2 samples token 12: the end
    out = core.on_result(result(p2, {1: 6}))
    assert out.tokens[0].finish_reason == "length" and core.discarded_samples == 0


def test_an_unforked_n_request_sits_out_until_its_first_samples_fork_it():
    core, kv = make(), Kv()
    p1 = started(core, kv, admitted("a", 10, n=2))
    assert p1.steps == [SeqStep(1, 10, [], True, 2)]
    assert core.schedule() is None                       # the fork happens on p1's result
    out = core.on_result(result(p1, {1: [5, 6]}))
    assert [(t.index, t.token_ids) for t in out.tokens] == [(1, [6]), (0, [5])]
    ops = core.take_kv_ops()
    assert ops.forks == [ForkRequest(1, 2, 10)]
    p2 = core.schedule()                                 # the parent decodes; the child
    assert p2.steps == [SeqStep(1, 1, [], True)]         # waits for its fork grant
    core.on_grants(apply_ops(kv.pool, ops))
    p3 = core.schedule()                                 # the forked parent plans ahead
    assert [s.seq_id for s in p3.steps] == [1, 2]
    assert [n.seq_id for n in p3.new_seqs] == [2]


@pytest.mark.parametrize("state, ok", [(State.RUNNING, True), (State.GROWING, True),
                                       (State.STALLED, False), (State.FORKING, False),
                                       (State.READY, False)])
def test_only_a_plainly_running_sequence_is_planned_ahead(state, ok):
    seq = Seq(1, msgs.header("r", "t", SamplingParams(max_tokens=10), 0), 3, [1, 2, 3], [],
              frozenset(), state=state)
    assert seq.may_plan_ahead(100)                       # in no step: always
    seq.in_flight.append(InFlight(1, 3, 1))
    assert seq.may_plan_ahead(100) is ok


def test_a_chunk_in_flight_that_samples_nothing_never_holds_the_next_back():
    seq = Seq(1, msgs.header("r", "t", SamplingParams(max_tokens=1, n=3), 0), 30,
              list(range(30)), [], frozenset(), state=State.RUNNING)
    seq.in_flight.append(InFlight(1, 16, 0))
    assert seq.may_plan_ahead(31) and seq.todo == 14


# ---------------------------------------------------------------- ends while in flight

def test_the_sample_after_an_eos_is_discarded_and_the_free_goes_out_at_once():
    core, kv = make(), Kv()
    p1 = started(core, kv, admitted("a", 10, eos=(2,)), admitted("b", 3, tenant="t2", base=50))
    p2 = core.schedule()
    assert p2.steps == [SeqStep(1, 1, [], True), SeqStep(2, 1, [], True)]
    out = core.on_result(result(p1, {1: 2, 2: 7}))       # a samples its EOS
    assert out.tokens[0] == TokenOut("a", [2], DetokParams((), True, 10, 0), "stop",
                                     Usage(10, 1, 0), out.tokens[0].timing)
    assert out.released == ["a"]
    # p2 still names a: its free goes out all the same, with what p1 computed (p2 writes
    # at position 10 and past, in no block the prefix cache gets)
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 10)], [])
    p3 = core.schedule()
    assert p3 == StepPlan(3, [], [SeqStep(2, 1, [], True)], [1])   # dropped after p2 ran
    served = core.vtc.of("t1")
    out = core.on_result(result(p2, {1: 9, 2: 8}))
    assert out.tokens == [TokenOut("b", [8])]            # a's sample: not emitted,
    assert core.vtc.of("t1") == served                   # not charged
    assert core.discarded_samples == 1
    assert core.take_kv_ops() is None                    # nothing waited for p2


def test_a_follow_up_turn_right_after_the_last_token_hits_the_prefix_cache():
    """The free of a sequence that ends while a step naming it is in flight is sent in the
    step it ends, so the same tenant's next turn, arriving before that step answers, is
    granted the finished turn's computed blocks."""
    core, kv = make(), Kv()
    p1 = started(core, kv, admitted("a", 17, max_tokens=2), admitted("b", 3, tenant="t2",
                                                                     base=50))
    p2 = core.schedule()
    assert [s.seq_id for s in p2.steps] == [1, 2]        # a's second (last) token
    core.on_result(result(p1, {1: 5, 2: 6}))
    kv.settle(core)
    p3 = core.schedule()
    assert [s.seq_id for s in p3.steps] == [2]           # a sits out: p2 samples its last
    out = core.on_result(result(p2, {1: 7, 2: 8}))       # a ends; p3 (names b) in flight
    assert out.released == ["a"] and out.tokens[0].finish_reason == "length"
    turn = list(range(100, 117)) + [5, 7, 300, 301, 302]  # a's prompt, its reply, more
    core.add(msgs.admitted("a2", "t1", turn, block_hashes(turn, BS, "t1", "m"),
                      SamplingParams(max_tokens=1), next(_clock), ()))
    ops = core.take_kv_ops()                             # p3 has not answered
    assert ops.frees == [FreeRequest(1, 18)]             # a's 18 computed tokens
    grants = apply_ops(kv.pool, ops)                     # frees are applied before leases
    assert [g.num_cached_tokens for g in grants if g.seq_id == 3] == [16]
    core.on_grants(grants)
    core.on_result(result(p3, {2: 9}))
    p4 = core.schedule()
    assert p4.drop == [1]
    assert [(n.seq_id, n.num_computed) for n in p4.new_seqs] == [(3, 16)]
    assert core.by_request["a2"].cached_tokens == 16


def test_a_cancelled_sequence_in_two_steps_is_freed_at_once():
    core, kv = make(lookahead=8), Kv()
    p1 = started(core, kv, admitted("a", 12), admitted("b", 3, tenant="t2", base=50))
    p2 = core.schedule()
    assert [s.seq_id for s in p2.steps] == [1, 2]
    growth = core.take_kv_ops()                          # a's growth, asked ahead
    assert 1 in [al.seq_id for al in growth.allocs]
    out = core.cancel("a")
    assert out.released == ["a"] and core.by_seq[1].state is State.CLOSING
    # cancelled before any step of it answered: nothing computed, nothing cached
    frees = core.take_kv_ops()
    assert frees == KvOps(EPOCH, [FreeRequest(1, 0)], [])
    core.on_grants(apply_ops(kv.pool, growth))           # the growth grant comes back late
    apply_ops(kv.pool, frees)
    assert core.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 0)], [])   # harmless repeat
    core.on_result(result(p1, {1: 5, 2: 6}))
    assert core.take_kv_ops() is None                    # nothing waited for p1 or p2
    p3 = core.schedule()
    assert p3.drop == [1] and [s.seq_id for s in p3.steps] == [2]
    core.on_result(result(p2, {1: 7, 2: 8}))
    assert core.take_kv_ops() is None and core.discarded_samples == 2
    assert kv.pool.blocks_of(1) == [] and core.by_seq.keys() == {2}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_victim_in_steps_in_flight_gives_its_blocks_back_at_once(mode):
    core, kv = make(num_cpu_blocks=8, preemption_mode=mode), Kv(16, num_cpu_blocks=8)
    core.on_executor(1, 1e5)
    p1 = started(core, kv, admitted("a", 10), admitted("b", 3, base=50))
    p2 = core.schedule()
    core.on_result(result(p1, {1: 5, 2: 6}))
    p3 = core.schedule()
    b = core.by_request["b"]
    assert [s.seq_id for s in p2.steps] == [s.seq_id for s in p3.steps] == [1, 2]
    core.preemptor.preempt(b, "test")                    # b is in p2 and p3
    ops = core.take_kv_ops()                             # sent now, p2 and p3 in flight
    grants = apply_ops(kv.pool, ops)
    core.on_grants(grants, kv.pool.num_cpu_free)
    if mode == "recompute":                              # p1 computed its 3 tokens
        assert ops == KvOps(EPOCH, [FreeRequest(2, 3)], [])
        assert b.seq_id == 3 and b.state is State.WAITING
    else:
        assert ops.frees == [] and ops.swap_outs == [SwapOutRequest(2, 3)]
        assert b.state is State.SWAPPED
        (swap,) = [g for g in grants if g.kind == "swap_out"]
        assert len(swap.copies) == 1                     # its one block, to the host tier
    core.on_result(result(p2, {1: 7, 2: 8}))
    assert b.token_ids == list(range(50, 53)) + [6]      # p2's and p3's samples discarded
    p4 = core.schedule()                                 # planned after p3: the executor
    assert 2 in p4.drop                                  # runs it, and its copies, after p3
    if mode == "swap":
        assert p4.copies == swap.copies                  # done before p4's forward
    core.on_result(result(p3, {1: 9, 2: 10}))
    assert core.discarded_samples == 2


# ---------------------------------------------------------------- failure

@pytest.mark.parametrize("kv_lost", [False, True])
def test_a_reset_discards_the_steps_in_flight_and_frees_what_was_held(kv_lost):
    core, kv = make(), Kv()
    p1 = started(core, kv, admitted("a", 10), admitted("b", 3, base=50))
    p2 = core.schedule()
    core.cancel("a")                                     # its free is queued at once
    out = core.reset(kv_lost)
    assert sorted(out.released) == ["b"] and core.in_flight == {}
    ops = core.take_kv_ops()
    if kv_lost:
        assert ops is None                               # the pool is gone
    else:                                                # nothing cached: the KV is void
        assert sorted(ops.frees, key=lambda f: f.seq_id) == [FreeRequest(1, 0),
                                                             FreeRequest(2, 0)]
    for plan in (p1, p2):                                # late results are ignored
        assert core.on_result(result(plan, {1: 5, 2: 6})).tokens == []
    assert core.discarded_samples == 0 and core.take_kv_ops() is None


# ---------------------------------------------------------------- the loop

def loop_of(depth: int) -> tuple[SchedulerLoop, BlockPool]:
    config = WeirConfig(Topology(run_dir="/nonexistent"), engine=EngineConfig(max_model_len=64),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                                  lookahead_tokens=1, chunking="fixed",
                                                  async_depth=depth),
                        kv=KvConfig(block_size=BS, num_blocks=16, num_cpu_blocks=0))
    return SchedulerLoop(config, epoch=EPOCH), BlockPool(16, BS, True, 0)


def deliver(loop: SchedulerLoop, pool: BlockPool, msg, ms: float):
    """Hand ``msg`` to the loop at ``ms`` (both clocks); settle its KV round trips. Returns
    the plans it sent and the StepDone notes it left."""
    plans, done, pending = [], [], [msg]
    while pending:
        for to, out in loop.handle(pending.pop(0), int(ms * 1e6), int(ms * 1e6)):
            if to == "executor":
                plans.append(out)
            elif to == "kv_manager" and isinstance(out, KvOps):
                pending.append(KvGrants(apply_ops(pool, out), pool.num_free, 0))
        done += loop.finished
    return plans, done


def test_a_steps_time_runs_from_when_the_executor_could_start_it():
    loop, pool = loop_of(2)
    plans, _ = deliver(loop, pool, admitted("a", 10), 0.0)
    assert [p.step_id for p in plans] == [1, 2]          # both sent at 0 ms
    samples = {}
    for step, at_ms in ((1, 10.0), (2, 25.0), (3, 40.0)):
        plan = next(p for p in plans if p.step_id == step)
        new, done = deliver(loop, pool, result(plan, {1: 100 + step}), at_ms)
        plans += new
        assert [d.step_id for d in done] == [step]       # one note per step
        samples[step] = done[0].measured_s
    # 1: sent at 0, answered at 10. 2: sent at 0, but the executor was busy with 1 until 10.
    # 3: sent at 10 (after 1's result), started when 2 was done (25)
    assert samples == pytest.approx({1: 0.010, 2: 0.015, 3: 0.015})
    assert list(loop.core.cost._y) == pytest.approx([0.010, 0.015, 0.015])
    assert loop.last_step_s == pytest.approx(0.015)


def test_at_depth_one_a_steps_time_is_plan_sent_to_result():
    loop, pool = loop_of(1)
    plans, _ = deliver(loop, pool, admitted("a", 10), 0.0)
    assert [p.step_id for p in plans] == [1]
    new, done = deliver(loop, pool, result(plans[0], {1: 5}), 10.0)
    assert [p.step_id for p in new] == [2]
    _, done2 = deliver(loop, pool, result(new[0], {1: 6}), 25.0)
    assert [d.measured_s for d in done + done2] == pytest.approx([0.010, 0.015])


def test_a_step_note_stays_local_and_lasts_one_call():
    """A step's StepDone is a local note: never among the sends, which all go to peers; the
    loop's ``finished`` holds the notes of its last call only."""
    loop, pool = loop_of(1)
    plans, _ = deliver(loop, pool, admitted("a", 10), 0.0)
    sends = loop.handle(result(plans[0], {1: 5}), 10_000_000, 10_000_000)
    assert {to for to, _ in sends} <= {"executor", "kv_manager", "detokenizer", "admission",
                                        "streamer"}
    assert not [m for _, m in sends if isinstance(m, StepDone)]
    assert [(d.step_id, d.measured_s) for d in loop.finished] == [(1, pytest.approx(0.010))]
    loop.handle(CancelRequest("a", "client"), 11_000_000, 11_000_000)   # no step answered
    assert loop.finished == []


def test_a_failed_step_fails_everything_and_the_other_step_in_flight_is_ignored():
    loop, pool = loop_of(2)
    plans, _ = deliver(loop, pool, admitted("a", 10), 0.0)
    sends = loop.handle(StepResult(1, [], [], 0, True), 1, 1)
    assert any(isinstance(m, EventBatch) for _, m in sends)
    assert any(isinstance(m, Released) and m.request_ids == ["a"] for _, m in sends)
    assert loop.core.in_flight == {} and loop.steps == {}
    assert loop.handle(result(plans[1], {1: 5}), 2, 2) == []     # no StepDone, nothing


def test_structured_output_past_its_limits_fails_that_request_alone():
    """The executor says a's language failed in step 1: a ends ``failed`` with the reason,
    its sample there is not emitted, its blocks and admission's count are released; b
    runs on; step 2 (planned with a) is taken, and a's error in it changes nothing."""
    loop, pool = loop_of(2)
    plans, _ = deliver(loop, pool, admitted("a", 10), 0.0)
    more, _ = deliver(loop, pool, admitted("b", 10, base=300), 0.5)
    plans += more
    a = loop.core.by_request["a"].seq_id
    first = plans[0]
    why = "lexer error: too many expressions constructed"
    res = result(first, {a: 7})
    sends = loop.handle(msgspec.structs.replace(res, structured_errors=[(a, why)]), 1, 1)
    failed = [e for _, m in sends if isinstance(m, EventBatch) for e in m.events]
    assert failed == [Failed("a", f"structured_output_error: {why}")]
    assert [m.request_ids for _, m in sends if isinstance(m, Released)] == [["a"]]
    assert not [t for _, m in sends if isinstance(m, TokenBatch) for t in m.tokens
                if t.request_id == "a"]
    assert "a" not in loop.core.by_request and "b" in loop.core.by_request
    assert [f.seq_id for _, m in sends if isinstance(m, KvOps) for f in m.frees] == [a]
    second = next(p for p in plans if p.step_id == 2)
    res = result(second, {st.seq_id: 8 for st in second.steps if st.sample})
    sends = loop.handle(msgspec.structs.replace(res, structured_errors=[(a, why)]), 2, 2)
    assert not [m for _, m in sends if isinstance(m, EventBatch)]      # one terminal only
    assert "b" in loop.core.by_request


def test_a_result_out_of_order_fails_everything():
    loop, pool = loop_of(2)
    plans, _ = deliver(loop, pool, admitted("a", 10), 0.0)
    sends = loop.handle(result(plans[1], {1: 5}), 1, 1)
    assert any(isinstance(m, Released) for _, m in sends)
    assert loop.core.in_flight == {} and not loop.core.has_work


def test_the_tracer_keeps_one_span_per_step_in_flight(monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from components.scheduler import step_trace

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(step_trace, "_TRACER", provider.get_tracer("test"))
    loop, pool = loop_of(2)
    trace = step_trace.StepTracer(loop, 32)
    plans, _ = deliver(loop, pool, admitted("a", 10), 0.0)
    for plan in plans:                                   # sent together: both open
        trace.planned(plan)
    for plan, at_ms in zip(plans, (10.0, 25.0)):
        new, done = deliver(loop, pool, result(plan, {1: 5}), at_ms)
        for p in new:
            trace.planned(p)
        trace.finished_step(done[0])
    spans = [s for s in exporter.get_finished_spans() if s.name == "scheduler.step"]
    steps = {s.attributes["weir.step.id"]: s.attributes for s in spans}
    assert sorted(steps) == [1, 2]                       # step 3 is still in flight
    assert steps[1]["weir.step.num_prefill"] == 1 and steps[1]["weir.step.in_flight_before"] == 0
    assert steps[2]["weir.step.num_decode"] == 1 and steps[2]["weir.step.in_flight_before"] == 1
    assert steps[2]["weir.step.measured_ms"] == pytest.approx(15.0)
    prefill = [s for s in exporter.get_finished_spans() if s.name == "prefill"]
    assert [s.attributes["weir.step.id"] for s in prefill] == [1]


def test_auto_depth_overlaps_only_when_the_executor_leaves_a_core_free():
    from components.scheduler.loop import async_depth
    from schemas.config import EngineConfig, Topology, WeirConfig

    def cfg(threads: int, depth: int = 0) -> WeirConfig:
        return WeirConfig(Topology(run_dir="/nonexistent"),
                          engine=EngineConfig(num_threads=threads),
                          scheduler=SchedulerConfig(async_depth=depth))
    assert async_depth(cfg(0), cpus=2, cores=2) == 1   # the executor takes every core
    assert async_depth(cfg(2), cpus=2, cores=2) == 1
    assert async_depth(cfg(7), cpus=8, cores=8) == 2   # one core left for planning
    assert async_depth(cfg(0), cpus=16, cores=8) == 2  # SMT: a thread per core, siblings free
    assert async_depth(cfg(16), cpus=16, cores=8) == 1
    assert async_depth(cfg(0, depth=2), cpus=2, cores=2) == 2  # as configured
    assert async_depth(cfg(7, depth=1), cpus=8, cores=8) == 1
