"""Cost profiles: fitted to step logs, non-negative, robust to a stalled step, and strict
about their input."""
from __future__ import annotations

import json

import pytest

from components.costs.cost_model import StepShape
from weir.replay import profile as profiles

TRUE = [0.003, 2e-4, 1e-7, 5e-4, 2e-6]


def steps(coef=TRUE):
    out = []
    for tokens, context, seqs, pairs in [(1, 64, 1, 64), (8, 900, 8, 900), (64, 9000, 64, 9000),
                                         (256, 256, 1, 32896), (512, 1024, 1, 393472),
                                         (2048, 2048, 1, 2098176), (40, 5000, 33, 20000),
                                         (16, 1500, 16, 1500), (128, 128, 1, 8256),
                                         (300, 4000, 20, 60000), (32, 3000, 32, 3000),
                                         (1024, 3072, 2, 1049600)]:
        t = coef[0] + coef[1] * tokens + coef[2] * pairs + coef[3] * seqs + coef[4] * context
        out.append({"tokens": tokens, "context": context, "seqs": seqs, "pairs": pairs,
                    "measured_s": t})
    return out


def test_fit_recovers_the_coefficients():
    prof = profiles.fit(steps())
    assert prof.coef == pytest.approx(TRUE, rel=1e-6)
    assert prof.median_rel_error < 1e-9
    assert prof.predict(StepShape(64, 9000, 64, 9000)) == pytest.approx(
        TRUE[0] + TRUE[1] * 64 + TRUE[2] * 9000 + TRUE[3] * 64 + TRUE[4] * 9000)


def test_no_coefficient_is_negative():
    # a workload whose least-squares optimum wants a negative per-sequence cost
    prof = profiles.fit(steps([0.003, 2e-4, 1e-7, -1e-4, 2e-6]))
    assert all(c >= 0 for c in prof.coef)


def test_a_stalled_step_does_not_skew_the_fit():
    rows = steps()
    rows[0] = dict(rows[0], measured_s=rows[0]["measured_s"] * 40)   # a 40x stall
    prof = profiles.fit(rows + steps())
    assert prof.coef == pytest.approx(TRUE, rel=1e-6)


def test_too_few_steps_is_an_error():
    with pytest.raises(profiles.ProfileError, match="at least 10 measured steps, got 3"):
        profiles.fit(steps()[:3])


def test_step_log_errors_name_file_and_line(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps(steps()[0]) + "\n\n{broken\n")
    with pytest.raises(profiles.ProfileError, match=r"steps.jsonl:3: not JSON"):
        profiles.read_step_log(path)
    path.write_text(json.dumps({"tokens": 1, "context": 2, "seqs": True, "pairs": 1,
                                "measured_s": 0.1}) + "\n")
    with pytest.raises(profiles.ProfileError, match=r"steps.jsonl:1: a step needs numeric"):
        profiles.read_step_log(path)


def test_save_and_load(tmp_path):
    prof = profiles.fit(steps(), source="test", machine={"cpu": "x"})
    profiles.save(prof, tmp_path / "p.json")
    assert profiles.load(tmp_path / "p.json") == prof
    (tmp_path / "bad.json").write_text('{"coef": [1, 2]}')
    with pytest.raises(profiles.ProfileError, match="bad.json: a profile needs"):
        profiles.load(tmp_path / "bad.json")
