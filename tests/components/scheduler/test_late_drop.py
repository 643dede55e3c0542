"""Late work is dropped (issue 44): a request whose class drops late work and whose TTFT
deadline passes before its first token ends ``deadline_expired`` at the first message
after the deadline, waiting or mid-prefill; its KV comes back and no later plan computes
for it. A ``keep`` request is served late; one whose first token came in time is not
touched. A request with an end-to-end bound ends at the first message past it, wherever
it is: decoding, each choice finishes ``deadline`` with its usage; with no first token,
``deadline_expired`` (whatever its class's late rule). Exact inputs on ``SchedulerLoop``,
both clocks in milliseconds."""
from __future__ import annotations

from components.kv_manager.ops import apply_ops
from components.kv_manager.pool import BlockPool
from components.model.hashing import block_hashes
from components.scheduler.loop import SchedulerLoop
from schemas.config import EngineConfig, KvConfig, SchedulerConfig, Topology, WeirConfig
from schemas.wire import (
    Admitted,
    ForgetRequest,
    KvGrants,
    KvOps,
    Rejected,
    Released,
    RequestTiming,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenBatch,
    TokenOut,
    Usage,
)
from tests import messages as msgs

BS = 8
MS = 1_000_000


def loop_of() -> tuple[SchedulerLoop, BlockPool]:
    config = WeirConfig(Topology(run_dir="/nonexistent"), engine=EngineConfig(max_model_len=256),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                                  lookahead_tokens=1, chunking="fixed",
                                                  async_depth=1),
                        kv=KvConfig(block_size=BS, num_blocks=32, num_cpu_blocks=0))
    return SchedulerLoop(config, epoch=1), BlockPool(32, BS, True, 0)


def admitted(rid: str, n_tokens: int, deadline_ms: int | None = None, drop: bool = False,
             base: int = 100, max_tokens: int = 50, e2e_ms: int | None = None,
             n: int = 1, arrival_ms: int = 0) -> Admitted:
    toks = list(range(base, base + n_tokens))
    return msgs.admitted(rid, "t1", toks, block_hashes(toks, BS, "t1", "m"),
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n),
                    arrival_ms * MS, (), deadline_ms, e2e_deadline_ms=e2e_ms,
                    drop_late=drop)


class Run:
    """Messages in, at given milliseconds; every send kept; KV settled by a real pool."""

    def __init__(self) -> None:
        self.loop, self.pool = loop_of()
        self.plans: list[StepPlan] = []
        self.streamer: list = []
        self.released: list[str] = []
        self.outputs: list[TokenOut] = []           # to the detokenizer
        self.forgotten: list[str] = []
        self.output_tokens: dict[str, int] = {}     # Released.output_tokens

    def at(self, ms: float, msg) -> None:
        pending = [msg]
        while pending:
            for to, out in self.loop.handle(pending.pop(0), int(ms * MS), int(ms * MS)):
                if to == "executor":
                    self.plans.append(out)
                elif to == "kv_manager" and isinstance(out, KvOps):
                    pending.append(KvGrants(apply_ops(self.pool, out), self.pool.num_free, 0))
                elif to == "streamer":
                    self.streamer += out.events
                elif to == "admission" and isinstance(out, Released):
                    self.released += out.request_ids
                    self.output_tokens.update(out.output_tokens)
                elif to == "detokenizer" and isinstance(out, TokenBatch):
                    self.outputs += out.items
                elif to == "detokenizer" and isinstance(out, ForgetRequest):
                    self.forgotten.append(out.request_id)

    def answer(self, ms: float) -> None:
        """The executor answers the newest plan: token 7 for every sampling row."""
        plan = self.plans[-1]
        ids = [st.seq_id for st in plan.steps if st.sample for _ in range(st.num_samples)]
        self.at(ms, StepResult(plan.step_id, ids, [7] * len(ids), 1))

    def seq_of(self, rid: str) -> int:
        return self.loop.core.by_request[rid].seq_id

    def rows(self, plan: StepPlan) -> set[int]:
        return {st.seq_id for st in plan.steps}


def test_a_late_request_is_dropped_mid_prefill_and_never_computed_again():
    run = Run()
    run.at(0, admitted("busy", 24, max_tokens=40, base=1000))      # holds most of each step
    run.at(0, admitted("late", 96, deadline_ms=50, drop=True))
    late = run.seq_of("late")
    for ms in (20, 40):                                  # prefill chunks of "late" go out
        run.answer(ms)
    assert late in set().union(*map(run.rows, run.plans))
    assert run.loop.core.by_request["late"].num_computed > 0      # mid-prefill
    run.answer(60)                                       # the first message past 50 ms
    [rej] = [e for e in run.streamer if isinstance(e, Rejected)]
    assert rej.request_id == "late" and rej.reason == "deadline_expired"
    assert "mid-prefill" in rej.message and "50 ms" in rej.message
    assert "late" in run.released and "late" not in run.loop.core.by_request
    planned_after = len(run.plans)
    for ms in range(80, 2000, 20):                       # "busy" runs to its end
        if "busy" not in run.loop.core.by_request:
            break
        run.answer(ms)
    assert all(late not in run.rows(p) for p in run.plans[planned_after:])
    assert run.pool.num_free == 32                       # every block came back
    assert run.loop.dropped_late == 1


def test_a_request_waiting_behind_the_batch_is_dropped_before_prefill():
    run = Run()
    for i in range(4):                                   # max_num_seqs: every slot taken
        run.at(0, admitted(f"busy{i}", 8, max_tokens=30, base=1000 + 100 * i))
    run.answer(10)
    busy = {run.seq_of(f"busy{i}") for i in range(4)}
    run.at(10, admitted("late", 16, deadline_ms=30, drop=True))
    for ms in (20, 30, 40):
        run.answer(ms)
    [rej] = [e for e in run.streamer if isinstance(e, Rejected)]
    assert rej.request_id == "late" and "before prefill" in rej.message
    assert all(st.seq_id in busy for p in run.plans for st in p.steps)   # it never ran
    assert "late" in run.released


def test_a_keep_request_is_served_late():
    run = Run()
    run.at(0, admitted("busy", 24, max_tokens=40, base=1000))
    run.at(0, admitted("batch", 96, deadline_ms=50, drop=False, max_tokens=2))
    for ms in range(20, 3000, 20):
        if "batch" not in run.loop.core.by_request:
            break
        run.answer(ms)
    assert not [e for e in run.streamer if isinstance(e, Rejected)]
    assert "batch" in run.released and run.loop.dropped_late == 0


def test_a_request_whose_first_token_came_in_time_is_not_dropped():
    run = Run()
    run.at(0, admitted("fast", 8, deadline_ms=30, drop=True, max_tokens=20))
    run.answer(10)                                       # its first token, at 10 ms
    for ms in range(40, 1000, 20):
        if "fast" not in run.loop.core.by_request:
            break
        run.answer(ms)
    assert not [e for e in run.streamer if isinstance(e, Rejected)]
    assert run.loop.dropped_late == 0 and not run.loop.late


def test_the_check_looks_only_at_the_requests_due():
    """Each message pops only the heap's due head: 1,000 requests with later deadlines
    stay untouched (no scan of the queue on the step path)."""
    run = Run()
    for i in range(1000):
        run.at(0, admitted(f"r{i}", 8, deadline_ms=10_000 + i, drop=True, base=i * 10))
    assert len(run.loop.late) == 1000
    run.at(5_000, admitted("x", 8))
    assert len(run.loop.late) == 1000 and not run.streamer


# ------------------------------------------------------------------ the end-to-end bound
def ends(run: Run, rid: str) -> list[TokenOut]:
    return [t for t in run.outputs if t.request_id == rid and t.finish_reason is not None]


def test_a_decoding_request_finishes_deadline_at_its_bound_with_its_usage():
    run = Run()
    run.at(5, admitted("long", 8, max_tokens=1000, e2e_ms=100))      # arrived at 0
    for ms in range(10, 100, 10):                        # its first token at 10, then one a step
        run.answer(ms)
    assert not ends(run, "long") and len(run.plans) == 10
    run.answer(100)                                      # its 10th token, and its bound
    [end] = ends(run, "long")
    assert end == TokenOut("long", [], None, "deadline", Usage(8, 10, 0),
                           RequestTiming(0.005, 0.005, 0.09, 0, 0.005), 0)
    assert run.outputs[-2].token_ids == [7] and run.outputs[-1] is end
    assert sum(len(t.token_ids) for t in run.outputs) == 10
    assert run.released == ["long"] and run.output_tokens == {"long": 10}
    assert "long" not in run.loop.core.by_request and not run.loop.core.has_work
    assert len(run.plans) == 10                          # nothing planned for it after
    assert run.pool.num_free == 32                       # every block came back
    assert not run.streamer and not run.forgotten        # its end is a finish, not a drop
    assert (run.loop.finished_at_deadline, run.loop.dropped_late) == (1, 0)


def test_every_open_choice_finishes_deadline_with_what_it_streamed():
    run = Run()
    run.at(0, admitted("pair", 8, max_tokens=100, e2e_ms=50, n=2))
    for ms in range(10, 60, 10):
        run.answer(ms)
    finals = ends(run, "pair")
    assert [(t.index, t.finish_reason, t.token_ids) for t in finals] == \
        [(0, "deadline", []), (1, "deadline", [])]
    # choice 0 sampled at 10 .. 50 ms; choice 1 forked from its first sample, then waited a
    # step for the fork's grant
    assert [t.usage for t in finals] == [Usage(8, 5, 0), Usage(8, 3, 0)]
    assert [sum(len(o.token_ids) for o in run.outputs if o.index == i) for i in (0, 1)] == [5, 3]
    assert run.released == ["pair"] and run.pool.num_free == 32
    planned = len(run.plans)
    run.at(100, admitted("next", 8, max_tokens=2, base=500))
    for ms in (110, 120):
        run.answer(ms)
    pair = {s.seq_id for s in run.loop.core.by_seq.values() if s.request_id == "pair"}
    assert not pair and all(
        run.loop.core.by_seq.get(st.seq_id) is None or
        run.loop.core.by_seq[st.seq_id].request_id == "next"
        for p in run.plans[planned:] for st in p.steps)


def test_a_waiting_request_with_no_first_token_ends_deadline_expired_at_its_bound():
    """Whatever its class's late rule: a ``keep`` request is ended at its bound too."""
    run = Run()
    for i in range(4):                                   # max_num_seqs: every slot taken
        run.at(0, admitted(f"busy{i}", 8, max_tokens=30, base=1000 + 100 * i))
    run.answer(10)
    run.at(10, admitted("late", 16, drop=False, e2e_ms=30, arrival_ms=10))
    for ms in (20, 30, 40):
        run.answer(ms)
    [rej] = [e for e in run.streamer if isinstance(e, Rejected)]
    assert rej == Rejected("late", "deadline_expired", "no first token within its end-to-end "
                           "deadline of 30 ms (dropped before prefill, 30 ms after arrival)")
    assert not ends(run, "late") and "late" in run.released
    late_seq = [st.seq_id for p in run.plans for st in p.steps
                if st.seq_id not in {run.seq_of(f"busy{i}") for i in range(4)}]
    assert not late_seq                                  # it never ran
    assert (run.loop.dropped_late, run.loop.finished_at_deadline) == (1, 0)


def test_a_request_done_before_its_bound_is_let_go_and_its_id_reused_is_not_ended():
    run = Run()
    run.at(0, admitted("quick", 8, max_tokens=2, e2e_ms=100))
    run.answer(10)
    run.answer(20)                                       # 2 tokens: length, at 20 ms
    run.at(30, admitted("quick", 8, max_tokens=12, base=500, arrival_ms=30))   # no bound
    for ms in range(40, 200, 10):                        # past 100 ms: the old entry is due
        if "quick" not in run.loop.core.by_request:
            break
        run.answer(ms)
    assert [t.finish_reason for t in ends(run, "quick")] == ["length", "length"]
    assert ends(run, "quick")[1].usage.completion_tokens == 12
    assert run.loop.finished_at_deadline == 0 and not run.streamer
