"""The simulator: production cores on a virtual clock, exact on hand-built traces, and
deterministic."""
from __future__ import annotations

import msgspec
import pytest

from components.admission.policy import AdmissionPolicy
from components.kv_manager.pool import BlockPool
from components.scheduler.core import SchedulerCore
from schemas.config import load_config
from weir.replay.profile import CostProfile
from weir.replay.report import summarize
from weir.replay.sim import Simulator, fast_block_hashes
from weir.replay.synth import TokenSynth
from weir.replay.types import CANCELLED, COMPLETED, REJECTED, Scaling, Slo, TraceRequest

STEP_S = 0.010
FLAT = CostProfile(coef=[STEP_S, 0.0, 0.0, 0.0, 0.0])          # every step 10 ms


def config(**sections):
    """A config for the simulator's own mechanics: the FCFS baseline with one class and no
    objective, unless a test names its admission (the SLO-first classes would drop or refuse
    the requests these tests follow)."""
    sections.setdefault("admission", {"policy": "fcfs", "classes": []})
    # plain decoding: speculation's verifies (test_sim_speculation.py) change the step times
    sections.setdefault("speculative", {"method": "off"})
    return load_config(None, topology={"run_dir": "/nonexistent"}, **sections)


def simulate(requests, cfg=None, profile=FLAT, block=32):
    cfg = cfg or config()
    synth = TokenSynth(range(1000, 5000), block, seed=7)
    sim = Simulator(cfg, profile, label="t", tokens=synth.tokens,
                    hashes=fast_block_hashes(cfg.kv.block_size))
    return sim, sim.run(requests, Scaling(block_size=block))


def req(i, t, n_in=20, n_out=5, **kw):
    return TraceRequest(index=i, arrival_s=t, input_tokens=n_in, output_tokens=n_out, **kw)


def test_the_cores_are_the_production_classes():
    sim, _ = simulate([req(0, 0.0)])
    assert type(sim.core) is SchedulerCore
    assert type(sim.pool) is BlockPool
    assert type(sim.policy) is AdmissionPolicy


def test_one_request_exact_times():
    _, run = simulate([req(0, 1.0)])
    (rec,) = run.records
    assert rec.terminal == COMPLETED and rec.finish_reason == "length"
    assert rec.arrival_s == 1.0 and rec.prompt_tokens == 20 and rec.output_tokens == 5
    # step 1 prefills all 20 tokens and samples the first token; then one step per token
    assert rec.ttft_s == pytest.approx(STEP_S)
    assert rec.itl_s == pytest.approx([STEP_S] * 4)
    assert rec.e2e_s == pytest.approx(5 * STEP_S)
    assert rec.queue_s == pytest.approx(0.0)
    assert run.duration_s == pytest.approx(5 * STEP_S)


def test_step_time_follows_the_profile_shape():
    # 1 ms per token: a 200-token prefill step takes 200 ms, a 1-token decode step 1 ms
    prof = CostProfile(coef=[0.0, 0.001, 0.0, 0.0, 0.0])
    _, run = simulate([req(0, 0.0, n_in=200, n_out=3)], profile=prof)
    (rec,) = run.records
    assert rec.ttft_s == pytest.approx(0.200)
    assert rec.itl_s == pytest.approx([0.001, 0.001])


def test_a_chunked_prompt_takes_budget_sized_steps():
    cfg = config(scheduler={"max_num_batched_tokens": 64})
    _, run = simulate([req(0, 0.0, n_in=200, n_out=2)], cfg=cfg)
    assert run.records[0].ttft_s == pytest.approx(4 * STEP_S)    # 64 + 64 + 64 + 8


def test_over_the_cap_is_rejected_with_the_reason():
    cfg = config(admission={"max_outstanding": 2})
    _, run = simulate([req(i, 0.0) for i in range(5)], cfg=cfg)
    terminals = [r.terminal for r in run.records]
    assert terminals == [COMPLETED, COMPLETED, REJECTED, REJECTED, REJECTED]
    assert {r.reason for r in run.records[2:]} == {"overloaded"}
    assert all(r.decision == "reject" and r.ttft_s is None for r in run.records[2:])


def test_an_unknown_tenant_is_rejected():
    _, run = simulate([req(0, 0.0, tenant="nobody")])
    assert run.records[0].terminal == REJECTED and run.records[0].reason == "unknown_tenant"


def test_invalid_parameters_are_refused_at_the_edge_as_the_streamer_refuses_them():
    # n past MAX_N (16): the streamer's check_submit refuses it live; admission no longer
    # checks parameters again, so the simulator refuses it where the streamer would
    _, run = simulate([req(0, 0.0, n=17), req(1, 0.0, n=2)],
                      cfg=config(scheduler={"max_num_seqs": 32}))
    bad, good = run.records
    assert (bad.terminal, bad.decision, bad.reason, bad.e2e_s) == \
        (REJECTED, "reject", "invalid_request", 0.0)
    assert good.terminal == COMPLETED


def test_shared_hash_ids_hit_the_prefix_cache():
    # two 96-token prompts sharing two 32-token trace blocks; the second arrives after the
    # first finished, so its first 64 tokens (4 KV blocks of 16) are cached
    a = req(0, 0.0, n_in=96, n_out=2, hash_ids=(1, 2, 3))
    b = req(1, 1.0, n_in=96, n_out=2, hash_ids=(1, 2, 4))
    _, run = simulate([a, b])
    assert [r.cached_tokens for r in run.records] == [0, 64]


def test_cancel_after_ends_the_request_as_cancelled():
    _, run = simulate([req(0, 0.0, n_out=100, cancel_after_s=0.055)])
    rec = run.records[0]
    assert rec.terminal == CANCELLED
    assert rec.e2e_s == pytest.approx(0.055)
    assert 1 <= rec.output_tokens <= 6


def test_same_inputs_same_results():
    reqs = [req(i, i * 0.013, n_in=50 + 37 * (i % 7), n_out=5 + 60 * (i % 4),
                hash_ids=(i % 3, 100 + i)) for i in range(60)]
    cfg = config(kv={"num_blocks": 64}, scheduler={"max_num_batched_tokens": 128},
                 engine={"max_model_len": 1024})
    prof = CostProfile(coef=[0.004, 2e-5, 1e-8, 1e-4, 1e-6])
    first = msgspec.json.encode(simulate(reqs, cfg, prof)[1].records)
    again = msgspec.json.encode(simulate(reqs, cfg, prof)[1].records)
    assert first == again
    run = simulate(reqs, cfg, prof)[1]
    assert all(r.terminal == COMPLETED for r in run.records)
    assert sum(r.preemptions for r in run.records) == run.meta["preemptions"] > 0


def test_fast_hashes_chain_over_the_prefix_and_the_scope():
    h = fast_block_hashes(4)
    a = h(list(range(10)), "t1")
    assert len(a) == 2
    assert h(list(range(8)) + [99, 98], "t1") == a                # only full blocks count
    assert h([0, 1, 2, 3, 9, 9, 9, 9], "t1")[0] == a[0]
    assert h([0, 1, 2, 3, 9, 9, 9, 9], "t1")[1] != a[1]
    assert h(list(range(10)), "t2")[0] != a[0]                     # scoped per tenant


def test_queue_time_is_arrival_to_first_scheduled_and_only_for_started_requests():
    # one at a time (max_num_seqs 1): r1 waits for r0's 5 steps; r2 is cancelled while
    # still waiting, r3 after it started but before its first token (a 2-step prefill)
    cfg = config(scheduler={"max_num_seqs": 1, "max_num_batched_tokens": 64})
    _, run = simulate([req(0, 0.0), req(1, 0.0), req(2, 0.0, cancel_after_s=0.065),
                       req(3, 0.2, n_in=100, cancel_after_s=0.015)], cfg=cfg)
    r0, r1, r2, r3 = run.records
    assert r0.queue_s == pytest.approx(0.0) and r1.queue_s == pytest.approx(5 * STEP_S)
    assert r2.terminal == CANCELLED and r2.queue_s is None          # never started
    assert r3.terminal == CANCELLED and r3.ttft_s is None
    assert r3.queue_s == pytest.approx(0.0)                          # started at once


def test_busy_and_idle_time_cover_the_run():
    _, run = simulate([req(0, 1.0), req(1, 2.0, n_out=3)])
    assert run.meta["busy_s"] == pytest.approx(8 * STEP_S)
    assert run.meta["max_step_s"] == pytest.approx(STEP_S)
    assert run.meta["max_step_seqs"] == 1
    idle = run.meta["idle_intervals"]
    assert idle[:2] == [pytest.approx((0.0, 1.0)), pytest.approx((1.0 + 5 * STEP_S, 2.0))]
    assert all(end > start for start, end in idle)


# ------------------------------------------------------------------ late work dropped
class Recording(Simulator):
    """A simulator that keeps every plan with the virtual time it started, and each
    admitted request's sequence id."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plans: list[tuple[float, object]] = []
        self.seq_ids: dict[str, int] = {}

    def _start(self, tok, d, waited_s=0.0) -> None:
        super()._start(tok, d, waited_s)
        self.seq_ids[tok.request_id] = self.core.by_request[tok.request_id].seq_id

    def _start_step(self, plan) -> None:
        self.plans.append((self.now / 1e9, plan))
        super()._start_step(plan)


@pytest.mark.parametrize("late", ["drop", "keep"])
def test_a_late_request_behind_a_backlog_is_dropped_as_live(late):
    """The SLO-first engine (deadline admission), scheduling in arrival order, 64 tokens a
    10 ms step: four batch prompts of 1,400 tokens (5,600: 87.5 steps), then an
    interactive one of 1,000 with its own 1 s deadline, all at once (before the first
    load report: admission has no rates, so nothing is refused). It starts at 0.875 s
    and is mid-prefill at its deadline: the scheduler's late drop ends it
    ``deadline_expired`` at the first step result past it, exactly 1 s, and no step
    planned from then computes for it. The live replay records that Rejected after
    Accepted as a rejection with its reason, ended when it came; so does the simulator.
    A class that keeps late work is served late instead."""
    classes = [{"name": "interactive", "priority": 0, "ttft_slo_ms": 3000.0, "late": late},
               {"name": "batch", "priority": 1, "max_queue_ms": 60_000.0, "late": "keep"}]
    cfg = config(admission={"policy": "deadline", "classes": classes},
                 scheduler={"fairness": "fcfs", "chunking": "fixed",
                            "max_num_batched_tokens": 64},
                 kv={"num_blocks": 1024}, engine={"max_model_len": 4096})
    trace = [req(i, 0.0, n_in=1400, n_out=1, service_class="batch") for i in range(4)]
    trace.append(req(4, 0.0, n_in=1000, n_out=4, deadline_ms=1000))
    synth = TokenSynth(range(1000, 5000), 32, seed=7)
    sim = Recording(cfg, FLAT, label="t", tokens=synth.tokens,
                    hashes=fast_block_hashes(cfg.kv.block_size))
    run = sim.run(trace, Scaling(block_size=32))
    *backlog, rec = run.records
    assert all(r.terminal == COMPLETED for r in backlog)
    late_seq = sim.seq_ids["r4"]
    computed = [(t, st.num_tokens) for t, plan in sim.plans for st in plan.steps
                if st.seq_id == late_seq]
    assert computed[0] == (pytest.approx(0.87), 32)         # what the backlog left of a step
    if late == "keep":
        assert rec.terminal == COMPLETED and rec.ttft_s > 1.0
        assert sum(n for _, n in computed) == 1000 + 3
        assert run.meta["deadline_dropped"] == 0
        return
    assert (rec.terminal, rec.reason, rec.decision) == (REJECTED, "deadline_expired", "reject")
    assert rec.e2e_s == pytest.approx(1.0) and rec.ttft_s is None and rec.output_tokens == 0
    assert all(t < 1.0 for t, _ in computed)               # nothing planned past its deadline
    assert sum(n for _, n in computed) == 32 + 12 * 64     # dropped mid-prefill
    assert run.meta["deadline_dropped"] == 1
    assert len(sim.policy.ledger) == 0                    # admission's ledger let it go
    summary = summarize(run, {}, Slo(ttft_ms=3000.0, tpot_ms=300.0))
    assert (summary.completed, summary.rejected) == (4, 1)


def test_a_class_end_to_end_bound_ends_a_long_answer_as_live():
    """A class bounding the whole request at 100 ms (either policy; fcfs here), 10 ms
    steps: the first token at 10 ms, one a step after, and at 100 ms, its tenth token's
    step, the scheduler's late heap finishes it ``deadline`` with those ten: a completed
    request, its ledger entry let go."""
    cfg = config(admission={"policy": "fcfs",
                            "classes": [{"name": "default", "e2e_slo_ms": 100.0}]})
    sim, run = simulate([req(0, 0.0, n_out=50)], cfg)
    (rec,) = run.records
    assert (rec.terminal, rec.finish_reason, rec.output_tokens) == (COMPLETED, "deadline", 10)
    assert rec.e2e_s == pytest.approx(0.1) and rec.itl_s == pytest.approx([STEP_S] * 9)
    assert (run.meta["deadline_finished"], run.meta["deadline_dropped"]) == (1, 0)
    assert len(sim.policy.ledger) == 0 and not sim.core.by_request
