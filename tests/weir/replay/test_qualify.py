"""``weir qualify``: the verdict's arithmetic, exact, on hand-built results; and the
command end to end on a Mooncake slice, where a candidate that admits everything FAILs and
one that restates the current policy PASSes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.config import RolloutConfig
from weir.cli import main
from weir.replay.qualify import Measured, judge, measure, wait_s
from weir.replay.types import COMPLETED, FAILED, REJECTED, RequestRecord, RunResult, Slo

DATA = Path(__file__).parent / "data" / "mooncake_conversation_1000.jsonl"
REFERENCE = Path(__file__).parents[3] / "weir" / "replay" / "profiles" / "reference-cpu.json"


def _m(label: str = "x", *, met: int = 90, misses: dict | None = None,
       waits: dict | None = None, gap: float = 100.0, busy: float = 50.0,
       failed: int = 0) -> Measured:
    misses = misses if misses is not None else {"batch": 4, "interactive": 6}
    return Measured(label=label, arrived=100, met=met, goodput=met / 100,
                    arrived_by_class={"batch": 40, "interactive": 60}, misses=misses,
                    longest_wait_s=waits if waits is not None else {"batch": 3.0,
                                                                    "interactive": 0.5},
                    fairness_gap=gap, busy_s=busy, duration_s=60.0, rejected=5, failed=failed)


def _failed(v) -> list[str]:
    return [c.name for c in v.checks if not c.passed]


def test_an_equal_candidate_passes_every_default_bar() -> None:
    v = judge(_m("cur"), _m("cand"), RolloutConfig(), [])
    assert v.passed and _failed(v) == []
    assert [c.name for c in v.checks] == [
        "applies live", "no request stalled", "goodput",
        "miss rate [batch]", "longest wait s [batch]",
        "miss rate [interactive]", "longest wait s [interactive]",
        "fairness gap", "busy s (cost)"]


def test_each_default_bar_at_its_edge_and_past_it() -> None:
    bars = RolloutConfig()             # 0.02 goodput, +0.05 misses, +2 s, +50 % gap, +10 % cost
    cur = _m()
    edge = _m(met=88, misses={"batch": 6, "interactive": 9},       # 0.15 → 0.15 (+0.05)
              waits={"batch": 5.0, "interactive": 2.5}, gap=150.0, busy=55.0)
    assert judge(cur, edge, bars).passed                            # equal to a bound holds
    past = _m(met=87, misses={"batch": 7, "interactive": 10},
              waits={"batch": 5.01, "interactive": 2.5}, gap=150.1, busy=55.1)
    assert _failed(judge(cur, past, bars)) == [
        "goodput", "miss rate [batch]", "longest wait s [batch]", "miss rate [interactive]",
        "fairness gap", "busy s (cost)"]


def test_the_values_of_a_check() -> None:
    v = judge(_m(), _m(met=80), RolloutConfig(max_goodput_drop=0.05))
    goodput = next(c for c in v.checks if c.name == "goodput")
    assert (goodput.limit, goodput.current, goodput.candidate, goodput.passed) == (
        pytest.approx(0.85), 0.9, 0.8, False)


def test_absolute_caps_and_turned_off_bars() -> None:
    off = RolloutConfig(max_goodput_drop=None, max_class_miss_increase=None,
                        max_starvation_increase_s=None, max_fairness_gap_increase=None,
                        max_cost_increase=None)
    worse = _m(met=10, misses={"batch": 40, "interactive": 50}, waits={"batch": 99.0},
               gap=1e6, busy=1e4)
    v = judge(_m(), worse, off)
    assert v.passed and [c.name for c in v.checks] == ["no request stalled"]
    caps = RolloutConfig(max_goodput_drop=None, max_class_miss_increase=None,
                         max_starvation_increase_s=None, max_fairness_gap_increase=None,
                         max_cost_increase=None, max_class_miss_rate={"interactive": 0.1,
                                                                      "*": 0.5},
                         max_starvation_s=4.0, max_fairness_gap=200.0)
    v = judge(_m(), _m(misses={"batch": 20, "interactive": 7}, waits={"batch": 4.5}), caps)
    assert _failed(v) == ["miss rate cap [interactive]", "longest wait s cap"]
    assert [c.name for c in v.checks if c.passed] == [
        "no request stalled", "miss rate cap [batch]", "fairness gap cap"]   # 0.5 == 0.5


def test_a_candidate_refused_live_or_stalling_fails() -> None:
    v = judge(_m(), _m(), RolloutConfig(), ["kv.num_blocks needs a restart (...)"])
    assert _failed(v) == ["applies live"] and "kv.num_blocks" in v.checks[0].detail
    assert _failed(judge(_m(), _m(failed=1), RolloutConfig())) == ["no request stalled"]


def _rec(i: int, cls: str, *, ttft: float | None, queue: float | None, e2e: float,
         terminal: str = COMPLETED, tenant: str = "a") -> RequestRecord:
    return RequestRecord(index=i, request_id=f"r{i}", tenant=tenant, service_class=cls,
                         arrival_s=float(i), sent_s=float(i), ttft_s=ttft, queue_s=queue,
                         e2e_s=e2e, output_tokens=1 if ttft is not None else 0,
                         prompt_tokens=10, terminal=terminal)


def test_measure_counts_each_request_in_the_current_class_with_its_slo() -> None:
    run = RunResult(label="cand", mode="simulated", duration_s=9.0, meta={"busy_s": 4.5},
                    records=[
                        _rec(0, "default", ttft=0.5, queue=0.2, e2e=0.5),   # met
                        _rec(1, "default", ttft=2.5, queue=2.0, e2e=2.5),   # late for "i"
                        _rec(2, "default", ttft=None, queue=None, e2e=0.0,
                             terminal=REJECTED),                            # refused
                        _rec(3, "default", ttft=None, queue=None, e2e=6.0,
                             terminal=REJECTED),                            # expired queued
                        _rec(4, "default", ttft=None, queue=None, e2e=1.0,
                             terminal=FAILED)])
    classes = {0: "i", 1: "i", 2: "i", 3: "b", 4: "b"}      # as the current config gave them
    m = measure(run, classes, {"i": Slo(1000, 100)}, Slo(float("inf"), float("inf")))
    assert (m.arrived, m.met, m.goodput, m.rejected, m.failed) == (5, 1, 0.2, 2, 1)
    assert m.arrived_by_class == {"b": 2, "i": 3} and m.misses == {"b": 2, "i": 2}
    assert m.longest_wait_s == {"b": 6.0, "i": 2.0}
    assert (m.busy_s, m.duration_s, m.fairness_gap) == (4.5, 9.0, 0.0)   # one tenant
    assert wait_s(run.records[1]) == 2.0 and wait_s(run.records[2]) == 0.0


# ------------------------------------------------------------------ the command, end to end
CURRENT = ('[engine]\nmax_model_len = 8192\n'
           '[admission]\ntenants = [{ name = "a" }, { name = "b" }]\n')
ARGS = ["--trace", str(DATA), "--limit", "120", "--length-scale", "0.0625",
        "--time-scale", "2", "--class-mix", "interactive=0.7,batch=0.3",
        "--tenant-mix", "a=0.5,b=0.5", "--profile", str(REFERENCE), "--json"]


def _qualify(tmp_path: Path, candidate: str, capsys) -> tuple[int, dict]:
    cur, cand = tmp_path / "current.toml", tmp_path / "candidate.toml"
    cur.write_text(CURRENT)
    cand.write_text(candidate)
    rc = main(["qualify", str(cand), "--against", str(cur), *ARGS])
    return rc, json.loads(capsys.readouterr().out)


def test_a_candidate_that_admits_everything_fails(tmp_path, model_path, capsys) -> None:
    rc, out = _qualify(tmp_path, '[admission]\npolicy = "fcfs"\n', capsys)
    assert rc == 1 and out["verdict"] == "FAIL" and out["requests"] == 120
    failed = {c["name"] for c in out["checks"] if not c["passed"]}
    assert "goodput" in failed
    assert out["candidate"]["goodput"] < out["current"]["goodput"] - 0.02


def test_a_candidate_restating_the_current_policy_passes(tmp_path, model_path,
                                                         capsys) -> None:
    rc, out = _qualify(tmp_path, '# the same policy\n[admission]\npolicy = "deadline"\n', capsys)
    assert rc == 0 and out["verdict"] == "PASS"
    assert out["candidate"] == {**out["current"], "label": out["candidate"]["label"]}


def test_a_restart_only_candidate_fails_as_refused(tmp_path, model_path, capsys) -> None:
    rc, out = _qualify(tmp_path, '[kv]\nblock_size = 32\n', capsys)
    assert rc == 1
    assert [c["name"] for c in out["checks"] if not c["passed"]][0] == "applies live"


def test_a_bad_candidate_file_is_an_input_error(tmp_path, capsys) -> None:
    cur = tmp_path / "current.toml"
    cur.write_text(CURRENT)
    (tmp_path / "c.toml").write_text('[admission]\npolicy = "nope"\n')
    assert main(["qualify", str(tmp_path / "c.toml"), "--against", str(cur), *ARGS]) == 2
    assert "weir qualify:" in capsys.readouterr().err
