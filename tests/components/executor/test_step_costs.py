"""The steps the executor times at startup (components/executor/step_costs.py): the probe's
shapes, clipped to the engine; its samples, real steps on a small model; and the cache per
machine, read back by the next start and measured again where the key changes."""
from __future__ import annotations

import json

import pytest
import torch
from msgspec.structs import astuple

from components.costs.cost_model import StepCostModel, StepShape, plan_shape
from components.executor.build import build_model
from components.executor.runner import ModelRunner
from components.executor.step_costs import (
    Probe,
    cache_key,
    probe_plan,
    probe_shapes,
    sample_of,
    scales_with_work,
    step_costs,
)
from components.executor.synthetic import ModelShape, random_weights
from schemas.wire import StepSample

SHAPE = ModelShape("tiny64", num_layers=2, hidden_size=128, intermediate_size=192, num_heads=2,
                   num_kv_heads=1, head_dim=64, vocab_size=128, max_position=2048)
BLOCK = 16


def test_probe_shapes_tell_the_features_apart_within_the_engine():
    assert probe_shapes(2048, 8192, 128, 2048, 16) == [
        Probe(1, 16, 0), Probe(1, 128, 0), Probe(1, 256, 0),      # fresh chunks
        Probe(16, 128, 0), Probe(1, 2048, 0),                     # steps at the budget
        Probe(1, 32, 1024), Probe(1, 32, 4096),                   # attention at context
        Probe(1, 1, 255), Probe(16, 1, 511)]                      # decodes
    # a small engine: 64-token budget, 128-token context, 4 sequences, 16 blocks
    assert probe_shapes(64, 128, 4, 16, 16) == [
        Probe(1, 16, 0), Probe(1, 64, 0), Probe(1, 32, 24), Probe(1, 32, 96),
        Probe(1, 1, 127), Probe(4, 1, 127)]


def test_a_probe_steps_shape_is_the_schedulers():
    p = Probe(3, 32, 100)
    plan = probe_plan(p, 1, BLOCK, 128)
    # rows share the 6 blocks before their writes, and each writes 3 of its own
    assert [s.block_ids for s in plan.new_seqs] == [
        [0, 1, 2, 3, 4, 5] + [6 + 3 * r, 7 + 3 * r, 8 + 3 * r] for r in range(3)]
    shape = plan_shape(plan, {s.seq_id: s.num_computed for s in plan.new_seqs}.__getitem__)
    assert shape == StepShape(96, 396, 3, 3 * (32 * 100 + 32 * 33 // 2))
    assert sample_of(p, 0.25) == StepSample(*shape, 0.25)


@pytest.fixture(scope="module")
def tiny():
    model = build_model(SHAPE, random_weights(SHAPE, seed=3), dtype=torch.float32)
    return model, ModelRunner(model, model.new_kv_cache(160, BLOCK))


def test_startup_steps_are_measured_and_kept(tiny, tmp_path):
    model, runner = tiny
    samples, how, seconds = step_costs(runner, model, 256, 1024, 16, tmp_path)
    shapes = probe_shapes(256, 1024, 16, 160, BLOCK)
    assert seconds > 0 and not runner.seqs
    assert [astuple(s)[:4] for s in samples] == [astuple(sample_of(p, 0.0))[:4]
                                                 for p in shapes]
    assert all(s.seconds > 0 for s in samples)
    # kept unless the steps did not grow with their work (a tiny model's may not)
    kept = scales_with_work(samples)
    assert how == ("measured" if kept else "measured, stalled: not kept")
    stored = list((tmp_path / "step_costs").glob("*.json"))
    assert len(stored) == kept
    if kept:
        assert json.loads(stored[0].read_text())["steps"] == [list(astuple(s))
                                                              for s in samples]
        assert step_costs(runner, model, 256, 1024, 16, tmp_path) == (samples, "cached", 0.0)
    # and they are enough for the scheduler's model to predict from
    m = StepCostModel()
    assert m.prior_from((StepShape(*astuple(s)[:4]), s.seconds) for s in samples)
    assert m.predict(StepShape(256, 256, 1, 256 * 257 // 2)) > 0


def test_the_next_start_reads_them_back_by_key(tiny, tmp_path):
    """A start finds the steps stored under its key (the machine, the model, the kernels,
    the probe's shapes) and measures nothing; a config with other shapes has another key;
    no cache directory: measured, nothing read or kept."""
    model, runner = tiny
    shapes = probe_shapes(256, 1024, 16, 160, BLOCK)
    stored = [sample_of(p, 0.001 * (i + 1)) for i, p in enumerate(shapes)]
    key = cache_key(model, runner, shapes)
    (tmp_path / "step_costs").mkdir()
    (tmp_path / "step_costs" / f"{key}.json").write_text(json.dumps(
        {"key": key, "steps": [list(astuple(s)) for s in stored]}))
    assert step_costs(runner, model, 256, 1024, 16, tmp_path) == (stored, "cached", 0.0)
    assert cache_key(model, runner, probe_shapes(128, 1024, 16, 160, BLOCK)) != key
    assert step_costs(runner, model, 128, 1024, 16, tmp_path)[1] != "cached"
    assert step_costs(runner, model, 256, 1024, 16, None)[1].startswith("measured")


def test_a_stalled_measurement_is_not_kept():
    """Seen on two shared cores: every step ~2 s whatever its size. That measurement is
    the neighbours' cost; a healthy one grows with the work."""
    shapes = [Probe(1, 16, 0), Probe(1, 128, 0), Probe(1, 256, 0), Probe(1, 32, 4096),
              Probe(16, 1, 511)]
    stalled = [sample_of(p, t) for p, t in zip(shapes, (1.728, 1.940, 2.088, 1.812, 1.614))]
    healthy = [sample_of(p, t) for p, t in zip(shapes, (0.048, 0.137, 0.240, 0.158, 0.060))]
    assert not scales_with_work(stalled) and scales_with_work(healthy)
    # too few fresh chunks, or too close in size, to tell: kept
    assert scales_with_work(stalled[3:]) and scales_with_work(
        [sample_of(Probe(1, 16, 0), 1.7), sample_of(Probe(1, 64, 0), 1.8)])
