"""Logit penalties and bias, and logprobs: the adjustment against a plain reference (exact,
ms), and the executor's whole step path against Hugging Face on the real model."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from components.executor.build import build_model
from components.executor.runner import ModelRunner
from components.executor.sampling import Logprobs, RowPenalties, apply_penalties, sample
from components.model.fetch import cache_dir
from schemas.wire import NewSeq, Penalties, SeqStep, StepPlan

V = 50


def reference(row: torch.Tensor, ids: list[int], prompt_len: int, pen: Penalties) -> torch.Tensor:
    """The definitions, one token at a time, in float64."""
    x = row.double().clone()
    if pen.repetition != 1.0:
        for t in set(ids):
            if 0 <= t < len(x):
                x[t] = x[t] / pen.repetition if x[t] > 0 else x[t] * pen.repetition
    for t, c in Counter(ids[prompt_len:]).items():
        if 0 <= t < len(x):
            x[t] -= pen.frequency * c + pen.presence
    for t, b in pen.bias:
        if 0 <= t < len(x):
            x[t] += b
    if len(ids) - prompt_len < pen.min_tokens:
        for t in pen.stop_ids:
            if 0 <= t < len(x):
                x[t] = -torch.inf
    return x


CASES = [
    ([1, 2, 3, 3, 9, 9, 9], 3, Penalties(0.5, 0.25, 1.0, [])),          # output 3 9 9 9
    ([4, 4, 7, 1, 1, 4], 2, Penalties(0.0, 0.0, 1.7, [])),              # prompt and output
    ([5, 6], 2, Penalties(-0.5, -1.0, 0.8, [])),                        # no output yet
    ([8, 8, 8, 2], 1, Penalties(1.0, 2.0, 1.3, [(8, -100.0), (0, 3.5)])),
    # ids past the ends are skipped
    ([3], 1, Penalties(0.0, 0.0, 1.0, [(49, 100.0), (V, 5.0), (-1, 5.0)])),
    ([V + 3, -2, 6, V + 9], 1, Penalties(2.0, 2.0, 2.0, [])),           # so are out-of-vocab tokens
    # min_tokens: stop ids banned while the output is shorter (2 < 3; a bias cannot lift
    # the ban), free once it is not (3 = 3)
    ([1, 2, 5, 6], 2, Penalties(0.0, 0.0, 1.0, [(4, 100.0)], 3, [4, 9, V, -1])),
    ([1, 2, 5, 6, 7], 2, Penalties(0.0, 0.0, 1.0, [], 3, [4, 9])),
]
# what validation refuses, from a peer that skipped it: ignored, never a NaN row
HOSTILE = [([1, 2, 2], 1, Penalties(float("nan"), 1.0, -3.0, [(4, float("inf")), (5, 1.0)])),
           ([1, 2, 2], 1, Penalties(0.0, float("inf"), float("nan"), [(4, float("nan"))]))]


def test_penalties_match_the_definitions():
    logits = torch.randn(len(CASES) + 1, V, generator=torch.Generator().manual_seed(3)) * 4
    logits[:, 2] = 0.0                                  # a zero logit: multiplied, stays zero
    before = logits.clone()
    apply_penalties(logits, [(i, ids, pl, RowPenalties(pen))
                             for i, (ids, pl, pen) in enumerate(CASES)])
    for i, (ids, pl, pen) in enumerate(CASES):
        torch.testing.assert_close(logits[i].double(), reference(before[i], ids, pl, pen),
                                   atol=1e-5, rtol=1e-6)
    assert torch.equal(logits[-1], before[-1])          # a row without penalties: untouched
    assert not torch.equal(logits[0], before[0])


def test_values_validation_refuses_are_skipped_not_spread():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4))
    before = logits.clone()
    apply_penalties(logits, [(i, ids, pl, RowPenalties(pen))
                             for i, (ids, pl, pen) in enumerate(HOSTILE)])
    assert logits.isfinite().all()
    expect = before[0].clone()
    expect[5] += 1.0                                    # the one finite bias
    assert torch.equal(logits[0], expect) and torch.equal(logits[1], before[1])


def test_penalties_move_greedy_and_bias_forces_or_bans_a_token():
    logits = torch.zeros(3, V)
    logits[:, 7] = 5.0
    apply_penalties(logits, [(0, [1, 7], 1, RowPenalties(Penalties(0.0, 0.0, 10.0))),  # 5 -> .5
                             (1, [1], 1, RowPenalties(Penalties(0.0, 0.0, 1.0, [(7, -100.0)]))),
                             (2, [1], 1, RowPenalties(Penalties(0.0, 0.0, 1.0, [(30, 100.0)])))])
    logits[0, 11] = 1.0
    picked = sample(logits, [0.0] * 3, [1.0] * 3, [0] * 3, [None] * 3, [0] * 3)
    assert picked.tolist() == [11, 0, 30]


def test_a_min_tokens_ban_holds_under_every_sampler():
    """-inf logits (the ban) through greedy, temperature, top-p and top-k, natively and in
    torch: never drawn, never a NaN."""
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(5))
    logits[:, 4] = logits[:, 9] = 30.0                  # the stop ids are the likely picks
    apply_penalties(logits, [(i, [1, 2], 1, RowPenalties(Penalties(min_tokens=3,
                                                                   stop_ids=[4, 9])))
                             for i in range(8)])
    for native in (True, False):
        for seed in range(20):
            picked = sample(logits, [0.0, 0.5, 1.0, 1.0, 2.0, 1.0, 0.7, 1.0],
                            [1.0, 1.0, 1.0, 0.9, 0.5, 1.0, 0.95, 1.0],
                            [0, 0, 0, 0, 0, 5, 50, 1], [seed] * 8, [3] * 8, native=native)
            assert not set(picked.tolist()) & {4, 9}


# ---------------------------------------------------------------- the whole step, vs HF

BLOCK = 16
PROMPT = "Write a poem about the sea, the sea, the sea."


def _generate(runner: ModelRunner, prompts: dict[int, list[int]],
              penalties: dict[int, Penalties | None], steps: int) -> dict[int, list[int]]:
    """Greedy decode through ModelRunner.step, one batch with every sequence."""
    per = -(-(max(map(len, prompts.values())) + steps + 1) // BLOCK)
    news = [NewSeq(s, ids, len(ids), 0, list(range(i * per, (i + 1) * per)), 0.0, 1.0, 0, None,
                   penalties[s]) for i, (s, ids) in enumerate(prompts.items())]
    out: dict[int, list[int]] = {s: [] for s in prompts}
    plan = StepPlan(1, news, [SeqStep(s, len(ids), [], True) for s, ids in prompts.items()], [])
    for k in range(steps):
        res = runner.step(plan)
        for s, t in zip(res.seq_ids, res.token_ids):
            out[s].append(t)
        plan = StepPlan(k + 2, [], [SeqStep(s, 1, [], True) for s in prompts], [])
    return out


@pytest.fixture(scope="module")
def runner(model_path):
    from components.executor.loader import load_model
    model = build_model(*load_model(model_path), tuning_cache=cache_dir() / "tests")
    return ModelRunner(model, model.new_kv_cache(64, BLOCK))


def test_the_executor_applies_them_as_hf_and_the_definitions_say(runner, hf):
    """One batch: no penalties, HF's repetition penalty, and presence + frequency + bias.
    The first two against HF's own greedy generate (its RepetitionPenaltyLogitsProcessor);
    the third teacher-forced: each token Weir picked is the argmax of HF's logits for the
    sequence so far, adjusted by the reference above."""
    tok, m = hf
    ids = tok(PROMPT).input_ids
    n = 24
    pens = {1: None, 2: Penalties(0.0, 0.0, 1.3, []),
            3: Penalties(0.6, 0.4, 1.0, [(ids[-1], -100.0), (tok(" waves").input_ids[0], 4.0)])}
    got = _generate(runner, {s: ids for s in pens}, pens, n)
    for s, rep in ((1, 1.0), (2, 1.3)):
        with torch.no_grad():
            ref = m.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)).long(),
                             do_sample=False, max_new_tokens=n, repetition_penalty=rep,
                             eos_token_id=None)[0, len(ids):].tolist()
        assert got[s] == ref, (s, got[s], ref)
    assert got[1] != got[2]                               # the penalty changed the text
    seq = ids + got[3]
    with torch.no_grad():
        logits = m(torch.tensor([seq])).logits[0, len(ids) - 1:-1]
    for i, t in enumerate(got[3]):
        adjusted = reference(logits[i], seq[:len(ids) + i], len(ids), pens[3])
        best = int(adjusted.argmax())
        assert t == best or adjusted[best] - adjusted[t] < 1e-3, (i, t, best)
    assert got[3] != got[1]


def test_logprobs_are_the_models_own_distribution(runner, hf):
    """Each sampled token's log-probability and the top alternatives, against HF's
    log-softmax over the same sequence (teacher-forced), with and without penalties: they
    report the model's distribution, before penalties (vLLM's default). A sequence that did
    not ask gets None, and a step where none asked carries no list at all."""
    tok, m = hf
    ids = tok(PROMPT).input_ids
    per = -(-(len(ids) + 12) // BLOCK)
    news = [NewSeq(10 + i, ids, len(ids), 0, list(range(40 + i * per, 40 + (i + 1) * per)), 0.0,
                   1.0, 0, None, pen, lp)
            for i, (pen, lp) in enumerate([(None, 3), (Penalties(0.0, 0.0, 1.5, []), 0),
                                           (None, None)])]
    plan = StepPlan(100, news, [SeqStep(s.seq_id, len(ids), [], True) for s in news], [])
    got: dict[int, list] = {s.seq_id: [] for s in news}
    for k in range(8):
        res = runner.step(plan)
        assert len(res.logprobs) == 3 and res.logprobs[2] is None
        for sid, t, lp in zip(res.seq_ids, res.token_ids, res.logprobs):
            got[sid].append((t, lp))
        plan = StepPlan(101 + k, [], [SeqStep(s.seq_id, 1, [], True) for s in news], [])
    runner.step(StepPlan(200, [], [], [s.seq_id for s in news]))
    for sid, top in ((10, 3), (11, 0)):
        seq = ids + [t for t, _ in got[sid]]
        with torch.no_grad():
            ref = m(torch.tensor([seq])).logits[0, len(ids) - 1:-1].log_softmax(-1)
        for i, (t, lp) in enumerate(got[sid]):
            assert abs(lp.logprob - float(ref[i, t])) < 1e-3, (sid, i)
            assert len(lp.top_ids) == len(lp.top_logprobs) == top
            want = ref[i].topk(top)
            assert lp.top_logprobs == pytest.approx(want.values.tolist(), abs=1e-3)
            if top:
                assert lp.top_ids[0] == t == int(want.indices[0])     # greedy, unpenalized
    plain = runner.step(StepPlan(201, [NewSeq(30, ids, len(ids), 0, list(range(per)), 0.0, 1.0,
                                              0, None)], [SeqStep(30, len(ids), [], True)], []))
    assert plain.logprobs == []
    runner.step(StepPlan(202, [], [], [30]))


def test_prompt_logprobs_are_the_models_reading_of_the_prompt(runner, hf):
    """prompt_logprobs, with the prompt in three chunks (one a single token) beside a
    sequence in decode: each prompt token after the first gets its log-probability given
    the tokens before it and the top k there, against HF's log-softmax over the prompt; a
    sequence that did not ask gets no chunk; the first output is sampled as ever."""
    tok, m = hf
    ids = tok(PROMPT + " And the sky.").input_ids
    per = -(-(len(ids) + 4) // BLOCK)
    asked = NewSeq(50, ids, len(ids), 0, list(range(per)), 0.0, 1.0, 0, None, None, None, 2)
    other = NewSeq(51, ids, len(ids), 0, list(range(per, 2 * per)), 0.0, 1.0, 0, None)
    res = runner.step(StepPlan(300, [asked, other], [SeqStep(50, 7, [], False),
                                                     SeqStep(51, len(ids), [], True)], []))
    chunks = list(res.prompt_logprobs)
    res = runner.step(StepPlan(301, [], [SeqStep(50, 1, [], False), SeqStep(51, 1, [], True)], []))
    chunks += res.prompt_logprobs
    res = runner.step(StepPlan(302, [], [SeqStep(50, len(ids) - 8, [], True)], []))
    chunks += res.prompt_logprobs
    got = {sid: t for sid, t in zip(res.seq_ids, res.token_ids)}
    runner.step(StepPlan(303, [], [], [50, 51]))
    assert [(c.seq_id, c.start, len(c.logprobs)) for c in chunks] == [
        (50, 1, 7), (50, 8, 1), (50, 9, len(ids) - 9)]       # positions 1 .. len - 1
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits[0]
    ref = logits.log_softmax(-1)
    entries = [e for c in chunks for e in c.logprobs]
    for pos, e in enumerate(entries, start=1):
        assert abs(e.logprob - float(ref[pos - 1, ids[pos]])) < 1e-3, pos
        want = ref[pos - 1].topk(2)
        assert e.top_ids == want.indices.tolist()
        assert e.top_logprobs == pytest.approx(want.values.tolist(), abs=1e-3)
    assert got[50] == int(logits[-1].argmax())


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("asked", [[0, 2, 3], [0, 1, 2, 3]])     # all: the logits themselves
def test_logprobs_halves_agree_with_log_softmax(native, asked):
    """Both paths (the native kernel, and torch's, which GPUs and the torch plan take): the
    rows that asked, each with its own k, the others None; penalties applied between the
    halves change nothing reported."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(5)) * 3
    want = logits.log_softmax(-1)
    tops = {0: 2, 1: 1, 2: 0, 3: 5}
    lps = Logprobs(logits, asked, [tops[r] for r in asked], will_change=True, native=native)
    apply_penalties(logits, [(0, [1, 2], 1, RowPenalties(Penalties(0.0, 0.0, 1.0,
                                                                   [(7, 50.0)])))])
    tokens = [7, 9, 11, 13]
    got = lps.finish(tokens, 4)
    for row in range(4):
        if row not in asked:
            assert got[row] is None
            continue
        g = got[row]
        assert g.logprob == pytest.approx(float(want[row, tokens[row]]), abs=1e-5)
        top = want[row].topk(tops[row])
        assert g.top_ids == top.indices.tolist()
        assert g.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
