"""Live replay against the engine, and the simulator checked against it.

One engine, with its scheduler's step log on: the calibration workload runs first (its
steps fit the cost profile), then a scaled slice of the Mooncake conversation trace is
replayed live, then the same slice is simulated with that profile and the same config."""
from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from components.costs.cost_model import StepShape
from schemas.config import load_config
from tests.e2e.engine import Engine, wait_for
from weir.replay import profile as profiles
from weir.replay.calibrate import _workload
from weir.replay.live import SdkTarget, replay
from weir.replay.report import summarize
from weir.replay.sim import Simulator, fast_block_hashes
from weir.replay.synth import PromptSynth, load_tokenizer, scale
from weir.replay.traces import load_trace
from weir.replay.types import COMPLETED, REJECTED, Scaling, Slo, TraceRequest

TRACE = Path(__file__).resolve().parents[1] / "weir" / "replay" / "data" / \
    "mooncake_conversation_head.jsonl"
SCALING = Scaling(length=1 / 64, time=2.0, block_size=512, seed=3)
# fcfs admission, as `weir calibrate` runs its engine: the calibration workload (decode
# batches of 32 at once) measures steps, and the default deadline policy would refuse most
# of it; the simulator then runs the same policy as the live engine
CONFIG = """
[engine]
max_model_len = 1024
[admission]
policy = "fcfs"
[scheduler]
max_num_batched_tokens = 256
max_num_seqs = 32
step_log = "{steps}"
[kv]
num_blocks = 512
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_path):
    run_dir = tmp_path_factory.mktemp("replay")
    steps = run_dir / "steps.jsonl"
    toml = CONFIG.format(steps=steps)
    engine = Engine(run_dir, toml)
    try:
        cfg = load_config(run_dir / "weir.toml", topology={"run_dir": str(run_dir)})
        anyio.run(_workload, engine.endpoint, engine.service_key,
                  cfg.scheduler.max_num_batched_tokens, cfg.engine.max_model_len,
                  cfg.scheduler.max_num_seqs, True, lambda msg: None)
        calibration = profiles.read_step_log(steps)
        profile = profiles.fit(calibration, source="test calibration")
        requests = scale(load_trace(TRACE), SCALING)
        synth = PromptSynth.for_scaling(load_tokenizer(str(model_path)), SCALING)
        before = engine.stats("streamer").get("requests.finished", 0)
        live = anyio.run(lambda: replay(requests, SdkTarget(engine.endpoint, engine.service_key),
                                        lambda r: (synth.token_ids(r), ""), scaling=SCALING,
                                        progress=False, max_lag_ms=250))
        # the engine's count rides on heartbeats: poll it (asserted below)
        finished = wait_for(
            lambda: engine.stats("streamer").get("requests.finished", 0) - before, 5,
            interval=0.1, or_last=True,
            until=lambda done: done == sum(r.terminal == COMPLETED for r in live.records))
        live_steps = profiles.read_step_log(steps)[len(calibration):]
        ratios = sorted(s["measured_s"] / profile.predict(StepShape(
            s["tokens"], s["context"], s["seqs"], s["pairs"])) for s in live_steps)
        print(f"live steps {len(ratios)}: measured/predicted p10 {ratios[len(ratios)//10]:.2f} "
              f"p50 {ratios[len(ratios)//2]:.2f} p90 {ratios[len(ratios)*9//10]:.2f}; "
              f"{profile.describe()}")
        sim = Simulator(cfg, profile, tokens=synth.token_ids,
                        hashes=fast_block_hashes(cfg.kv.block_size)).run(requests, SCALING)
        yield live, sim, finished, profile, engine, synth
    finally:
        engine.stop()


def test_live_replay_is_valid_and_agrees_with_the_engines_count(runs):
    live, _, finished, *_ = runs
    assert live.valid, live.invalid_reasons
    assert live.lag_p99_ms is not None and live.lag_p99_ms <= 250
    completed = sum(r.terminal == COMPLETED for r in live.records)
    assert completed == finished
    # the slice holds one prompt over max_model_len after scaling (87169 / 64 tokens)
    rejected = [r for r in live.records if r.terminal == REJECTED]
    assert [r.reason for r in rejected] == ["prompt_too_long"]
    assert completed == len(live.records) - 1
    for r in live.records:
        if r.terminal == COMPLETED:
            assert r.ttft_s > 0 and r.output_tokens == len(r.itl_s) + 1
            assert len(r.trace_id) == 32


def test_simulated_and_live_agree(runs):
    """TTFT p50 within 35% (+0.25 s) and goodput within 0.25 of the live run.

    Why that much: the profile's own median error per step on a shared 2-core machine is
    10-20%; the simulator does not model the tokenizer, admission and detokenizer hops
    (a few ms per request) nor the replay client and seven engine processes competing for
    the same two cores, which the calibration run only partly saw. The SLO is set at the
    live run's TTFT p75, so goodput is neither trivially 0 nor 1 and a 0.25 band is 5 of
    the 19 completed requests.

    The printed step ratio (live steps' measured / the profile's prediction) tells a
    machine that slowed between calibration and replay from a simulator that is wrong.
    What this test caught on CI (live 3.16 s against simulated 1.74 s): the replay client
    sent the slice's second burst in no fixed order, so the engine's first step took a
    different prompt than the simulator's; the burst now goes out in trace order."""
    live, sim, _, profile, *_ = runs
    assert [r.terminal for r in sim.records] == [r.terminal for r in live.records]
    ttft_live = sorted(r.ttft_s for r in live.records if r.ttft_s is not None)
    ttft_sim = sorted(r.ttft_s for r in sim.records if r.ttft_s is not None)
    p50_live, p50_sim = ttft_live[len(ttft_live) // 2], ttft_sim[len(ttft_sim) // 2]
    print(f"TTFT p50 live {p50_live:.3f} s, simulated {p50_sim:.3f} s")
    assert abs(p50_sim - p50_live) <= 0.35 * p50_live + 0.25, (p50_sim, p50_live,
                                                               profile.describe())
    slo = Slo(ttft_ms=ttft_live[int(len(ttft_live) * 0.75)] * 1e3, tpot_ms=10_000)
    g_live = summarize(live, {}, slo).goodput
    g_sim = summarize(sim, {}, slo).goodput
    assert abs(g_live - g_sim) <= 0.25, (g_live, g_sim, p50_live, p50_sim)


def test_closed_loop_sessions_wait_for_the_previous_answer(runs):
    *_, engine, synth = runs
    turns = [TraceRequest(index=i, arrival_s=0.0, input_tokens=40 + i, output_tokens=4,
                          session_id=f"s{i % 2}") for i in range(6)]
    run = anyio.run(lambda: replay(turns, SdkTarget(engine.endpoint, engine.service_key),
                                   lambda r: (synth.token_ids(r), ""), closed_loop=True,
                                   progress=False, max_lag_ms=250))
    assert all(r.terminal == COMPLETED for r in run.records)
    for session in ("s0", "s1"):
        mine = [r for r in run.records if r.session_id == session]
        for before, after in zip(mine, mine[1:]):
            assert after.sent_s >= before.sent_s + before.e2e_s
