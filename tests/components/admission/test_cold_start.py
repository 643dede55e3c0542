"""Cold start, exact: a scheduler that has measured no step (just started, or restarted)
gets the executor's startup steps in ``ExecutorReady``; its first load report carries rates
from them, and admission predicts the first request's TTFT from it. Of a burst of 20
requests at that moment, the ones whose predicted TTFT misses their class's SLO are
rejected ``deadline_unmeetable``; without the startup steps every one is accepted."""
from __future__ import annotations

import pytest

from components.admission.decision import Kind
from components.admission.policy import AdmissionPolicy
from components.costs.cost_model import StepShape, decode_shape, prefill_shape
from components.scheduler.load import load_report
from components.scheduler.loop import SchedulerLoop
from schemas.config import load_config
from schemas.wire import ExecutorReady, SamplingParams, StepSample
from tests import messages as msgs

# the machine: 10 ms a step, 1 ms a token, 1 µs an attention pair, 0.5 ms a sequence,
# 10 µs a KV position read; what the executor's probe measured (its shapes at this config)
TRUTH = (0.010, 0.001, 1e-6, 0.0005, 1e-5)
PROBE = [prefill_shape(16), prefill_shape(128), prefill_shape(256), prefill_shape(32, 248),
         prefill_shape(32, 992), decode_shape(1, 256), decode_shape(16, 16 * 512)]
BUDGET, PROMPT, SLO_MS = 2048, 200, 1000


def seconds(shape: StepShape) -> float:
    return sum(c * f for c, f in zip(TRUTH, shape.row()))


def config():
    return load_config(None, topology={"run_dir": "/x"},
                       scheduler={"max_num_batched_tokens": BUDGET},
                       kv={"num_blocks": 4096, "block_size": 16},
                       engine={"max_model_len": 1024},
                       admission={"policy": "deadline", "kv_safety": 0.0,
                                  "classes": [{"name": "tight", "ttft_slo_ms": SLO_MS}]})


def burst(startup_steps: list[StepSample]):
    """A fresh scheduler hears ExecutorReady, reports its load at once (as the service
    does), and admission decides 20 requests of 200 distinct tokens, arrived together."""
    cfg = config()
    loop = SchedulerLoop(cfg, epoch=1)
    loop.handle(ExecutorReady(1 << 20, 1e9, 0, startup_steps), 1, 1)
    report = load_report(loop.core, loop.core.cost, BUDGET, 1)
    policy = AdmissionPolicy(cfg)
    policy.ttft.on_load(report, 0.0)
    decisions = [policy.decide(msgs.tokenized(f"r{i}", "default",
                                         [1000 + 300 * i + j for j in range(PROMPT)], [],
                                         SamplingParams(max_tokens=1), 0, ()), 0, 0.0)
                 for i in range(20)]
    return loop, report, decisions


def test_the_first_burst_is_predicted_from_the_executors_startup_steps():
    steps = [StepSample(*s, seconds(s)) for s in PROBE]
    loop, report, decisions = burst(steps)
    assert loop.core.steps == 0 and loop.core.cost.prior == pytest.approx(TRUTH, rel=1e-6)
    # a full chunk's tokens (attention aside): 10 + 2048 × 1 + 0.5 + 2048 × 0.01 ms
    rate = BUDGET / 2.07898
    assert report.prefill_tokens_per_s == pytest.approx(rate, rel=1e-6)
    assert report.attention_s_per_pair == pytest.approx(1e-6, rel=1e-6)
    assert report.decode_step_s == pytest.approx(0.0115, rel=1e-6)  # one row, no context
    # request k has k admitted prompts ahead, one step: (k + 1) × (200 tokens at the rate
    # + 200·201/2 pairs) + a decode step; accepted while within 800 ms (20% headroom)
    per_prompt = PROMPT / rate + PROMPT * (PROMPT + 1) / 2 * 1e-6
    predicted = [d.estimate.predicted_ttft_s for d in decisions]
    assert predicted[:4] == pytest.approx([(k + 1) * per_prompt + 0.0115 for k in range(4)],
                                          rel=1e-6)
    assert [d.kind for d in decisions] == [Kind.ACCEPT] * 3 + [Kind.REJECT] * 17
    assert {d.reason for d in decisions[3:]} == {"deadline_unmeetable"}
    assert predicted[3:] == pytest.approx([4 * per_prompt + 0.0115] * 17, rel=1e-6)
    assert predicted[3] * 1e3 > 0.8 * SLO_MS >= predicted[2] * 1e3


def test_without_startup_steps_the_burst_is_accepted_blind():
    """What happened before the executor timed steps at startup: no rate until the
    scheduler measured its own, so no prediction and every deadline check passed."""
    loop, report, decisions = burst([])
    assert report.prefill_tokens_per_s == 0.0
    assert all(d.kind == Kind.ACCEPT and d.estimate.predicted_ttft_s is None for d in decisions)
