"""The weir simulate / calibrate commands end to end on a small trace (no engine needed)."""
from __future__ import annotations

import json

from weir.cli import main
from weir.replay import profile as profiles

ROWS = [{"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h}
        for t, n, o, h in [(0, 900, 40, [0, 1]), (100, 1200, 30, [0, 1, 2]),
                           (250, 700, 80, [0, 3]), (400, 1500, 20, [0, 1, 2, 4]),
                           (900, 300, 10, [5])]]


def _setup(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    prof = tmp_path / "p.json"
    profiles.save(profiles.CostProfile(coef=[0.005, 1e-4, 1e-8, 1e-4, 1e-6]), prof)
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text("[scheduler]\nmax_num_batched_tokens = 512\n")
    b.write_text("[admission]\nmax_outstanding = 2\n")
    return trace, prof, a, b


def test_simulate_compares_configs_side_by_side(tmp_path, model_path, capsys):
    trace, prof, a, b = _setup(tmp_path)
    out = tmp_path / "out"
    rc = main(["simulate", str(trace), "--config", str(a), "--config", str(b),
               "--profile", str(prof), "--length-scale", "0.125", "--time-scale", "0.01",
               "--slo", "ttft=500,tpot=100", "--model", str(model_path), "--out", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert str(a) in table and str(b) in table
    assert "goodput" in table and "scaling: length ×" in table and "0.125" in table
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["comparison.txt", "summary.json", "records-0-" + _slug(a) + ".jsonl",
                            "records-1-" + _slug(b) + ".jsonl", "timeline.png",
                            "ttft_cdf.png", "tpot_cdf.png", "service.png"])
    summaries = json.loads((out / "summary.json").read_text())
    assert [s["arrived"] for s in summaries] == [5, 5]
    assert summaries[0]["rejected"] == 0 and summaries[1]["rejected"] == 3   # cap of 2


def _slug(path):
    from weir.replay.commands import _slug
    return _slug(str(path))


def test_a_bad_row_stops_the_run_naming_file_and_line(tmp_path, capsys):
    trace, prof, a, _ = _setup(tmp_path)
    trace.write_text(trace.read_text() + '{"timestamp": 5, "input_length": -3}\n')
    rc = main(["simulate", str(trace), "--config", str(a), "--profile", str(prof)])
    assert rc == 2
    assert "t.jsonl:6:" in capsys.readouterr().err


def test_simulate_with_a_missing_profile_named_stops(tmp_path, capsys):
    trace, _, a, _ = _setup(tmp_path)
    rc = main(["simulate", str(trace), "--profile", str(tmp_path / "missing.json")])
    assert rc == 2
    assert "missing.json" in capsys.readouterr().err


def test_simulate_on_a_new_machine_runs_on_the_reference_profile(tmp_path, model_path, capsys,
                                                                monkeypatch):
    """No ``weir calibrate`` run here (no ~/.cache/weir/profiles/local.json): it runs on
    the shipped reference profile, says so, and says how to measure this machine; once a
    local profile exists, that one."""
    trace, prof, a, _ = _setup(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert not profiles.default_path().exists()
    args = ["simulate", str(trace), "--config", str(a), "--model", str(model_path),
            "--length-scale", "0.125", "--time-scale", "0.01", "--no-plots"]
    assert main(args + ["--out", str(tmp_path / "ref")]) == 0
    out = capsys.readouterr()
    assert "no local cost profile" in out.err and "weir calibrate" in out.err
    assert f"profile: the shipped reference profile, {profiles.reference_path()}" in out.out
    summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert summary[0]["arrived"] == 5
    profiles.save(profiles.load(prof), profiles.default_path())     # `weir calibrate` ran
    assert main(args + ["--out", str(tmp_path / "local")]) == 0
    out = capsys.readouterr()
    assert "reference" not in out.err + out.out
    assert f"profile: {profiles.default_path()}" in out.out


def test_calibrate_from_a_step_log(tmp_path, capsys):
    steps = tmp_path / "steps.jsonl"
    rows = [{"tokens": n, "context": n + 10 * s, "seqs": s, "pairs": n * n, "measured_s":
             0.01 + 1e-4 * n + 1e-3 * s} for n in (1, 8, 64, 256, 512) for s in (1, 2, 4)]
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "prof.json"
    assert main(["calibrate", "--from-steps", str(steps), "--out", str(out)]) == 0
    prof = profiles.load(out)
    assert prof.samples == 15 and prof.median_rel_error < 0.01
    assert prof.machine["cores"] >= 1


def test_simulate_autoscale_writes_the_table_and_each_rules_timeline(tmp_path, model_path,
                                                                     capsys):
    trace, prof, _, _ = _setup(tmp_path)
    out = tmp_path / "out"
    rc = main(["simulate", str(trace), "--profile", str(prof), "--length-scale", "0.125",
               "--time-scale", "1", "--model", str(model_path), "--out", str(out),
               "--no-plots", "--autoscale", "fixed:2", "--autoscale", "headroom:0.2",
               "--min-replicas", "1", "--max-replicas", "3", "--scale-interval-s", "0.2",
               "--cold-start-s", "0.5"])
    assert rc == 0
    table = (out / "fleet.txt").read_text().splitlines()
    assert [row.split()[0] for row in table[2:]] == ["fixed:2", "headroom:0.2"]
    for i, label in enumerate(["fixed_2", "headroom_0.2"]):
        lines = (out / f"fleet-{i}-{label}.tsv").read_text().splitlines()
        assert lines[0].split("\t")[:6] == ["t_s", "asked", "ready", "alive", "recommended",
                                            "desired"]
        assert lines[1].split("\t")[4] == "-"           # the start: no evaluation yet
        evaluations = [line.split("\t") for line in lines[2:]]
        assert evaluations and all(float(e[7]) >= 0 for e in evaluations)
    assert "fixed:2" in capsys.readouterr().out
