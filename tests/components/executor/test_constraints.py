"""Structured output in the executor: a random-weight model (so nothing but the masks makes
its output well-formed) with SmolLM2's real vocabulary and tokenizer. Every constrained
sequence, greedy or sampled, side by side with others in one batch, ends (by EOS) with a
whole sentence of its language; a sequence learned again mid-output (recomputed after
preemption) continues exactly as one that never left; the masks are exactly the tokens
llguidance accepts, and an unconstrained row beside them is untouched."""
from __future__ import annotations

import json
import random
import re
import threading

import numpy as np
import pytest
import torch

from components.executor.build import build_model
from components.executor.constraints import Constraint, Grammars, apply_constraints
from components.executor.runner import ModelRunner
from components.executor.synthetic import ModelShape, random_weights
from components.model.structured import check, grammar_of, ll_tokenizer
from components.model.vocab import load_tokenizer
from schemas.wire import NewSeq, SeqStep, StepPlan, StructuredOutput

llguidance = pytest.importorskip("llguidance")

VOCAB = 49152
SHAPE = ModelShape("tiny-smollm-vocab", num_layers=2, hidden_size=64, intermediate_size=128,
                   num_heads=1, num_kv_heads=1, head_dim=64, vocab_size=VOCAB,
                   max_position=512)
BLOCK = 16
EOS = 2
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "ok", "n"],
          "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
REGEX = r"[0-9]{3}-(yes|no)"
CHOICES = ("alpha", "beta gamma", "δ")
LARK = 'start: "x" ("," "y"){1,3}'
GBNF = 'root ::= "(" [a-c]{1,4} ")"'


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        return (set(value) == {"kind", "ok", "n"} and value["kind"] in ("cat", "dog")
                and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    if kind == "lark":
        return re.fullmatch(r"x(,y){1,3}", text) is not None
    return re.fullmatch(r"\([a-c]{1,4}\)", text) is not None


FORMS = {"json": StructuredOutput(json=json.dumps(SCHEMA)),
         "regex": StructuredOutput(regex=REGEX), "choice": StructuredOutput(choice=CHOICES),
         "lark": StructuredOutput(grammar=LARK), "gbnf": StructuredOutput(grammar=GBNF)}


@pytest.fixture(scope="module")
def bundle(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="module")
def vocab(bundle):
    return ll_tokenizer(bundle, VOCAB)


@pytest.fixture(scope="module")
def model():
    return build_model(SHAPE, random_weights(SHAPE, seed=3), dtype=torch.float32)


def _runner(model, vocab) -> ModelRunner:
    return ModelRunner(model, model.new_kv_cache(64, BLOCK), grammars=Grammars(lambda: vocab))


def _decode(runner: ModelRunner, seqs: dict[int, NewSeq], max_steps: int = 40,
            first_step: int = 1) -> dict[int, list[int]]:
    """Prefill ``seqs`` together, then decode them all until each has sampled EOS (or
    ``max_steps`` have run)."""
    out = {sid: [] for sid in seqs}
    live = set(seqs)
    plan = StepPlan(first_step, list(seqs.values()),
                    [SeqStep(sid, len(n.token_ids) - n.num_computed, [], True)
                     for sid, n in seqs.items()], [])
    for step in range(max_steps):
        result = runner.step(plan)
        for sid, tok in zip(result.seq_ids, result.token_ids):
            out[sid].append(tok)
            if tok == EOS:
                live.discard(sid)
        if not live:
            break
        plan = StepPlan(first_step + step + 1, [], [SeqStep(sid, 1, [], True)
                                                    for sid in sorted(live)], sorted(
                                                        set(seqs) - live))
    return out


def _new(sid: int, prompt: list[int], so: StructuredOutput | None, temperature: float = 0.0,
         seed: int | None = None) -> NewSeq:
    blocks = list(range(sid * 6, sid * 6 + 6))
    return NewSeq(sid, list(prompt), len(prompt), 0, blocks, temperature, 1.0, 0, seed,
                  structured=so)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_language_ends_in_a_whole_sentence_beside_the_others(model, vocab, bundle,
                                                                    temperature):
    rng = random.Random(5)
    prompt = [rng.randrange(100, VOCAB) for _ in range(21)]
    kinds = list(FORMS)
    seqs = {i + 1: _new(i + 1, prompt, FORMS[k], temperature, seed=i) for i, k in
            enumerate(kinds)}
    seqs[9] = _new(9, prompt, None)
    out = _decode(_runner(model, vocab), seqs)
    for i, kind in enumerate(kinds):
        tokens = out[i + 1]
        assert tokens[-1] == EOS
        text = bundle.decode(tokens[:-1])
        assert valid(kind, text), (kind, text)
    # the unconstrained row is what it is alone: a mask never reaches a row beside it
    assert _decode_some(_runner(model, vocab), seqs[9], len(out[9])) == out[9]


def test_a_sequence_learned_again_mid_output_continues_as_if_it_never_left(model, vocab,
                                                                          bundle):
    """Preemption by recompute: the executor forgets the sequence and is sent it again,
    prompt and output so far, from position 0; its matcher catches up on the output."""
    prompt = [1000 + 37 * i for i in range(18)]
    so = FORMS["json"]
    whole = _decode(_runner(model, vocab), {1: _new(1, prompt, so)})[1]
    assert len(whole) > 6
    runner = _runner(model, vocab)
    first = _decode_some(runner, _new(1, prompt, so), 5)
    assert first == whole[:5]
    again = NewSeq(1, prompt + first, len(prompt), 0, list(range(40, 46)), 0.0, 1.0, 0, None,
                   structured=so)
    runner.step(StepPlan(100, [], [], [1]))                    # dropped (preempted)
    rest = _decode(runner, {1: again}, first_step=101)[1]
    assert first + rest == whole
    assert valid("json", bundle.decode(whole[:-1]))


def _step_within(runner: ModelRunner, plan: StepPlan, timeout: float = 60.0):
    """``runner.step(plan)`` on a thread; its result, or an AssertionError if it has not
    returned within ``timeout`` (it is waiting for something it should not)."""
    got = []
    worker = threading.Thread(target=lambda: got.append(runner.step(plan)), daemon=True)
    worker.start()
    worker.join(timeout)
    assert got, f"step {plan.step_id} did not return within {timeout}s"
    return got[0]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "inline"])
def test_a_language_still_compiling_holds_up_no_other_sequence(model, vocab, bundle, overlap):
    """The vocabulary is built on the grammar thread, here held back by a gate: a step with
    a constrained sequence still prefilling, beside an unconstrained one, runs to its end
    (the matcher is made when the sequence first samples, compiled beside the forward pass
    or on the step's thread); then the constrained sequence's first sample takes a token
    of its language."""
    gate = threading.Event()
    grammars = Grammars(lambda: (gate.wait(), vocab)[1], overlap=overlap)
    runner = ModelRunner(model, model.new_kv_cache(64, BLOCK), grammars=grammars)
    prompt = [900 + 13 * i for i in range(40)]
    try:
        first = _step_within(runner, StepPlan(1, [_new(1, prompt, FORMS["choice"]),
                                                 _new(2, prompt[:20], None)],
                                              [SeqStep(1, 16, [], False),
                                               SeqStep(2, 20, [], True)], []))
        assert first.seq_ids == [2]
        assert not grammars._vocab.done()          # nothing above waited for it
        gate.set()
        second = _step_within(runner, StepPlan(2, [], [SeqStep(1, 24, [], True),
                                                       SeqStep(2, 1, [], True)], []))
    finally:
        gate.set()
    assert second.seq_ids == [1, 2]
    token = second.token_ids[0]
    assert any(bundle.decode([token]) == c[:len(bundle.decode([token]))] for c in CHOICES)
    assert runner.grammar_wait_ns >= 0 and runner.constrained_rows == 1


def _decode_some(runner: ModelRunner, new: NewSeq, n: int) -> list[int]:
    got = runner.step(StepPlan(1, [new], [SeqStep(new.seq_id, len(new.token_ids), [], True)],
                               [])).token_ids
    for step in range(n - 1):
        got += runner.step(StepPlan(2 + step, [], [SeqStep(new.seq_id, 1, [], True)],
                                    [])).token_ids
    return got


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_masks_are_exactly_the_tokens_llguidance_accepts(vocab, bundle, native):
    grammars = Grammars(lambda: vocab)
    c = grammars.constraint(FORMS["regex"], bundle.encode("12"))
    json_c = grammars.constraint(FORMS["json"], bundle.encode('{"kind": "cat", "ok'))
    logits = torch.randn(4, VOCAB)
    want = logits.clone()
    apply_constraints(logits, [(1, c), (3, json_c)], native)
    assert torch.equal(logits[0], want[0]) and torch.equal(logits[2], want[2])
    for row in (1, 3):          # what is allowed keeps its value
        kept = torch.isfinite(logits[row])
        assert torch.equal(logits[row][kept], want[row][kept])
    json_next = {bundle.decode([t]) for t in torch.isfinite(logits[3]).nonzero()[:, 0].tolist()}
    assert '":' in json_next and "x" not in json_next
    allowed = set(torch.isfinite(logits[1]).nonzero()[:, 0].tolist())
    probe = grammars.constraint(FORMS["regex"], bundle.encode("12")).matcher
    # every allowed token and 3000 others, each asked of the matcher itself
    rng = random.Random(0)
    for t in allowed | {rng.randrange(VOCAB) for _ in range(3000)}:
        assert (probe.validate_tokens([t]) == 1) == (t in allowed), t
    assert {bundle.decode([t]) for t in allowed} <= set("0123456789")
    assert len(allowed) >= 10


def test_a_matcher_in_error_allows_eos_alone(vocab, bundle):
    """(llguidance's own behaviour, which Constraint.fill relies on.)"""
    fresh = llguidance.LLMatcher(vocab, grammar_of(FORMS["choice"]), log_level=0)
    c = Constraint(lambda: fresh, [])
    c.matcher.consume_token(bundle.encode("zzz")[0])         # not in the language
    assert c.matcher.is_error()
    row = np.zeros((VOCAB + 31) // 32, dtype=np.int32)
    c.fill(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    assert bits.nonzero()[0].tolist() == [EOS]


def test_a_language_past_its_limits_is_named_in_its_steps_result(model, vocab, bundle):
    """``a{1000}{1000}`` passes the tokenizer's check, then reaches the lexer's limits on
    its first token. That step's result names the sequence and llguidance's reason (the
    scheduler fails its request; it ended ``stop`` with text outside its language before),
    its row allows EOS alone from then on (never an empty row), and the row beside it runs
    on untouched."""
    so = StructuredOutput(regex="a{1000}{1000}")
    assert check(so, vocab) is None
    runner = _runner(model, vocab)
    seqs = {1: _new(1, [500 + i for i in range(20)], so), 2: _new(2, [700] * 20, None)}
    first = runner.step(StepPlan(1, list(seqs.values()),
                                 [SeqStep(sid, 20, [], True) for sid in seqs], []))
    why = "lexer error: too many expressions constructed"
    assert first.structured_errors == [(1, why)]
    assert set(bundle.decode([first.token_ids[0]])) == {"a"}
    alone = _decode(_runner(model, vocab), {2: _new(2, [700] * 20, None)}, max_steps=4)
    out = {1: [first.token_ids[0]], 2: [first.token_ids[1]]}
    for step in range(2, 5):
        res = runner.step(StepPlan(step, [], [SeqStep(sid, 1, [], True) for sid in seqs], []))
        assert res.structured_errors == [(1, why)]
        for sid, tok in zip(res.seq_ids, res.token_ids):
            out[sid].append(tok)
    assert out[1][1:] == [EOS] * 3
    assert out[2] == alone[2]


def test_a_stopped_language_ignores_what_follows(vocab, bundle):
    """With ``ignore_eos`` a sequence keeps sampling after its language ends: EOS only."""
    c = Grammars(lambda: vocab).constraint(FORMS["choice"], bundle.encode("alpha") + [EOS])
    assert c.matcher.is_stopped()
    c.advance(EOS)
    logits = torch.zeros(1, VOCAB)
    apply_constraints(logits, [(0, c)])
    assert torch.isfinite(logits[0]).nonzero()[:, 0].tolist() == [EOS]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "inline"])
def test_one_fresh_matcher_per_language_is_kept_and_copied(vocab, bundle, overlap):
    grammars = Grammars(lambda: vocab, keep=2, overlap=overlap)
    compiled, compile = [], grammars._compile
    grammars._compile = lambda so: (compiled.append(so), compile(so))[1]
    a = grammars.constraint(FORMS["choice"], [])
    b = grammars.constraint(FORMS["choice"], bundle.encode("alpha"))
    assert a.matcher is not b.matcher and not a.matcher.is_stopped()
    assert b.matcher.is_accepting() and not a.matcher.is_accepting()
    assert compiled == [FORMS["choice"]]                  # once, for both sequences
    grammars.constraint(FORMS["regex"], [])
    grammars.constraint(FORMS["lark"], [])
    assert list(grammars._fresh) == [FORMS["regex"], FORMS["lark"]]
