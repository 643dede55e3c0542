"""Deadline-aware admission against the fcfs baseline, in the simulator: the first 1,000
requests of the Mooncake conversation trace (lengths ÷16), an interactive and a batch class,
offered at 1.5x the engine's measured capacity. The deadline policy must get at least 2x
fcfs's goodput (rejections counted as misses)."""
from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from schemas.config import load_config
from weir.replay import profile as profiles
from weir.replay.commands import _assign
from weir.replay.report import summarize
from weir.replay.sim import Simulator, fast_block_hashes
from weir.replay.synth import TokenSynth, scale
from weir.replay.traces import load_trace
from weir.replay.types import Scaling, Slo

ROOT = Path(__file__).resolve().parents[3]
TRACE = Path(__file__).parent / "data" / "mooncake_conversation_1000.jsonl"
PROFILE = ROOT / "weir" / "replay" / "profiles" / "reference-cpu.json"
CLASSES = [
    {"name": "interactive", "priority": 0, "ttft_slo_ms": 3000, "tpot_slo_ms": 400,
     "max_queue_ms": 2000},
    {"name": "batch", "priority": 10, "ttft_slo_ms": 30000, "tpot_slo_ms": 1000,
     "max_queue_ms": 25000, "aging_per_s": 0.2, "may_degrade": True, "min_max_tokens": 8},
]
SLOS = {"interactive": Slo(3000, 400), "batch": Slo(30000, 1000)}


def run(policy: str, time_scale: float):
    cfg = load_config(None, topology={"run_dir": "/nonexistent"},
                      engine={"max_model_len": 8192},
                      admission={"policy": policy, "classes": CLASSES,
                                 "tenants": [{"name": "default",
                                              "classes": ["interactive", "batch"]}]})
    scaling = Scaling(length=1 / 16, time=time_scale, block_size=512, seed=0)
    requests = scale(_assign(load_trace(TRACE), "service_class", "interactive=0.6,batch=0.4",
                             0), scaling)
    synth = TokenSynth(range(1000, 40000), scaling.scaled_block, seed=0)
    sim = Simulator(cfg, profiles.load(PROFILE), tokens=synth.tokens,
                    hashes=fast_block_hashes(cfg.kv.block_size))
    result = sim.run(requests, scaling)
    return result, summarize(result, SLOS, Slo(3000, 400))


@pytest.fixture(scope="module")
def capacity():
    """Requests/s the engine completes when offered far more (fcfs at the trace's own
    rate, 1000 requests in ~5 minutes of trace time, lengths ÷16)."""
    result, summary = run("fcfs", 1.0)
    return summary.achieved_rps, summary.offered_rps


def test_deadline_policy_doubles_fcfs_goodput_at_1_5x_capacity(capacity):
    achieved, offered_at_1x = capacity
    time_scale = offered_at_1x / (1.5 * achieved)
    fcfs_run, fcfs = run("fcfs", time_scale)
    deadline_run, deadline = run("deadline", time_scale)
    assert fcfs.offered_rps == pytest.approx(1.5 * achieved, rel=0.01)
    assert deadline.goodput >= 2 * fcfs.goodput, (deadline.goodput, fcfs.goodput, time_scale)
    assert deadline.goodput > 0.2
    # the deadline policy rejects early instead of letting work queue past its deadline
    assert deadline.rejected > 0 and deadline.ttft_ms.p50 < fcfs.ttft_ms.p50
    reasons = {r.reason for r in deadline_run.records if r.terminal == "rejected"}
    assert reasons <= {"deadline_unmeetable", "deadline_expired", "queue_full", "overloaded"}
    assert msgspec.json.encode(run("deadline", time_scale)[0].records) == \
        msgspec.json.encode(deadline_run.records)          # deterministic
