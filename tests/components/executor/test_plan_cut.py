"""A kernel plan for a smaller step budget cut from one cached for a larger budget
(components/executor/plan_cut.py): the buckets each role is timed at, the cut's choice from
the source's timings, what cannot be cut (and is measured), the guard that comes along, and
a second engine config on one machine starting from the cache without measuring."""
from __future__ import annotations

import json

import pytest

from components.executor import autotune, plan_cut
from components.executor.build import build_model
from components.executor.linear import GREEDY_HEAD
from components.executor.synthetic import ModelShape, random_weights
from kernels import tuning
from kernels.tuning import KernelPlan
from kernels.tuning_guard import LoadMeter, LoadSample

SHAPES = {"qkv": (192, 64), "lm_head": (128, 64)}
MACHINE = {"cpu": "test", "cores": 2}
B = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def scope(max_m: int, max_seqs: int = 128, block_size: int = 16, dtypes: str = "float32"):
    return plan_cut.scope_of(dtypes, SHAPES, max_m, max_seqs, block_size)


def source(max_m: int = 2048, max_seqs: int = 128, **guard) -> dict:
    """A stored plan as the cache holds it: qkv's native kernel wins up to 256 rows, oneDNN
    from 512 (µs per bucket); the lm_head's rows run to max_seqs."""
    qkv = {"native": {str(m): float(m) for m in B if m <= min(max_m, 256)},
           "onednn": {str(m): 10.0 + (1.0 if m < 512 else 1.5) * m for m in B if m <= max_m}}
    head_rows = plan_cut.linear_buckets(max_m, max_seqs, True)
    head = {"native": {str(m): float(m) for m in head_rows},
            "torch": {str(m): 50.0 + m for m in head_rows}}
    timings = {"linear.qkv": qkv, "linear.lm_head": head, f"linear.{GREEDY_HEAD}": head,
               "elementwise": {"native": 5.0, "torch": 9.0}, "sampling": {"native": 1.0}}
    linear = {"qkv": [[256, "native"], [max_m, "onednn"]], "lm_head": [[max_seqs, "native"]],
              GREEDY_HEAD: [[max_seqs, "native"]]}
    return {"key": "s" * 20, "machine": MACHINE, "scope": scope(max_m, max_seqs),
            "linear": linear, "elementwise": "native", "sampling": "native",
            "attention": "cpu", "fresh_prompts": "sdpa", "attention_tiles": "vector",
            "layer_loop": "native", "timings": timings,
            "guard": {"load": 0.05, "cores": 2, "attempts": 1, "provisional": "",
                      "measured_at": 100.0, **guard}}


def test_the_buckets_each_role_is_timed_at():
    assert plan_cut.linear_buckets(256, 128, False) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert plan_cut.linear_buckets(300, 128, False)[-2:] == [256, 300]
    assert plan_cut.linear_buckets(2048, 128, True) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert plan_cut.linear_buckets(2048, 80, True) == [1, 2, 4, 8, 16, 32, 64, 80]
    assert plan_cut.linear_buckets(128, 256, True) == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_a_smaller_budget_is_chosen_again_from_the_sources_timings():
    plan = plan_cut.cut(source(), scope(256))
    assert plan is not None and plan.source == "cut"
    # oneDNN won only from 512 rows: up to 256 the native kernel runs every step
    assert plan.linear["qkv"] == [(256, "native")]
    assert plan.linear["lm_head"] == plan.linear[GREEDY_HEAD] == [(128, "native")]
    assert plan.timings["linear.qkv"]["onednn"] == {str(m): 10.0 + m for m in B if m <= 256}
    assert (plan.elementwise, plan.sampling, plan.attention, plan.fresh_prompts,
            plan.attention_tiles, plan.layer_loop) == ("native", "native", "cpu", "sdpa",
                                                       "vector", "native")
    assert plan.timings["elementwise"] == {"native": 5.0, "torch": 9.0}
    assert plan.guard["cut_from"] == "s" * 20 and plan.guard["provisional"] == ""
    assert plan.guard["measured_at"] == 100.0        # when its timings were taken
    # cut at its own budget: the source's own choice
    same = plan_cut.cut(source(), scope(2048))
    assert same is not None and same.linear["qkv"] == [(256, "native"), (2048, "onednn")]
    # 512, a bucket of the 2048 plan: the native kernel does not run it, oneDNN does
    half = plan_cut.cut(source(), scope(512))
    assert half is not None and half.linear["qkv"] == [(256, "native"), (512, "onednn")]


@pytest.mark.parametrize("want, src, why", [
    (scope(512), source(256), "a larger budget than the source's"),
    (scope(300), source(), "a budget that is no bucket of the source's"),
    (scope(256, block_size=32), source(), "another KV block size (attention's timings)"),
    (scope(256, dtypes="bfloat16"), source(), "another dtype"),
    (scope(256, max_seqs=16), source(), "sampling timed at other rows (16, not 64)"),
    (scope(256, max_seqs=80), source(max_seqs=128), "the lm_head timed at other rows"),
    (scope(256), {**source(), "scope": None}, "a plan from before the scope was stored"),
    (scope(256), source(remeasure=True), "a plan marked to be measured again"),
    (scope(256), {**source(), "guard": {}}, "a plan from before the guard"),
])
def test_what_cannot_be_cut_is_measured(want, src, why):
    assert plan_cut.cut(src, want) is None, why


def test_sampling_rows_past_64_are_one_measurement():
    """_time_sampling times 1 and min(64, max_seqs) rows: 128 and 256 sequences time alike,
    and a 256-token budget times the lm_head at 1 ... 128 rows under both."""
    plan = plan_cut.cut(source(max_seqs=256), scope(256, max_seqs=128))
    assert plan is not None and plan.linear["lm_head"] == [(128, "native")]


def test_the_guard_comes_along_for_the_buckets_kept():
    """A source made provisional by a flat timing at 1024 rows cuts to a clean 256 plan; a
    flat timing inside the cut, or a loaded measurement, keeps the cut provisional (and it
    is measured again at a quieter start, as any provisional plan)."""
    flat_high = {"linear.qkv": {"onednn@1024": {"status": "unsettled", "ratio": 1.0}}}
    src = source(provisional="timings that do not grow", anomalies=flat_high)
    plan = plan_cut.cut(src, scope(256))
    assert plan is not None and plan.guard["provisional"] == "" and plan.anomalies == {}
    flat_low = {"linear.qkv": {"native@64": {"status": "unsettled", "ratio": 1.0}}}
    plan = plan_cut.cut(source(provisional="flat", anomalies=flat_low), scope(256))
    assert plan is not None and plan.anomalies == flat_low
    assert plan.guard["provisional"].startswith("timings that do not grow with the rows")
    plan = plan_cut.cut(source(load=0.4, provisional="loaded"), scope(256))
    assert plan is not None and plan.guard["provisional"].startswith(
        "other processes used 40% of the 2 cores")


def test_find_takes_the_smallest_serving_budget_on_this_machine(tmp_path):
    root = tmp_path / "tuning"
    root.mkdir()
    for name, data in {"big": {**source(2048), "key": "b" * 20},
                       "mid": {**source(512), "key": "m" * 20},
                       "small": {**source(128), "key": "t" * 20},
                       "other": {**source(2048), "key": "o" * 20,
                                 "machine": {**MACHINE, "cpu": "another"}}}.items():
        (root / f"{name}.json").write_text(json.dumps(data))
    (root / "junk.json").write_text("{not json")
    (root / "odd.json").write_text(json.dumps({"key": "x", "machine": MACHINE,
                                               "scope": {"max_m": "many"}}))
    plan = plan_cut.find(root, MACHINE, scope(256))
    assert plan is not None and plan.guard["cut_from"] == "m" * 20
    assert plan_cut.find(root, MACHINE, scope(1024)).guard["cut_from"] == "b" * 20
    assert plan_cut.find(root, {**MACHINE, "cpu": "a third"}, scope(256)) is None
    assert plan_cut.find(root, MACHINE, scope(4096)) is None


def quiet_meter() -> LoadMeter:
    reads = iter([LoadSample(0.0, 0.0, 0.0)] + [LoadSample(10.0, 4.0, 4.0)] * 100)
    return LoadMeter(read=lambda: next(reads), cores=2, sleep=lambda s: None)


def test_a_second_config_starts_from_the_cache_without_measuring(tmp_path):
    root = tmp_path / "tuning"
    root.mkdir()
    (root / f"{'s' * 20}.json").write_text(json.dumps(source()))
    measured = []

    def measure() -> KernelPlan:
        measured.append(1)
        return KernelPlan({"qkv": [(256, "onednn")]}, "torch", "torch", "torch")

    path = root / f"{'k' * 20}.json"
    first = autotune.cached_or_measured(path, "k" * 20, MACHINE, measure, quiet_meter,
                                        scope=scope(256))
    assert (first.source, first.key, first.linear["qkv"], measured) == (
        "cut", "k" * 20, [(256, "native")], [])
    stored = json.loads(path.read_text())
    assert stored["scope"] == scope(256) and stored["guard"]["cut_from"] == "s" * 20
    again = autotune.cached_or_measured(path, "k" * 20, MACHINE, measure, quiet_meter,
                                        scope=scope(256))
    assert (again.source, again.linear, measured) == ("cached", first.linear, [])
    # nothing to cut from (a larger budget): measured, and stored with its scope
    big = root / f"{'g' * 20}.json"
    plan = autotune.cached_or_measured(big, "g" * 20, MACHINE, measure, quiet_meter,
                                       scope=scope(4096))
    assert (plan.source, measured) == ("measured", [1])
    assert json.loads(big.read_text())["scope"] == scope(4096)


def test_a_real_plan_cut_for_a_smaller_budget(tmp_path, monkeypatch, quiet_cores):
    """Measured on this machine for 512 tokens, then an engine of 128: its plan is cut from
    the first (no measurement) and is the first's timings up to 128, chosen again; the
    model built on it runs. The cores read as quiet (conftest's quiet_cores): a plan
    measured beside the suite's other worker is provisional, and so is its cut."""
    shape = ModelShape("tiny", num_layers=2, hidden_size=64, intermediate_size=96,
                       num_heads=2, num_kv_heads=1, head_dim=32, vocab_size=128,
                       max_position=512)
    weights = random_weights(shape, seed=4)
    first = build_model(shape, weights, tuning_cache=tmp_path, max_tokens=512, max_seqs=128)
    assert first.plan.source == "measured"
    measured = []
    real = autotune.measure_plan
    monkeypatch.setattr(autotune, "measure_plan", lambda *a: measured.append(1) or real(*a))
    small = build_model(shape, weights, tuning_cache=tmp_path, max_tokens=128, max_seqs=128)
    assert measured == [] and small.plan.source == "cut"
    assert small.plan.key != first.plan.key
    for role, table in small.plan.linear.items():
        times = first.plan.timings[f"linear.{role}"]
        want = plan_cut.linear_buckets(128, 128, role in ("lm_head", GREEDY_HEAD))
        assert table == tuning.choose_linear(
            {c: {m: t[str(m)] for m in want if str(m) in t} for c, t in times.items()
             if any(str(m) in t for m in want)}), role
        assert table[-1][0] == want[-1]
    assert (small.plan.elementwise, small.plan.sampling, small.plan.attention) == (
        first.plan.elementwise, first.plan.sampling, first.plan.attention)
    assert len(list((tmp_path / "tuning").glob("*.json"))) == 2
    again = build_model(shape, weights, tuning_cache=tmp_path, max_tokens=128, max_seqs=128)
    assert again.plan.source == "cached" and again.plan.linear == small.plan.linear
