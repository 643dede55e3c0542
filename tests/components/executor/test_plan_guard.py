"""Starts of an executor against the plan cache, with the measurement and the load on the
cores injected: a plan measured under load is stored provisional and measured again at the
next start that finds the cores quieter; a clean one is kept and never measured again (no
probe of the load either); a worse new measurement does not replace the stored one."""
import pytest

from components.executor import autotune
from kernels import tuning_guard
from kernels.tuning import KernelPlan
from kernels.tuning_guard import LoadMeter, LoadSample

KEY = "k" * 20
MACHINE = {"cpu": "test"}


class Machine:
    """What the cores do at each start: ``loads`` is the load read over each window the
    executor watches, in order (a probe before re-measuring, or a measurement)."""

    def __init__(self):
        self.loads: list[float] = []
        self.windows = 0
        self.measured = 0
        self.tables: list[dict] = []

    def meter(self):
        samples = []

        def read():
            if not samples:                # the window's start
                load = self.loads.pop(0)
                self.windows += 1
                samples.append(load)
                return LoadSample(0.0, 0.0, 0.0)
            # 10 s on 2 cores, 4 s of them this process's own
            return LoadSample(10.0, 4.0 + samples[0] * 20.0, 4.0)
        return LoadMeter(read=read, cores=2, sleep=lambda s: None)

    def measure(self):
        self.measured += 1
        table = self.tables.pop(0)
        return KernelPlan({"qkv": table}, "native", "native", "cpu")

    def start(self, path):
        return autotune.cached_or_measured(path, KEY, MACHINE, self.measure, self.meter)


@pytest.fixture
def path(tmp_path):
    return tmp_path / "tuning" / f"{KEY}.json"


def test_a_loaded_plan_is_provisional_and_replaced_at_the_next_quieter_start(path):
    m = Machine()
    # start 1: a neighbour holds 40% of the cores; the load sends qkv's big steps to torch
    m.loads, m.tables = [0.4], [[(512, "amx"), (2048, "torch")]]
    first = m.start(path)
    assert (first.source, first.linear["qkv"]) == ("measured", [(512, "amx"), (2048, "torch")])
    assert first.guard["provisional"] == ("other processes used 40% of the 2 cores while it "
                                          "was measured (limit 20%)")
    assert (first.guard["load"], first.guard["attempts"]) == (0.4, 1)
    # start 2: the probe finds the cores quiet (0.0 < 0.4): measured again, clean, replaced
    m.loads, m.tables = [0.0, 0.02], [[(512, "amx"), (2048, "onednn")]]
    second = m.start(path)
    assert (m.measured, m.windows) == (2, 3)
    assert (second.source, second.linear["qkv"]) == ("measured", [(512, "amx"),
                                                                  (2048, "onednn")])
    assert (second.guard["provisional"], second.guard["load"]) == ("", 0.02)
    # start 3: the clean plan from the cache, no measurement and no probe
    third = m.start(path)
    assert (m.measured, m.windows) == (2, 3)
    assert (third.source, third.linear["qkv"]) == ("cached", [(512, "amx"), (2048, "onednn")])
    assert third.summary()["guard"] == "clean"


def test_a_clean_plan_is_kept_and_never_measured_again(path):
    m = Machine()
    m.loads, m.tables = [0.03], [[(2048, "amx")]]
    assert m.start(path).guard["provisional"] == ""
    for _ in range(3):
        plan = m.start(path)
        assert plan.source == "cached" and plan.linear["qkv"] == [(2048, "amx")]
    assert (m.measured, m.windows) == (1, 1)          # one window: the measurement itself


def test_a_provisional_plan_waits_for_quieter_cores_and_keeps_the_better_measurement(path):
    m = Machine()
    m.loads, m.tables = [0.3], [[(512, "amx"), (2048, "torch")]]
    m.start(path)
    # busier now than then (0.5 >= 0.3): not measured, the provisional plan is used
    m.loads = [0.5]
    plan = m.start(path)
    assert (plan.source, m.measured, m.windows) == ("cached", 1, 2)
    # quieter at the probe (0.2), but the measurement itself is busier (0.45): kept, counted
    m.loads, m.tables = [0.2, 0.45], [[(2048, "torch")]]
    plan = m.start(path)
    assert (m.measured, plan.linear["qkv"]) == (2, [(512, "amx"), (2048, "torch")])
    assert (plan.guard["load"], plan.guard["attempts"]) == (0.3, 2)
    # quieter again, still loaded (0.25 < 0.3): the less loaded one replaces it
    m.loads, m.tables = [0.1, 0.25], [[(2048, "amx")]]
    plan = m.start(path)
    assert (plan.linear["qkv"], plan.guard["load"], plan.guard["attempts"]) == \
        ([(2048, "amx")], 0.25, 3)
    # three measurements: kept as it is, no probe
    windows = m.windows
    plan = m.start(path)
    assert (plan.source, m.measured, m.windows) == ("cached", 3, windows)
    assert plan.guard["provisional"]


def test_a_plan_from_before_the_guard_is_measured_once_again(path):
    m = Machine()
    old = KernelPlan({"qkv": [(2048, "torch")]}, "native", "native", "cpu")
    path.parent.mkdir(parents=True)
    autotune.tuning.store(path, {"key": KEY, "machine": MACHINE,
                                 **{k: v for k, v in old.to_json().items() if k != "guard"}})
    m.loads, m.tables = [0.01], [[(2048, "onednn")]]
    plan = m.start(path)
    assert (plan.source, plan.linear["qkv"], m.windows) == ("measured", [(2048, "onednn")], 1)
    assert m.start(path).source == "cached" and m.measured == 1


def test_a_plan_with_unsettled_timings_is_provisional_under_no_load(path):
    m = Machine()
    m.loads, m.tables = [0.0], [[(2048, "onednn")]]
    real = m.measure

    def measure():
        plan = real()
        plan.anomalies = {"linear.qkv": {"torch@1024": {"status": "unsettled", "ratio": 0.6}}}
        return plan
    m.measure = measure
    plan = m.start(path)
    assert plan.guard["provisional"].endswith("timed again on busy cores: "
                                              "linear.qkv.torch@1024")
    assert autotune.tuning.load_cached(path)["guard"]["anomalies"] == plan.anomalies
    assert tuning_guard.due(plan.guard, lambda: 0.0)   # measured again at a quiet start


def test_weir_plan_lists_the_plans_and_marks_one_to_measure_again(tmp_path, monkeypatch,
                                                                   capsys):
    from weir.cli import main

    monkeypatch.setenv("WEIR_CACHE_DIR", str(tmp_path))
    path = tmp_path / "tuning" / f"{KEY}.json"
    m = Machine()
    m.loads, m.tables = [0.4], [[(2048, "torch")]]
    m.start(path)
    (tmp_path / "tuning" / "steps.json").write_text('{"key": "s", "samples": []}')
    capsys.readouterr()                                  # the start's warning
    assert main(["plan", "--json"]) == 0
    [row] = __import__("json").loads(capsys.readouterr().out)
    assert (row["key"], row["load"]) == (KEY, "40%")
    assert row["status"] == ("provisional: other processes used 40% of the 2 cores while it "
                             "was measured (limit 20%) (measured again at a quieter start)")
    assert main(["plan", "--key", "zz"]) == 1
    assert main(["plan", "--key", "kkk", "--remeasure"]) == 0
    assert "remeasure at next start" in capsys.readouterr().out
    # the next start measures it again whatever the load, and the new plan replaces it
    m.loads, m.tables = [0.5], [[(2048, "onednn")]]
    plan = m.start(path)
    assert (m.measured, plan.linear["qkv"], plan.guard["attempts"]) == (2, [(2048, "onednn")],
                                                                         1)
    assert "remeasure" not in plan.guard
