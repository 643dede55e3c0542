"""Speculative decoding in the executor (drafting.py, runner.py): prompt lookup's matches;
and, for every draft source, that a speculating sequence emits exactly the tokens it emits
without speculation (greedy, seeded draws, penalties, logprobs, structured output, n > 1
forks), that a draft is accepted up to the first token the target's own draw differs from
(and the KV written for the rest is overwritten), and that an unseeded verify emits its
first token from the target's distribution whatever the draft (a chi-square test on a
seeded process generator, so it cannot flake)."""
from __future__ import annotations

import dataclasses
import json
import math
import random

import numpy as np
import pytest
import torch

from components.executor import sampling
from components.executor.build import build_model
from components.executor.constraints import Ahead, Grammars
from components.executor.drafting import ModelDrafter, NgramDrafter
from components.executor.runner import ModelRunner, SeqState
from components.executor.synthetic import ModelShape, random_weights
from kernels import AttentionMetadata, cpu_linear, native_lib
from schemas.wire import NewSeq, Penalties, SeqStep, StepPlan, StructuredOutput

# test_runner's tiny shape; weights scaled x10 (N(0, 0.2)), so greedy decoding wanders
# over the vocabulary instead of repeating one token, and a draft model of other weights
# or fewer layers disagrees with the target often
SHAPE = ModelShape("tiny64", num_layers=2, hidden_size=128, intermediate_size=192, num_heads=2,
                   num_kv_heads=1, head_dim=64, vocab_size=128, max_position=256)
V = SHAPE.vocab_size
BLOCK = 16
PER_SEQ = 6                                 # blocks per sequence: 96 positions
PROMPT = [(7 * i + 3) % V for i in range(40)]
N = 40                                      # output tokens compared


def weights(seed: int, scale: float = 10.0) -> dict[str, torch.Tensor]:
    w = random_weights(SHAPE, seed=seed)
    return {k: v if "norm" in k else v * scale for k, v in w.items()}


def _build(shape, w, dtype):
    native = native_lib.available() and cpu_linear.small_batch_supported(dtype)
    return build_model(shape, w, dtype=dtype, kernels={"linear": "native"} if native else None)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request):
    return _build(SHAPE, weights(7), request.param)


def blocks_of(sid: int) -> list[int]:
    """Interleaved, non-contiguous tables: sequence ``sid`` (1..4) holds every fourth."""
    return [(sid - 1) + 4 * j for j in range(PER_SEQ)][::-1]


def new_seq(sid: int, prompt=PROMPT, temperature: float = 0.0, top_p: float = 1.0,
            top_k: int = 0, seed: int | None = None, **kw) -> NewSeq:
    return NewSeq(sid, list(prompt), len(prompt), 0, blocks_of(sid), temperature, top_p, top_k,
                  seed, **kw)


@dataclasses.dataclass
class Run:
    tokens: dict[int, list[int]]
    logprobs: dict[int, list]
    drafts: dict[int, list[tuple[int, int]]]     # (drafted, accepted) per verify
    steps: int
    runner: ModelRunner


def run(model, seqs: list[NewSeq], n: int = N, drafter=None, k=0, grammars=None,
        eos: int | None = None, max_steps: int = 200) -> Run:
    """Prefill ``seqs`` in one step, then decode each (one row a step, ``k(step, sid)``
    drafts, or ``k`` for all) until it has ``n`` tokens (or has emitted ``eos``). Checks
    every step's bookkeeping: each row's tokens together and in plan order, 1 + accepted
    of them, ``num_computed`` at all but the last token, the tokens appended to the state."""
    runner = ModelRunner(model, model.new_kv_cache(4 * PER_SEQ, BLOCK), drafter=drafter,
                         grammars=grammars)
    if isinstance(drafter, Oracle):
        drafter.runner = runner
    kf = k if callable(k) else (lambda step, sid: k)
    out = Run({s.seq_id: [] for s in seqs}, {s.seq_id: [] for s in seqs},
              {s.seq_id: [] for s in seqs}, 0, runner)
    plan = StepPlan(1, list(seqs), [SeqStep(s.seq_id, len(s.token_ids), [], True) for s in seqs],
                    [])
    for step in range(1, max_steps + 1):
        before = {st.seq_id: runner.seqs[st.seq_id].num_computed if st.seq_id in runner.seqs
                  else 0 for st in plan.steps}
        res = runner.step(plan)
        out.steps += 1
        assert not res.failed and not res.structured_errors
        spec = {sid: (d, a) for sid, d, a in res.drafts}
        assert len(spec) == len(res.drafts)
        at = 0
        for st in plan.steps:
            sid = st.seq_id
            d, a = spec.get(sid, (0, 0))
            assert 0 <= a <= d <= st.draft_k and (d > 0 or sid not in spec)
            got = res.token_ids[at:at + 1 + a]
            assert res.seq_ids[at:at + 1 + a] == [sid] * (1 + a)
            if res.logprobs:
                out.logprobs[sid] += res.logprobs[at:at + 1 + a]
            at += 1 + a
            if sid in spec:
                out.drafts[sid].append((d, a))
            s = runner.seqs[sid]
            assert s.num_computed == before[sid] + st.num_tokens + a == len(s.token_ids) - 1
            out.tokens[sid] += got
            assert s.token_ids[s.prompt_len:] == out.tokens[sid]
        assert at == len(res.token_ids) == len(res.seq_ids)
        live = [sid for sid, t in out.tokens.items()
                if len(t) < n and (eos is None or eos not in t)]
        if not live:
            break
        plan = StepPlan(step + 1, [], [SeqStep(sid, 1, [], True, 1, kf(step + 1, sid))
                                       for sid in live], [])
    else:
        raise AssertionError("did not finish")
    return out


class Oracle:
    """A draft source that knows the future: each sequence's tokens from a run without
    speculation (``future[sid]``), proposed from its output index, the one at draft
    position ``wrong(call)`` (if within the proposal) replaced by a token that is not it."""

    name = "oracle"

    def __init__(self, future: dict[int, list[int]], wrong=lambda call: None,
                 replace=lambda s, ahead, t: (t + 1) % V) -> None:
        self.future, self.wrong, self.replace = future, wrong, replace
        self.runner: ModelRunner | None = None         # whose sequences it drafts for
        self.calls: list[tuple[int, int, int, int | None]] = []   # (sid, index, k, wrong)

    def propose(self, rows: list[tuple[SeqState, int]]) -> list[list[int]]:
        out = []
        for s, k in rows:
            sid = next(i for i, st in self.runner.seqs.items() if st is s)
            o = len(s.token_ids) - s.prompt_len
            assert s.token_ids[s.prompt_len:] == self.future[sid][:o] or o > len(
                self.future[sid])
            d = list(self.future[sid][o:o + k])
            j = self.wrong(len(self.calls))
            if j is not None and j < len(d):
                d[j] = self.replace(s, d[:j], d[j])
                assert d[j] != self.future[sid][o + j]
            self.calls.append((sid, o, k, j))
            out.append(d)
        return out


# ------------------------------------------------------------------ prompt lookup


def index_of(ids: list[int]) -> dict[int, list[int]]:
    index: dict[int, list[int]] = {}
    for p, t in enumerate(ids):
        index.setdefault(t, []).append(p)
    return index


def lookup(ids, k, **kw) -> list[int]:
    return NgramDrafter(**kw).lookup(ids, index_of(ids), k)


def test_lookup_prefers_the_longest_match_then_the_most_recent():
    # "3" after "1 2" (3 tokens matched, older) and after "5 2" (2, more recent)
    ids = [1, 2, 3, 10, 11, 5, 2, 3, 20, 21, 1, 2, 3]
    assert lookup(ids, 2) == [10, 11]
    # capped at max_n: the most recent match of max_n tokens ends the search
    assert lookup(ids, 2, max_n=2) == [20, 21]
    # equally long: the most recent
    assert lookup([2, 3, 10, 2, 3, 20, 30, 2, 3], 2) == [20, 30]
    assert lookup([9, 2, 3, 10, 8, 2, 3, 20, 30, 7, 2, 3], 1) == [20]


def test_lookup_needs_min_n_tokens_and_a_match():
    ids = [5, 3, 10, 11, 7, 3]                  # "3" recurs, but after "5" then "7"
    assert lookup(ids, 3) == []                 # min_n 2: no match
    assert lookup(ids, 3, min_n=1) == [10, 11, 7]
    assert lookup([1, 2, 3, 4, 5], 3, min_n=1) == []       # the last token is new
    assert lookup([4, 4], 3, min_n=2) == []     # too short for a match of 2 before it
    assert lookup([1, 2, 1, 2], 0) == [] and lookup([1, 2, 1, 2], -1) == []
    assert lookup([], 3) == []


def test_lookup_continues_with_the_period_and_stops_at_k():
    assert lookup([1, 2, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert lookup([7, 7, 7, 7], 6) == [7] * 6
    # the match (position 1) runs into the end after 10 11 7 3: then the period, 4
    assert lookup([5, 3, 10, 11, 7, 3], 6, min_n=1) == [10, 11, 7, 3, 10, 11]
    assert lookup([4, 5, 6, 9, 4, 5, 6], 2) == [9, 4]
    assert lookup([4, 5, 6, 9, 4, 5, 6], 3) == [9, 4, 5]
    assert lookup([4, 5, 6, 9, 4, 5, 6], 1) == [9]
    # the period is the distance between the match and the end: 9 4 5 6 | 9 4 5 6 | 9 ...
    assert lookup([4, 5, 6, 9, 4, 5, 6], 10) == [9, 4, 5, 6, 9, 4, 5, 6, 9, 4]


def test_lookup_reads_at_most_scan_occurrences():
    # the only match of 2+ tokens is the third most recent "3"
    ids = [1, 2, 3, 10, 8, 3, 20, 9, 3, 30, 1, 2, 3]
    assert lookup(ids, 2, scan=2) == []
    assert lookup(ids, 2, scan=3) == [10, 8]
    assert lookup(ids, 2, scan=2, min_n=1) == [30, 1]


def test_the_sequence_index_grows_with_the_sequence():
    s = SeqState([1, 2, 3, 4], 4, 0, [], 0.0, 1.0, 0, None)
    drafter = NgramDrafter()
    assert drafter.propose([(s, 3)]) == [[]]
    for t in (1, 2):
        s.token_ids.append(t)
        assert s.ngram_index() == index_of(s.token_ids)
    assert drafter.propose([(s, 3)]) == [[3, 4, 1]]
    s.token_ids += [3, 9]
    assert drafter.propose([(s, 3), (s, 0)]) == [[], []]
    assert s.ngram_index() == index_of(s.token_ids)


# ------------------------------------------------------------------ greedy


def exact_draws(model) -> None:
    """Seeded draws are compared token for token in fp32 only: bf16 logits depend on the
    step's shape (a verify row's differ from a plain decode row's by ~0.03), and an
    exponential race that close flips, as it does between batch sizes without
    speculation. Greedy tokens (gaps of whole logits here) are compared in both."""
    if model.dtype != torch.float32:
        pytest.skip("seeded draws token for token: fp32 (bf16 logits vary with step shape)")


@pytest.fixture(scope="module")
def plain(model):
    """Greedy decoding without speculation, one sequence."""
    return run(model, [new_seq(1)]).tokens[1]


def test_greedy_without_speculation_is_not_degenerate(plain):
    assert len(plain) == N and len(set(plain)) >= N // 2


def test_a_draft_model_that_is_the_target_has_every_draft_accepted(model, plain):
    drafter = ModelDrafter(model, model.new_kv_cache(4 * PER_SEQ, BLOCK))
    got = run(model, [new_seq(1)], drafter=drafter, k=4)
    assert got.tokens[1][:N] == plain
    assert got.drafts[1] and all(d == a == 4 for d, a in got.drafts[1])
    assert got.steps <= 1 + math.ceil((N - 1) / 5)
    assert got.runner.drafted == got.runner.accepted == 4 * len(got.drafts[1])


@pytest.mark.parametrize("draft", ["other_weights", "first_layer"])
def test_greedy_output_is_the_target_s_whatever_the_draft_model(model, plain, draft):
    if draft == "other_weights":
        dm = _build(SHAPE, weights(8), model.dtype)
    else:
        dm = _build(dataclasses.replace(SHAPE, num_layers=1), weights(7), model.dtype)
        assert dm.spec.num_layers == 1
    drafter = ModelDrafter(dm, dm.new_kv_cache(4 * PER_SEQ, BLOCK))
    got = run(model, [new_seq(1)], drafter=drafter, k=lambda step, sid: 1 + step % 4)
    assert got.tokens[1][:N] == plain
    assert len(got.drafts[1]) == got.steps - 1          # every decode step verified drafts
    assert sum(a for _, a in got.drafts[1]) < sum(d for d, _ in got.drafts[1])


def test_a_draft_is_accepted_up_to_its_first_wrong_token(model, plain):
    """The oracle drafts the true continuation with its token at position j (cycling
    through 0..k, k = no wrong one) replaced: exactly j are accepted, the target's own
    token follows them, and the KV written for the rejected drafts is overwritten (every
    later token is still the one decoding without speculation gives)."""
    ks = [4, 3, 1, 2, 4, 4, 3]
    oracle = Oracle({1: plain}, wrong=lambda call: call % 5)
    got = run(model, [new_seq(1)], drafter=oracle, k=lambda step, sid: ks[step % len(ks)])
    assert got.tokens[1][:N] == plain
    assert len(got.drafts[1]) == len(oracle.calls)
    for (d, a), (_, o, k, j) in zip(got.drafts[1], oracle.calls):
        assert d == min(k, N - o)
        assert a == (d if j is None or j >= d else j)
    assert {a for _, a in got.drafts[1]} >= {0, 1, 2, 3}


def test_an_empty_proposal_is_a_plain_decode(model, plain):
    oracle = Oracle({1: plain}, wrong=lambda call: None)
    oracle.future = {1: plain[:10]}                 # nothing to propose past token 10
    got = run(model, [new_seq(1)], drafter=oracle, k=3)
    assert got.tokens[1][:N] == plain
    assert len(got.drafts[1]) < len(oracle.calls)


def test_prompt_lookup_in_the_runner(model):
    prompt = [11, 12, 13, 14, 15, 16, 17, 18] * 5
    want = run(model, [new_seq(1, prompt)]).tokens[1]
    got = run(model, [new_seq(1, prompt)], drafter=NgramDrafter(), k=4)
    assert got.tokens[1][:N] == want
    assert got.drafts[1]                            # the prompt repeats: it proposed


# ------------------------------------------------------------------ seeded sampling

SAMPLED = dict(temperature=0.8, top_k=20, top_p=0.9)


def test_seeded_draws_are_the_same_with_and_without_speculation(model):
    exact_draws(model)
    want = run(model, [new_seq(1, seed=11, **SAMPLED)]).tokens[1]
    other = run(model, [new_seq(1, seed=12, **SAMPLED)]).tokens[1]
    assert other != want
    assert len(set(want)) > N // 4
    drafter = ModelDrafter(model, model.new_kv_cache(4 * PER_SEQ, BLOCK))
    got = run(model, [new_seq(1, seed=11, **SAMPLED)], drafter=drafter, k=3)
    assert got.tokens[1][:N] == want
    accepted = [a for _, a in got.drafts[1]]
    assert 0 < sum(accepted) < 3 * len(accepted)     # the greedy drafts: some, not all
    got = run(model, [new_seq(1, seed=11, **SAMPLED)], drafter=NgramDrafter(min_n=1), k=3)
    assert got.tokens[1][:N] == want
    # the known future, drafted whole: the seeded draw at each output index takes it
    got = run(model, [new_seq(1, seed=11, **SAMPLED)], drafter=Oracle({1: want}), k=4)
    assert got.tokens[1][:N] == want
    assert all(d == a for d, a in got.drafts[1]) and got.steps <= 1 + math.ceil((N - 1) / 5)
    got = run(model, [new_seq(1, seed=12, **SAMPLED)], drafter=Oracle({1: other},
                                                                      lambda c: c % 3), k=3)
    assert got.tokens[1][:N] == other


def test_a_draft_model_s_kv_after_rejections_gives_the_fresh_greedy_continuation(model):
    """Under seeded sampling the greedy drafts are often rejected, so the draft's KV holds
    positions past what the target verified; each proposal must still be the greedy
    continuation of the sequence as it stands (a fresh draft model's)."""
    exact_draws(model)
    drafter = ModelDrafter(model, model.new_kv_cache(4 * PER_SEQ, BLOCK))
    checked = []     # the sequence's length at each proposal

    class Checked:
        name = "checked"

        def propose(self, rows):
            out = drafter.propose(rows)
            for (s, k), d in zip(rows, out):
                fresh = run(model, [new_seq(1, s.token_ids)], n=k).tokens[1][:k]
                assert d == fresh
                checked.append(len(s.token_ids))
            return out

    got = run(model, [new_seq(1, seed=5, **SAMPLED)], drafter=Checked(), k=3, n=30)
    assert len(checked) >= 8
    assert any(a < d for d, a in got.drafts[1])


def test_rows_of_a_batch_verify_independently(model):
    """Greedy, seeded and penalized rows in one batch, each with its own k every step
    (0 for some), against each decoded alone without speculation."""
    exact_draws(model)
    seqs = [new_seq(1), new_seq(2, seed=3, **SAMPLED),
            new_seq(3, PROMPT[::-1], penalties=Penalties(0.3, 0.2, 1.2), logprobs=2),
            new_seq(4, PROMPT[5:30], temperature=1.0, seed=9)]
    want = {s.seq_id: run(model, [s]).tokens[s.seq_id] for s in seqs}
    oracle = Oracle(want, wrong=lambda call: (call * 7) % 6)
    got = run(model, seqs, drafter=oracle, k=lambda step, sid: (step + sid) % 5)
    for sid in want:
        assert got.tokens[sid][:N] == want[sid], sid
        assert got.drafts[sid]


# ------------------------------------------------------------------ the distribution


def test_an_unseeded_verify_draws_its_first_token_from_the_target(model):
    """1000 sequences of one prompt, unseeded, T 1, top-k 5, each drafting a fixed token
    ``x`` (the most likely, the second, or one outside the top 5): the first token each
    emits follows the target's top-5 distribution p (chi-square at p=0.001, 4 degrees of
    freedom), ``x`` is accepted exactly where it is that token, at a rate within a binomial
    bound of p(x)."""
    L, n = 8, 1000
    prompt = PROMPT[:L]
    meta = AttentionMetadata.build([L], [0], [[0]], BLOCK)
    logits = model.forward(torch.tensor(prompt), meta.positions, model.new_kv_cache(1, BLOCK),
                           meta, torch.tensor([L - 1]))[0].float()
    top = logits.topk(5)
    order = top.indices.tolist()
    p = dict(zip(order, top.values.softmax(-1).tolist()))
    assert min(p.values()) > 0.02            # every cell's expected count is >= 20
    outside = next(t for t in range(V) if t not in p)

    class Fixed:
        name = "fixed"

        def __init__(self, x):
            self.x = x

        def propose(self, rows):
            return [[self.x] for _ in rows]

    critical = 18.467                        # chi-square, 4 degrees of freedom, p = 0.001
    for x in (order[0], order[1], outside):
        sampling.seed_process_generator(1234 + x)
        runner = ModelRunner(model, model.new_kv_cache(n, BLOCK), drafter=Fixed(x))
        seqs = [NewSeq(i, list(prompt), L, 0, [i], 1.0, 1.0, 5, None) for i in range(n)]
        first = runner.step(StepPlan(1, seqs, [SeqStep(i, L - 1, [], False) for i in range(n)],
                                     []))
        assert first.token_ids == []
        res = runner.step(StepPlan(2, [], [SeqStep(i, 1, [], True, 1, 1) for i in range(n)], []))
        assert [sid for sid, d, _ in res.drafts] == list(range(n))
        accepted = {sid: a for sid, d, a in res.drafts}
        firsts, at = [], 0
        for i in range(n):
            assert res.seq_ids[at] == i
            firsts.append(res.token_ids[at])
            assert accepted[i] == int(res.token_ids[at] == x)
            at += 1 + accepted[i]
        counts = {t: firsts.count(t) for t in p}
        assert sum(counts.values()) == n, "a token outside the top 5"
        chi2 = sum((counts[t] - n * p[t]) ** 2 / (n * p[t]) for t in p)
        assert chi2 < critical, (x, counts, p)
        px = p.get(x, 0.0)
        hits = sum(accepted.values())
        assert abs(hits - n * px) <= 3.3 * math.sqrt(n * px * (1 - px)) + 1e-9, (x, hits, px)
        if x == outside:
            assert hits == 0


# ------------------------------------------------------------------ penalties, logprobs


def test_penalties_bias_and_min_tokens_with_speculation(model, plain):
    """Penalties, a logit bias and min_tokens see the drafts ahead: with any drafter the
    greedy output is the one without speculation. Token for token in fp32; in bf16 a
    verify row's logits differ from a decode row's (~0.03) and the penalties leave near
    ties that flip (the prompt kernel's rounding moved one here), so there the sequence is
    deterministic (batch-invariant kernels: a row's logits are the same in a verify step
    as in a decode step), and the fast kernels are held to the penalties' own bans."""
    pen = Penalties(presence=0.4, frequency=0.7, repetition=1.5,
                    bias=[(plain[3], 4.0), (plain[5], -100.0)], min_tokens=8,
                    stop_ids=[plain[0], plain[1]])

    def banned(tokens: list[int]) -> bool:
        return plain[0] in tokens[:8] or plain[1] in tokens[:8] or plain[5] in tokens

    exact = model.dtype == torch.float32
    seq = new_seq(1, penalties=pen, deterministic=not exact)
    want = run(model, [seq]).tokens[1]
    assert want != plain and not banned(want)
    drafters = [ModelDrafter(model, model.new_kv_cache(4 * PER_SEQ, BLOCK)),
                Oracle({1: want}, wrong=lambda call: call % 4), Oracle({1: want}),
                NgramDrafter(min_n=1)]
    for drafter in drafters:
        got = run(model, [seq], drafter=drafter, k=lambda step, sid: 2 + step % 3)
        assert got.tokens[1][:N] == want, drafter
    if not exact:                # the oracles' future is the deterministic run's: not these
        for drafter in (ModelDrafter(model, model.new_kv_cache(4 * PER_SEQ, BLOCK)),
                        NgramDrafter(min_n=1), None):
            fast = run(model, [new_seq(1, penalties=pen)], drafter=drafter,
                       k=lambda step, sid: 2 + step % 3)
            # its last step may accept drafts past N (run() stops once a row has N)
            assert len(fast.tokens[1]) >= N and not banned(fast.tokens[1]), drafter
    # the exact future, drafted whole, is accepted whole: penalties see the drafts ahead
    got = run(model, [seq], drafter=Oracle({1: want}), k=4)
    assert all(d == a for d, a in got.drafts[1]) and got.steps <= 1 + math.ceil((N - 1) / 5)


def test_penalties_see_the_drafts_ahead_of_each_row(model):
    """A frequency penalty on a one-token loop: without counting the drafts before a row,
    the loop's token would win again where decoding without speculation leaves it."""
    pen = Penalties(frequency=2.0, repetition=1.0, min_tokens=3, stop_ids=[7])
    seq = new_seq(1, penalties=pen)
    want = run(model, [seq]).tokens[1]
    got = run(model, [seq], drafter=Oracle({1: want}, wrong=lambda c: c % 5), k=4)
    assert got.tokens[1][:N] == want
    drafter = type("Repeat", (), {"name": "repeat",
                                  "propose": lambda self, rows: [[s.token_ids[-1]] * k
                                                                 for s, k in rows]})()
    got = run(model, [seq], drafter=drafter, k=4)
    assert got.tokens[1][:N] == want


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_logprobs_are_those_of_decoding_without_speculation(model, sampled):
    if sampled:
        exact_draws(model)
    params = dict(SAMPLED, seed=4) if sampled else {}
    seq = new_seq(1, logprobs=3, **params)
    want = run(model, [seq])
    tol = 1e-4 if model.dtype == torch.float32 else 3e-2
    for drafter in (Oracle({1: want.tokens[1]}, wrong=lambda call: call % 4),
                    ModelDrafter(model, model.new_kv_cache(4 * PER_SEQ, BLOCK))):
        got = run(model, [seq], drafter=drafter, k=3)
        assert got.tokens[1][:N] == want.tokens[1]
        assert sum(a for _, a in got.drafts[1]) > 0
        assert len(got.logprobs[1]) == len(got.tokens[1])
        for i, (g, w) in enumerate(zip(got.logprobs[1][:N], want.logprobs[1])):
            assert g is not None and len(g.top_ids) == 3
            assert math.isclose(g.logprob, w.logprob, abs_tol=tol), i
            assert np.allclose(g.top_logprobs, w.top_logprobs, atol=tol), i
            if model.dtype == torch.float32:
                assert g.top_ids == w.top_ids, i
            assert g.logprob <= g.top_logprobs[0] + tol


# ------------------------------------------------------------------ n > 1


def test_a_fork_sample_is_never_drafted_for_and_its_choices_speculate(model):
    """The sampling row of an n = 2 request asks for 2 samples and a draft k: nothing is
    proposed for it. Its two choices, forked as the scheduler forks (the child shares the
    prompt's full blocks, a copy of the partial one, the seed + 1), both speculate and
    decode what they decode without speculation."""
    exact_draws(model)
    L = 40                                         # 2 full blocks + 8 tokens

    def fork_run(drafter, k):
        calls = []

        class Spy:
            name = "spy"

            def propose(self, rows):
                calls.append([(len(s.token_ids), kk) for s, kk in rows])
                return drafter.propose(rows) if drafter is not None else [[] for _ in rows]

        runner = ModelRunner(model, model.new_kv_cache(4 * PER_SEQ, BLOCK), drafter=Spy())
        if isinstance(drafter, Oracle):
            drafter.runner = runner
        parent = NewSeq(1, list(PROMPT), L, 0, [0, 1, 2, 3, 4, 5], 0.8, 0.9, 20, 21)
        runner.step(StepPlan(1, [parent], [SeqStep(1, L - 1, [], False)], []))
        res = runner.step(StepPlan(2, [], [SeqStep(1, 1, [], True, 2, k)], []))
        assert res.seq_ids == [1, 1] and res.drafts == [] and calls == []
        t0, t1 = res.token_ids
        assert runner.seqs[1].token_ids == PROMPT + [t0]
        from schemas.wire import BlockCopy
        child = NewSeq(2, PROMPT + [t1], L, L, [0, 1, 6, 7, 8, 9], 0.8, 0.9, 20, 22)
        out = {1: [t0], 2: [t1]}
        drafts = {1: [], 2: []}
        step = 3
        plan = StepPlan(step, [child], [SeqStep(1, 1, [], True, 1, k),
                                        SeqStep(2, 1, [], True, 1, k)], [], [BlockCopy(2, 6)])
        while min(map(len, out.values())) < 30:
            res = runner.step(plan)
            for sid, tok in zip(res.seq_ids, res.token_ids):
                out[sid].append(tok)
            for sid, d, a in res.drafts:
                drafts[sid].append((d, a))
            step += 1
            plan = StepPlan(step, [], [SeqStep(sid, 1, [], True, 1, k) for sid in (1, 2)], [])
        return {sid: t[:30] for sid, t in out.items()}, drafts, calls

    want, _, _ = fork_run(None, 0)
    assert want[1] != want[2]
    # the choices' futures: the oracle drafts them (with wrong tokens), then a draft model
    for drafter in (Oracle(want, wrong=lambda call: call % 4),
                    ModelDrafter(model, model.new_kv_cache(4 * PER_SEQ, BLOCK))):
        got, drafts, calls = fork_run(drafter, 3)
        assert got == want
        assert drafts[1] and drafts[2]
        assert all(len(c) == 2 for c in calls)      # both choices, every step after the fork


# ------------------------------------------------------------------ structured output
# (test_constraints' setup: a random model with SmolLM2's vocabulary and tokenizer)

S_VOCAB = 49152
S_SHAPE = ModelShape("tiny-smollm-vocab", num_layers=2, hidden_size=64, intermediate_size=128,
                     num_heads=1, num_kv_heads=1, head_dim=64, vocab_size=S_VOCAB,
                     max_position=512)
EOS = 2
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "ok", "n"],
          "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
FORMS = [StructuredOutput(json=json.dumps(SCHEMA)),
         StructuredOutput(regex=r"[0-9]{3}-(yes|no)-[0-9]{2,4}")]


@pytest.fixture(scope="module")
def s_vocab(model_path):
    pytest.importorskip("llguidance")           # these tests only, not the whole file
    from components.model.structured import ll_tokenizer
    from components.model.vocab import load_tokenizer
    bundle = load_tokenizer(model_path)
    return bundle, ll_tokenizer(bundle, S_VOCAB)


@pytest.fixture(scope="module")
def s_model():
    return build_model(S_SHAPE, random_weights(S_SHAPE, seed=3), dtype=torch.float32)


def allowed(s: SeqState, ahead: list[int]) -> set[int]:
    row = np.zeros((S_VOCAB + 31) // 32, dtype=np.int32)
    Ahead(s.constraint, ahead).fill(row)
    return set(np.unpackbits(row.view(np.uint8), bitorder="little").nonzero()[0].tolist())


def forbidden(s: SeqState, ahead: list[int], t: int) -> int:
    if s.constraint is None:
        return (t + 1) % S_VOCAB
    ok = allowed(s, ahead)
    return next(c for c in (EOS, 0, 1000, 30000, 12345) if c not in ok and c != t)


def other_allowed(s: SeqState, ahead: list[int], t: int) -> int:
    if s.constraint is None:
        return (t + 1) % S_VOCAB
    ok = sorted(allowed(s, ahead) - {t})
    return ok[0] if ok else forbidden(s, ahead, t)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_structured_output_with_speculation(s_model, s_vocab, temperature):
    """Two constrained rows (JSON, regex) and a free one: with drafts the language
    forbids cut before verification (an oracle's wrong token that the grammar forbids:
    only the tokens before it are verified), wrong drafts it allows rejected, drafts
    past the grammar's masks (a random draft model's, prompt lookup's) likewise, the
    output is token for token what it is without speculation."""
    bundle, vocab = s_vocab
    rng = random.Random(5)
    prompt = [rng.randrange(100, S_VOCAB) for _ in range(21)]

    def seqs():
        return [NewSeq(i + 1, list(prompt), len(prompt), 0, blocks_of(i + 1), temperature,
                       1.0, 0, 7 + i, structured=so) for i, so in enumerate(FORMS)] + [
            NewSeq(3, list(prompt), len(prompt), 0, blocks_of(3), temperature, 1.0, 0, 9)]

    def go(drafter, k=0):
        return run(s_model, seqs(), n=40, drafter=drafter, k=k,
                   grammars=Grammars(lambda: vocab), eos=EOS)

    want = go(None)
    for sid in (1, 2):
        toks = want.tokens[sid]
        assert toks[-1] == EOS
        text = bundle.decode(toks[:-1])
        if sid == 1:
            assert set(json.loads(text)) == {"kind", "ok", "n"}
    cut = lambda out, sid: out.tokens[sid][:out.tokens[sid].index(EOS) + 1] \
        if EOS in out.tokens[sid] else out.tokens[sid][:40]
    future = {sid: cut(want, sid) for sid in want.tokens}

    # llguidance's validate_tokens refuses EOS from a matcher already stopped (the
    # language complete: the mask allows EOS alone), though not from one it stops within
    # the proposal: a proposal that is that final EOS alone is cut, never verified
    grammars = Grammars(lambda: vocab)
    stopped = {sid: grammars.constraint(FORMS[sid - 1], future[sid][:-1]).matcher.is_stopped()
               for sid in (1, 2)}

    # wrong tokens the language forbids: cut before verification, so drafted == j
    oracle = Oracle(future, wrong=lambda call: call % 3, replace=forbidden)
    got = go(oracle, 3)
    seen_cut = 0
    for sid in (1, 2):
        assert cut(got, sid) == future[sid], sid
        calls = [c for c in oracle.calls if c[0] == sid]
        d_iter = iter(got.drafts[sid])
        for _, o, k, j in calls:
            d = min(k, len(future[sid]) - o)
            if j is not None and j < d:
                d = j                           # cut at the forbidden token
                seen_cut += 1
            elif o == len(future[sid]) - 1 and stopped[sid]:
                d = 0                           # the final EOS alone, the language stopped
            if d:
                assert next(d_iter) == (d, d)   # the rest: the true future, all accepted
        assert next(d_iter, None) is None
    assert seen_cut >= 4

    # wrong tokens the language allows (where another is): verified and rejected
    oracle = Oracle(future, wrong=lambda call: call % 3, replace=other_allowed)
    got = go(oracle, 3)
    for sid in (1, 2):
        assert cut(got, sid) == future[sid], sid
    assert any(a < d for sid in (1, 2) for d, a in got.drafts[sid])

    for drafter in (ModelDrafter(s_model, s_model.new_kv_cache(4 * PER_SEQ, BLOCK)),
                    NgramDrafter(min_n=1)):
        got = go(drafter, 4)
        for sid in (1, 2, 3):
            assert cut(got, sid) == future[sid], (drafter, sid)


def test_a_draft_the_grammar_forbids_is_never_verified(s_model, s_vocab):
    """A constrained row whose whole proposal the language forbids verifies nothing (no
    drafts entry, one token); one whose proposal turns forbidden at j verifies j."""
    _, vocab = s_vocab
    prompt = [500 + i for i in range(20)]
    so = FORMS[1]
    want = run(s_model, [NewSeq(1, prompt, 20, 0, blocks_of(1), 0.0, 1.0, 0, None,
                                structured=so)], n=6,
               grammars=Grammars(lambda: vocab)).tokens[1]
    for j in (0, 1, 2):
        oracle = Oracle({1: want}, wrong=lambda call, j=j: j, replace=forbidden)
        got = run(s_model, [NewSeq(1, prompt, 20, 0, blocks_of(1), 0.0, 1.0, 0, None,
                                   structured=so)], n=6, drafter=oracle, k=3,
                  grammars=Grammars(lambda: vocab))
        assert got.tokens[1][:6] == want
        first = got.drafts[1][0] if got.drafts[1] else None
        assert oracle.calls[0][3] == j
        assert first == (None if j == 0 else (j, j))


def test_a_continuation_with_its_output_offset_draws_the_same_seeded_stream(model):
    """A migrated stream (components/router/migration.py): prompt + the first k output
    tokens as its prompt, ``output_offset`` k: its draws are output k.. of the original,
    seeded or greedy, with speculation or without."""
    exact_draws(model)
    for kw in (dict(seed=11, **SAMPLED), {}):
        want = run(model, [new_seq(1, **kw)]).tokens[1][:N]
        for k, drafter in ((1, None), (17, None), (17, NgramDrafter(min_n=1))):
            got = run(model, [new_seq(1, PROMPT + want[:k], output_offset=k, **kw)],
                      n=N - k, drafter=drafter, k=3 if drafter else 0).tokens[1]
            assert got[:N - k] == want[k:], (kw, k)
    cold = run(model, [new_seq(1, PROMPT + want[:17], seed=11, **SAMPLED)], n=N - 17)
    want = run(model, [new_seq(1, seed=11, **SAMPLED)]).tokens[1][:N]
    assert cold.tokens[1][:N - 17] != want[17:]          # without the offset: another stream


def test_a_continuation_s_penalties_count_its_carried_output(model):
    """The last ``output_offset`` prompt tokens are output: presence and frequency count
    them, ``min_tokens`` (sent less them) bans the stop ids for the new tokens alone, so
    the continuation's output is the original's from k on, greedy or seeded, with
    speculation or without; counted as prompt instead, the output is another. In fp32
    (``exact_draws``): in bf16 the continuation's prefill of the carried tokens gives
    logits a decode step's differ from by ~0.03, and the penalties leave near ties that
    flip (greedy too, on this CPU since prompt chunks' attention runs on AMX tiles)."""
    exact_draws(model)

    def pen(min_tokens: int) -> Penalties:
        return Penalties(presence=0.6, frequency=0.9, repetition=1.3, min_tokens=min_tokens,
                         stop_ids=[5, 9])
    for kw in ({}, dict(seed=11, **SAMPLED)):
        want = run(model, [new_seq(1, penalties=pen(20), **kw)]).tokens[1][:N]
        for k, drafter in ((3, None), (17, None), (25, NgramDrafter(min_n=1))):
            got = run(model, [new_seq(1, PROMPT + want[:k], output_offset=k,
                                      penalties=pen(max(20 - k, 0)), **kw)],
                      n=N - k, drafter=drafter, k=3 if drafter else 0).tokens[1]
            assert got[:N - k] == want[k:], (kw, k)
        as_prompt = run(model, [new_seq(1, PROMPT + want[:17], output_offset=0,
                                        penalties=pen(3), **kw)], n=N - 17).tokens[1]
        assert as_prompt[:N - 17] != want[17:], kw


def test_a_continuation_s_grammar_is_advanced_over_its_carried_output(s_model, s_vocab):
    """The last ``output_offset`` prompt tokens are output the language already read: the
    continuation goes on in the language from there, token for token the original's
    (greedy and seeded, JSON and regex); carried output the language rejects fails the
    sequence's first step (a structured error), where as prompt it would not."""
    bundle, vocab = s_vocab
    rng = random.Random(8)
    prompt = [rng.randrange(100, S_VOCAB) for _ in range(20)]

    def seq(toks, k, so, temperature):
        return NewSeq(1, prompt + toks, len(prompt) + len(toks), 0, blocks_of(1),
                      temperature, 1.0, 0, 5, structured=so, output_offset=k)

    for so in FORMS:
        for temperature in (0.0, 1.0):
            want = run(s_model, [seq([], 0, so, temperature)], n=40,
                       grammars=Grammars(lambda: vocab), eos=EOS).tokens[1]
            assert want[-1] == EOS and len(want) > 4, (so, temperature)
            for k in (1, len(want) // 2, len(want) - 1):
                got = run(s_model, [seq(want[:k], k, so, temperature)], n=40,
                          grammars=Grammars(lambda: vocab), eos=EOS).tokens[1]
                assert got == want[k:], (so, temperature, k)
    bad = bundle.encode("abc")
    for k, errors in ((len(bad), [1]), (0, [])):
        runner = ModelRunner(s_model, s_model.new_kv_cache(4 * PER_SEQ, BLOCK),
                             grammars=Grammars(lambda: vocab))
        s = seq(bad, k, FORMS[1], 0.0)
        res = runner.step(StepPlan(1, [s], [SeqStep(1, len(s.token_ids), [], True)], []))
        assert [sid for sid, _ in res.structured_errors] == errors, k
