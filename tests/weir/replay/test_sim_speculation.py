"""The simulator with speculative decoding: verify steps timed with their draft tokens,
accepted drafts drawn per verify from the class's true rate (geometric, seeded), and the
policies compared: the scheduler's k against none and against a fixed k, at low and high
load; and ``weir simulate --speculative``."""
from __future__ import annotations

import json

import pytest

from schemas.config import load_config
from weir.cli import main
from weir.replay.commands import parse_speculative, with_speculative
from weir.replay.profile import CostProfile
from weir.replay.report import summarize
from weir.replay.sim import Simulator, fast_block_hashes
from weir.replay.synth import TokenSynth
from weir.replay.types import COMPLETED, Scaling, Slo, TraceRequest

# 10 ms a step and 1 ms a token computed: at batch 1 a draft costs a tenth of the step, at
# batch 64 a decode row's token is 1.16 ms of the step, its draft 1 ms
PROFILE = CostProfile(coef=[0.010, 0.001, 0.0, 0.0, 0.0])
NONE = Slo(1e9, 1e9)


def config(spec: dict | None = None, max_num_seqs: int = 64):
    return load_config(None, topology={"run_dir": "/nonexistent"},
                       admission={"policy": "fcfs", "classes": []},
                       scheduler={"max_num_seqs": max_num_seqs},
                       speculative=spec or {"method": "off"})


def simulate(requests, spec=None, seed=0, **kw):
    cfg = config(spec)
    synth = TokenSynth(range(1000, 5000), 32, seed=7)
    sim = Simulator(cfg, PROFILE, label="t", tokens=synth.tokens,
                    hashes=fast_block_hashes(cfg.kv.block_size), seed=seed,
                    cost_prior=True, **kw)
    return sim, sim.run(requests, Scaling(block_size=32))


def req(i, t, n_in=64, n_out=64):
    return TraceRequest(index=i, arrival_s=t, input_tokens=n_in, output_tokens=n_out)


SCHEDULER = {"method": "ngram", "max_k": 4, "acceptance_prior": 0.7}
FIXED = SCHEDULER | {"control": "fixed"}


def test_a_verify_step_is_timed_with_its_drafts():
    # nothing accepted: each verify emits one token, in a step of 1 + 2 tokens
    _, run = simulate([req(0, 0.0, n_in=20, n_out=5)],
                      {"method": "ngram", "max_k": 2, "control": "fixed",
                       "acceptance_prior": 0.0})
    (rec,) = run.records
    assert rec.terminal == COMPLETED and rec.output_tokens == 5
    assert rec.ttft_s == pytest.approx(0.010 + 0.020)           # the 20-token prefill
    # k 2, 2, then what max_tokens leaves room for: 1, 0
    assert rec.itl_s == pytest.approx([0.013, 0.013, 0.012, 0.011])
    assert run.meta["speculation"]["spec.verifies"] == 3
    assert run.meta["speculation"]["spec.accepted.default"] == 0


def test_accepted_drafts_are_geometric_at_the_true_rate_and_seeded():
    spec = {"method": "ngram", "max_k": 4, "control": "fixed", "acceptance_prior": 0.5}
    requests = [req(0, 0.0, n_in=16, n_out=2000)]
    sim, run = simulate(requests, spec)
    st = run.meta["speculation"]
    # each verify emits 1 + a + a^2 + a^3 + a^4 tokens on average: 1.9375 at 0.5
    assert st["spec.emitted"] / st["spec.verifies"] == pytest.approx(1.9375, abs=0.08)
    (rec,) = run.records
    assert rec.output_tokens == 2000 == 1 + st["spec.emitted"]
    # a verify's tokens arrive together: each accepted draft 0 s after the token before it
    assert sum(gap == 0.0 for gap in rec.itl_s) == st["spec.accepted.default"]
    again = simulate(requests, spec)[1]
    assert [r.itl_s for r in again.records] == [r.itl_s for r in run.records]
    other = simulate(requests, spec, seed=1)[1]
    assert [r.itl_s for r in other.records] != [r.itl_s for r in run.records]
    # the true rate may differ from the scheduler's prior
    _, low = simulate(requests, spec, acceptance={"*": 0.1})
    st = low.meta["speculation"]
    assert st["spec.emitted"] / st["spec.verifies"] == pytest.approx(1.1111, abs=0.03)


def test_the_true_rate_is_the_class_prior():
    cfg = config({"method": "ngram", "acceptance_prior": 0.4,
                  "class_priors": {"interactive": 0.8}})
    sim = Simulator(cfg, PROFILE, tokens=lambda r: [1] * 8, hashes=lambda ids, t: [])
    assert sim.acceptance("interactive") == 0.8 and sim.acceptance("batch") == 0.4
    sim = Simulator(cfg, PROFILE, tokens=lambda r: [1] * 8, hashes=lambda ids, t: [],
                    acceptance={"batch": 0.1, "*": 0.2})
    assert (sim.acceptance("interactive"), sim.acceptance("batch"),
            sim.acceptance("other")) == (0.8, 0.1, 0.2)


def test_without_speculation_nothing_changes():
    _, run = simulate([req(0, 0.0, n_in=20, n_out=5)])
    assert run.meta["speculation"] == {}
    assert run.records[0].itl_s == pytest.approx([0.011] * 4)


def compare(requests):
    out = {}
    for name, spec in (("off", None), ("scheduler", SCHEDULER), ("fixed", FIXED)):
        _, run = simulate(requests, spec)
        s = summarize(run, {}, NONE)
        assert s.completed == len(requests)
        out[name] = s
    return out


def test_at_low_load_the_schedulers_speculation_lowers_tpot():
    runs = compare([req(i, 2.0 * i) for i in range(8)])       # one request at a time
    off, sched = runs["off"].tpot_ms.p50, runs["scheduler"].tpot_ms.p50
    assert off == pytest.approx(11.0)                          # 10 ms + one token
    # k = 4 at batch 1: 14 ms a verify for 1 + 0.7 + ... + 0.7^4 = 2.77 tokens on average
    assert sched < 0.6 * off
    assert runs["fixed"].tpot_ms.p50 < 0.6 * off


def test_at_high_load_the_scheduler_keeps_throughput_where_a_fixed_k_loses_it():
    runs = compare([req(i, 0.001 * i) for i in range(128)])    # 128 at once, 64 at a time
    off = runs["off"].output_tok_s
    # k stays 0 while the batch is full (a draft's 1 ms for 0.7 of a token); a row drafts
    # in steps the batch has shrunk, and in a few with a long prefill chunk, where the
    # rule counts only the decode rows' tokens (within 2% here)
    assert runs["scheduler"].output_tok_s >= 0.98 * off
    # every row computing 5 tokens for 2.77: about a quarter less
    assert runs["fixed"].output_tok_s < 0.85 * off
    assert runs["fixed"].tpot_ms.p50 > 1.3 * runs["off"].tpot_ms.p50


# ---------------------------------------------------------------- the command

def test_parse_speculative():
    assert parse_speculative("off") == {"method": "off"}
    assert parse_speculative("ngram:4") == {"method": "ngram", "max_k": 4}
    assert parse_speculative("ngram:3:0.6:fixed") == {
        "method": "ngram", "max_k": 3, "acceptance_prior": 0.6, "control": "fixed"}
    assert parse_speculative("draft:2:scheduler") == {
        "method": "draft", "max_k": 2, "control": "scheduler"}
    for bad in ("", "ngram", "ngram:x", "foo:2", "ngram:2:0.5:0.5:fixed", "ngram:2:often"):
        with pytest.raises(ValueError):
            parse_speculative(bad)
    cfg = load_config(None, topology={"run_dir": "/nonexistent"},
                      speculative={"class_priors": {"batch": 0.2}})
    spec = with_speculative(cfg, "ngram:4:0.7").speculative
    assert (spec.method, spec.max_k, spec.acceptance_prior, spec.class_priors) == (
        "ngram", 4, 0.7, {"batch": 0.2})
    assert with_speculative(cfg, None) is cfg


def test_simulate_compares_speculation_policies(tmp_path, model_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 200,
                                         "output_length": 60, "hash_ids": [i]}) + "\n"
                             for i, t in enumerate(range(0, 4000, 1000))))
    prof = tmp_path / "p.json"
    from weir.replay import profile as profiles
    profiles.save(PROFILE, prof)
    rc = main(["simulate", str(trace), "--profile", str(prof), "--model", str(model_path),
               "--length-scale", "0.25", "--speculative", "off", "--speculative",
               "ngram:4:0.7", "--speculative", "ngram:4:0.7:fixed", "--no-plots",
               "--out", str(tmp_path / "out")])
    assert rc == 0
    out = capsys.readouterr()
    assert "defaults spec=off" in out.out and "defaults spec=ngram:4:0.7:fixed" in out.out
    assert "defaults spec=ngram:4:0.7: speculation:" in out.err
    summaries = json.loads((tmp_path / "out" / "summary.json").read_text())
    tpot = [s["tpot_ms"]["p50"] for s in summaries]
    assert tpot[1] < 0.6 * tpot[0] and tpot[2] < 0.6 * tpot[0]
    rc = main(["simulate", str(trace), "--profile", str(prof), "--speculative", "ngram:40"])
    assert rc == 2 and "max_k" in capsys.readouterr().err
