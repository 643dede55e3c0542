"""The steps the executor times at startup (components/executor/step_costs.py): the probe's
shapes, clipped to the engine; its samples, real steps on a small model; and the cache per
machine, read back by the next start and measured again where the key changes."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from msgspec.structs import astuple

from components.costs.cost_model import StepCostModel, StepShape, plan_shape
from components.executor.build import build_model
from components.executor.runner import ModelRunner
from components.executor.step_costs import (
    Probe,
    base_key,
    cache_key,
    probe_key,
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


def test_the_key_follows_the_plans_choices_not_how_it_was_had(tiny):
    """The start that measured the plan and the next one, which reads it back, time the
    same kernels: one key (a measured plan's key was the cached one's twin, and the second
    start of every engine probed its steps again). Another kernel choice: another key."""
    model, runner = tiny
    shapes = probe_shapes(256, 1024, 16, 160, BLOCK)

    def key_with(**changes):
        plan = dataclasses.replace(model.plan, **changes)
        return cache_key(SimpleNamespace(spec=model.spec, dtype=model.dtype,
                                         backend=model.backend, plan=plan), runner, shapes)

    measured = key_with(source="measured", guard={"load": 0.4, "provisional": "loaded"})
    assert measured == cache_key(model, runner, shapes)
    assert key_with(source="cached", guard={"load": 0.01, "provisional": ""}) == measured
    assert key_with(source="cached", guard={}) == measured
    other = "native" if model.plan.elementwise == "torch" else "torch"
    assert key_with(elementwise=other) != measured


def test_a_probe_step_is_keyed_by_its_shape_and_the_kernels_it_runs(tiny):
    """Two plans that differ only above a step's rows run it alike (one key); where the
    step's pick differs, or its shape, the key does."""
    model, _ = tiny
    plan = dataclasses.replace(model.plan, linear={"qkv": [(64, "torch"), (2048, "fp32")],
                                                   "lm_head": [(128, "torch")]})
    bigger = dataclasses.replace(plan, linear={**plan.linear,
                                               "qkv": [(64, "torch"), (256, "fp32"),
                                                       (4096, "onednn")]})
    p = Probe(1, 128, 0)
    assert probe_key(plan, p) == probe_key(bigger, p)
    assert probe_key(plan, Probe(1, 512, 0)) != probe_key(bigger, Probe(1, 512, 0))
    assert probe_key(plan, Probe(1, 16, 0)) != probe_key(plan, p)
    # the lm_head runs the sampled rows: a 2-row decode picks its table at 2, not 2 x 1
    narrow = dataclasses.replace(plan, linear={**plan.linear,
                                               "lm_head": [(1, "fp32"), (128, "torch")]})
    assert probe_key(narrow, Probe(2, 1, 255)) == probe_key(plan, Probe(2, 1, 255))
    assert probe_key(narrow, Probe(1, 16, 0)) != probe_key(plan, Probe(1, 16, 0))
    other = "native" if plan.elementwise == "torch" else "torch"
    assert probe_key(dataclasses.replace(plan, elementwise=other), p) != probe_key(plan, p)


def test_another_config_measures_only_the_steps_no_config_has_stored(tiny, tmp_path):
    """A 256-token config's steps are stored; a 128-token config (another key: its budget
    steps and clipped shapes differ) takes the steps both probe alike from that file,
    exactly, and measures only its own; each is stored under its key for the next start."""
    model, runner = tiny
    shapes = probe_shapes(256, 1024, 16, 160, BLOCK)
    stored = [sample_of(p, 0.001 * (p.rows * p.tokens + 10)) for p in shapes]
    key = cache_key(model, runner, shapes)
    (tmp_path / "step_costs").mkdir()
    (tmp_path / "step_costs" / f"{key}.json").write_text(json.dumps(
        {"key": key, "base": base_key(model, runner),
         "probes": [probe_key(model.plan, p) for p in shapes],
         "steps": [list(astuple(s)) for s in stored]}))
    # 128 tokens at 1024 of context: every step is one the 256-token config probed
    samples, how, seconds = step_costs(runner, model, 128, 1024, 16, tmp_path)
    small = probe_shapes(128, 1024, 16, 160, BLOCK)
    assert (how, seconds) == ("taken from other configs' probes", 0.0)
    assert samples == [stored[shapes.index(p)] for p in small]
    # at 512 of context the long-context steps are its own
    small = probe_shapes(128, 512, 16, 160, BLOCK)
    shared = [p for p in small if p in shapes]
    assert shared and len(shared) < len(small)
    samples, how, seconds = step_costs(runner, model, 128, 512, 16, tmp_path)
    assert seconds > 0 and how.startswith(
        f"measured {len(small) - len(shared)}, {len(shared)} from other configs' probes")
    by_shape = dict(zip(small, samples))
    for p in shared:                                   # taken as stored, not measured
        assert by_shape[p] == stored[shapes.index(p)]
    assert all(by_shape[p].seconds > 0 for p in small if p not in shapes)
    if "not kept" not in how:
        assert step_costs(runner, model, 128, 512, 16, tmp_path) == (samples, "cached", 0.0)
    # another machine (or model, dtypes, block, backend) shares nothing
    other = tmp_path / "elsewhere" / "step_costs"
    other.mkdir(parents=True)
    (other / "x.json").write_text(json.dumps(
        {"key": "x", "base": "another base", "probes": [probe_key(model.plan, p)
                                                         for p in shapes],
         "steps": [list(astuple(s)) for s in stored]}))
    how = step_costs(runner, model, 128, 1024, 16, other.parent)[1]
    assert how.startswith("measured") and "from other configs" not in how


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
