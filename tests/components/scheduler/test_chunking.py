"""Stall-free chunking: the step budget from the decoding streams' TPOT SLOs (one gap within
GAP x the SLO, the mean over their output within it), exact against a known cost model;
and, in the simulator, decoding streams keep their TPOT through a burst of long prompts
where a fixed budget does not."""
from __future__ import annotations

import pytest

from components.costs.cost_model import StepCostModel, StepShape, decode_shape
from components.scheduler.chunking import GAP, HORIZON, MIN_CHUNK, step_budget
from components.scheduler.core import SchedulerCore
from components.scheduler.sequence import Seq, State
from schemas.config import KvConfig, SchedulerConfig, load_config
from schemas.wire import RequestHeader, SamplingParams
from tests import messages as msgs
from weir.replay.profile import CostProfile
from weir.replay.sim import Simulator, fast_block_hashes
from weir.replay.synth import TokenSynth
from weir.replay.types import Scaling, TraceRequest


def cost_model(a=0.01, b=0.001, c=0.0, d=0.0, e=0.0) -> StepCostModel:
    """A cost model that has seen exactly t = a + b·tokens + c·context + d·seqs + e·pairs."""
    m = StepCostModel()
    for tokens, ctx, seqs, pairs in [(1, 10, 1, 10), (8, 90, 8, 90), (64, 700, 3, 20000),
                                     (256, 300, 2, 33000), (512, 2000, 9, 250000),
                                     (30, 30, 1, 465), (100, 5000, 40, 9000),
                                     (2048, 2048, 1, 2098176), (17, 170, 17, 170)]:
        m.observe(StepShape(tokens, ctx, seqs, pairs),
                  a + b * tokens + c * ctx + d * seqs + e * pairs)
    return m


def tpot_header(rid: str, tpot_s: float | None) -> RequestHeader:
    return msgs.header(rid, "t", SamplingParams(max_tokens=100), 0,
                       tpot_slo_ms=None if tpot_s is None else tpot_s * 1e3)


def core_with(decoding: int, tpot: float | None, waiting_prompt: int = 0) -> SchedulerCore:
    core = SchedulerCore(SchedulerConfig(), KvConfig(), 4096)
    for i in range(decoding):
        s = Seq(i + 1, tpot_header(f"r{i}", tpot), 10, list(range(11)), [], frozenset(),
                state=State.RUNNING, num_computed=10)
        core.running.append(s)
    return core


def test_full_budget_without_decodes_or_slo():
    m = cost_model()
    assert step_budget(core_with(0, 0.1), m, 2048).reason == "no_decodes"
    assert step_budget(core_with(4, None), m, 2048) == (2048, "no_tpot_slo", None, None)


def test_budget_keeps_the_tightest_tpot():
    # step = 10 ms + 1 ms per token; 8 decodes one output in, 98 to go; tightest TPOT 200
    # ms. Their mean (within 160 ms, the SLO less 20% headroom) leaves room (16 tokens
    # ahead at an 18 ms decode pace), so the gap binds: 1.5 x 200 = 300 ms = 10 + 1 x
    # tokens -> 290 in all
    core = core_with(8, 0.2)
    core.running[3].header = tpot_header("r3", 0.5)
    b = step_budget(core, cost_model(), 2048)
    assert (b.tokens, b.reason) == (290, "tpot_slo")
    assert b.tightest_tpot_s == 0.2
    assert b.predicted_s == pytest.approx(GAP * 0.2)


def test_a_stream_at_its_last_token_gets_its_plain_slo():
    # nothing ahead to average over: the step is within the SLO itself (160 ms -> 150)
    core = core_with(8, 0.2)
    for s in core.running:
        s.header = msgs.header(s.request_id, "t", SamplingParams(max_tokens=2), 0,
                               tpot_slo_ms=200)
    assert step_budget(core, cost_model(), 2048).tokens == 150


def test_a_stream_behind_its_mean_gets_a_small_step_and_one_ahead_lends_its_bank():
    core = core_with(8, 0.2)
    for s in core.running:                        # 10 outputs in, 9 gaps since the first
        s.token_ids = list(range(20))
        s.num_computed = 19
        s.first_token_ns = 1_000_000_000
    m = cost_model()
    # 9 gaps at 300 ms each: 2.7 s spent where 160 ms x (9 + 1 + 16) - 16 x 18 ms = 3.87 s
    # is the room, so 1.17 s remains: the gap (300 ms) still binds
    now = 1_000_000_000 + 2_700_000_000
    assert step_budget(core, m, 2048, now_ns=now).tokens == 290
    # 9 gaps at 420 ms: 3.78 s spent, 92 ms of room left -> 10 + 1 x tokens = 92 -> 82
    now = 1_000_000_000 + 3_780_000_000
    assert step_budget(core, m, 2048, now_ns=now).tokens == 82
    # far behind (1 s a gap): only the least chunk
    now = 1_000_000_000 + 9_000_000_000
    assert step_budget(core, m, 2048, now_ns=now).tokens == 8 + MIN_CHUNK
    assert HORIZON == 16


def test_budget_never_starves_prefill_and_never_exceeds_full():
    assert step_budget(core_with(8, 0.005), cost_model(), 2048).tokens == 8 + MIN_CHUNK
    b = step_budget(core_with(8, 10.0), cost_model(), 2048)
    assert (b.tokens, b.reason) == (2048, "full")


def test_cold_cost_model_uses_the_full_budget():
    assert step_budget(core_with(4, 0.1), StepCostModel(), 2048).reason == "cost_unknown"


def test_a_fit_that_prices_the_decodes_at_nothing_falls_back_to_the_mean_cost():
    """Seen live: steps of -50 ms + 2 ms per token (every one observed at 30 tokens or
    more) put 4 decodes at -42 ms, clamped to 0. The budget then prices every token at the
    window's mean cost instead of taking the full budget beside streams with a TPOT SLO."""
    m = StepCostModel()
    for tokens, ctx, seqs in [(30, 300, 30), (40, 400, 40), (64, 700, 3), (256, 300, 2),
                              (512, 2000, 9), (36, 360, 36), (100, 5000, 40), (2048, 2048, 1),
                              (48, 480, 48)]:
        m.observe(StepShape(tokens, ctx, seqs, ctx), -0.05 + 0.002 * tokens)
    assert min(m._y) > 0 and m.predict(StepShape(4, 44, 5, 44)) == 0.0
    mean = m.mean_per_token()
    assert mean > 0
    b = step_budget(core_with(4, 0.5), m, 2048)
    room = int((GAP * 0.5 / m.slowdown() - 4 * mean) / mean)
    assert (b.tokens, b.reason) == (4 + room, "tpot_slo_mean")
    assert 4 + MIN_CHUNK < b.tokens < 2048
    assert b.predicted_s == pytest.approx(4 * mean + mean * room)


def burst_run(chunking: str):
    """16 streams decoding (TPOT SLO 300 ms) when 32 prompts of 512 tokens arrive."""
    cfg = load_config(None, topology={"run_dir": "/x"}, scheduler={"chunking": chunking},
                      admission={"classes": [{"name": "c", "tpot_slo_ms": 300}]},
                      speculative={"method": "off"})      # (chunking alone)
    streams = [TraceRequest(index=i, arrival_s=0.0, input_tokens=32, output_tokens=200)
               for i in range(16)]
    burst = [TraceRequest(index=16 + i, arrival_s=2.0, input_tokens=512, output_tokens=4)
             for i in range(32)]
    prof = CostProfile(coef=[0.02, 0.0008, 0.0, 0.0005, 1e-6])   # ~1.6 s for 2048 tokens
    sim = Simulator(cfg, prof, tokens=TokenSynth(range(1000, 5000), 32, 0).tokens,
                    hashes=fast_block_hashes(16))
    run = sim.run(streams + burst, Scaling(block_size=32))
    worst_gap = max(g for r in run.records[:16] for g in r.itl_s)
    worst_mean = max(sum(r.itl_s) / len(r.itl_s) for r in run.records[:16])
    return worst_gap, worst_mean, run


def test_streams_keep_their_tpot_through_a_burst_where_a_fixed_budget_does_not():
    slack_gap, slack_mean, slack = burst_run("slack")
    fixed_gap, fixed_mean, fixed = burst_run("fixed")
    # every stream's TPOT (its mean gap) within the SLO, and no gap over GAP x the SLO
    # (within the 1 ms a step's sampling adds to the fit's prediction); a fixed budget's
    # 1.6 s steps break the gap
    assert slack_mean <= 0.300 and slack_gap <= GAP * 0.300 + 0.001 < fixed_gap, \
        (slack_mean, slack_gap, fixed_gap)
    # the burst still gets served, in chunks the streams can carry
    assert all(r.terminal == "completed" for r in slack.records)


def test_a_fit_that_cannot_tell_the_token_cost_still_caps_the_budget():
    """Only decode steps seen (tokens == sequences): the fit cannot separate a token's cost
    from a sequence's, so the marginal cost comes from the mean time per token instead of
    falling back to the full budget (a multi-second step right when a burst arrives)."""
    cost = StepCostModel()
    for ctx in range(200, 1000, 50):
        cost.observe(decode_shape(16, ctx), 0.080 + 1e-5 * ctx)   # 16 decodes, ~5 ms a token
    b = step_budget(core_with(16, 0.3), cost, 2048)
    assert b.reason == "tpot_slo" and 16 < b.tokens < 2048, b


def test_steps_slower_than_predicted_shrink_the_budget():
    """The model fits 10 ms + 1 ms a token, but the last steps ran 1.25x what it predicted:
    the budget is planned against that, so the streams' p99 stays within the SLO."""
    exact = cost_model()
    slow = cost_model()
    for tokens in range(20, 60):                 # measured 25% over the fit's prediction
        slow.observe(StepShape(tokens, tokens * 10, 4, tokens * 10),
                     1.25 * (0.01 + 0.001 * tokens))
    assert exact.slowdown() == 1.0 and slow.slowdown() > 1.1   # (the fit partly follows)
    core = core_with(8, 0.2)
    fast_budget, slow_budget = step_budget(core, exact, 2048), step_budget(core, slow, 2048)
    assert slow_budget.reason == fast_budget.reason == "tpot_slo"
    assert slow_budget.tokens < fast_budget.tokens
    assert slow_budget.predicted_s * slow.slowdown() <= GAP * 0.2 + 1e-9
