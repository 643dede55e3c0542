"""Deterministic steps (issue 50) at the runner: a deterministic request's tokens and
logprobs are bitwise the same alone, beside 8, 64 and 256 random neighbours (arriving at
random steps), with its prompt chunked at random, computed one token at a time, after a
preemption by recompute, from a prefix-cache hit, on a freshly built model (an executor
restart) and on one thread. The model runs a plan whose kernels change with the step's
rows (the native small-batch linear up to 256 rows, then oneDNN or torch; SDPA for fresh
prompts; the prompt kernels for long runs), and the same comparisons without the flag
differ, so the test can fail."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from components.executor import determinism
from components.executor.build import build_model
from components.executor.candidates import amx_possible
from components.executor.runner import ModelRunner
from components.executor.synthetic import ModelShape, random_weights
from kernels import cpu_linear, native_lib
from kernels.tuning import KernelPlan
from schemas.wire import NewSeq, SeqStep, StepPlan

# head_dim 64 and 3 query heads per kv head (SmolLM2's), so the native attention, its AMX
# tiles and the prompt kernels all run
SHAPE = ModelShape("tiny-g3", num_layers=2, hidden_size=192, intermediate_size=256,
                   num_heads=6, num_kv_heads=2, head_dim=64, vocab_size=256, max_position=512)
BLOCK = 16
DECODES = 4

pytestmark = pytest.mark.skipif(not native_lib.available(),
                                reason="the native CPU kernels did not build here")


def _dtype() -> torch.dtype:
    return torch.bfloat16 if cpu_linear.small_batch_supported(torch.bfloat16) \
        else torch.float32


def _model(tiles: str = "vector"):
    """A plan that changes kernels with the step's size, as a measured one does on most
    CPUs, every part forced (so a second build, the restarted executor, has the same plan,
    as a cached one would be). ``tiles``: the paged attention's, which a deterministic
    step's follow (determinism.invariant_tiles)."""
    dtype = _dtype()
    return build_model(SHAPE, random_weights(SHAPE, seed=11), dtype=dtype, backend="cpu",
                       kernels={"linear": "native", "fresh_prompts": "sdpa",
                                "attention_tiles": tiles, "elementwise": "native",
                                "sampling": "native", "layer_loop": "native"})


@pytest.fixture(scope="module", params=["vector", "amx"])
def model(request):
    if request.param == "amx" and not amx_possible(_dtype(), BLOCK):
        pytest.skip("no AMX tiles here")
    return _model(request.param)


@dataclass
class Req:
    sid: int
    prompt: list[int]
    det: bool
    start: int = 0                    # the step it arrives at
    chunk: int | None = None          # max prompt tokens a step (None: at random, 1..64)
    temperature: float = 0.0
    seed: int | None = None
    preempt_after: int | None = None  # dropped and recomputed after this many samples
    prefix_of: int | None = None      # its first blocks are this request's (a cache hit)
    cached: int = 0
    out: list = field(default_factory=list)


def _drive(model, reqs: list[Req], seed: int, flag: bool = True) -> dict[int, list]:
    """Run ``reqs`` as a scheduler would, one StepPlan at a time; each request's samples
    (token, logprobs)."""
    rng = random.Random(seed)
    need = {r.sid: -(-(len(r.prompt) + DECODES) // BLOCK) for r in reqs}
    pool = list(range(sum(need.values())))
    rng.shuffle(pool)
    runner = ModelRunner(model, model.new_kv_cache(len(pool), BLOCK))
    by_sid = {r.sid: r for r in reqs}
    tables: dict[int, list[int]] = {}
    live: dict[int, tuple[int, list[int], int]] = {}    # sid -> (runner seq id, tokens, done)
    waiting = sorted(reqs, key=lambda r: r.start)
    step, next_id = 0, 10_000
    while waiting or live:
        new, steps, drop = [], [], []
        for r in list(waiting):
            if r.start > step or (r.prefix_of is not None and (
                    r.prefix_of in live or not by_sid[r.prefix_of].out)):
                continue
            waiting.remove(r)
            shared = tables[r.prefix_of][:r.cached // BLOCK] if r.prefix_of is not None else []
            tables[r.sid] = shared + [pool.pop() for _ in range(need[r.sid] - len(shared))]
            new.append(NewSeq(r.sid, list(r.prompt), len(r.prompt), r.cached, tables[r.sid],
                              r.temperature, 1.0, 0, r.seed, logprobs=3, deterministic=r.det))
            live[r.sid] = (r.sid, list(r.prompt), r.cached)
        for sid, (seq, tokens, done) in list(live.items()):
            r = by_sid[sid]
            if len(r.out) >= DECODES:
                drop.append(seq)
                del live[sid]
                continue
            if r.preempt_after is not None and len(r.out) == r.preempt_after and seq == sid:
                # preempted by recompute: forgotten, then its prompt and output again
                drop.append(seq)
                seq, next_id = next_id, next_id + 1
                new.append(NewSeq(seq, list(tokens), len(r.prompt), 0, tables[sid],
                                  r.temperature, 1.0, 0, r.seed, logprobs=3,
                                  deterministic=r.det))
                done = 0
            # a prompt chunk, or (one token left: the last sample's) a decode row
            n = min(r.chunk or rng.randrange(1, 65), len(tokens) - done)
            steps.append(SeqStep(seq, n, [], done + n == len(tokens)))
            live[sid] = (seq, tokens, done + n)
        rng.shuffle(steps)                    # its place in the batch
        step += 1
        det = flag and any(by_sid[s.seq_id if s.seq_id in by_sid else _sid(live, s.seq_id)].det
                           for s in steps)
        res = runner.step(StepPlan(step, new, steps, drop, deterministic=det))
        for seq, tok, lp in zip(res.seq_ids, res.token_ids, res.logprobs):
            sid = seq if seq in by_sid else _sid(live, seq)
            by_sid[sid].out.append((tok, lp))
            s, tokens, done = live[sid]
            live[sid] = (s, tokens + [tok], done)
    return {r.sid: r.out for r in reqs}


def _sid(live, seq: int) -> int:
    return next(sid for sid, (s, _, _) in live.items() if s == seq)


def _prompts(rng: random.Random, n: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(SHAPE.vocab_size) for _ in range(rng.randrange(lo, hi))]
            for _ in range(n)]


TARGETS = 20


def _targets(rng: random.Random, det: bool) -> list[Req]:
    """Twenty prompts of 20-300 tokens, greedy and seeded sampling, each prefilled in one
    chunk by default."""
    return [Req(i, p, det, chunk=512, temperature=0.0 if i % 2 == 0 else 0.8,
                seed=None if i % 2 == 0 else 100 + i)
            for i, p in enumerate(_prompts(rng, TARGETS, 20, 300))]


def _with(reqs: list[Req], **changes) -> list[Req]:
    return [Req(**{**r.__dict__, "out": [], **changes}) for r in reqs]


def _alone(model, targets: list[Req]) -> dict[int, list]:
    return {r.sid: _drive(model, _with([r]), 0)[r.sid] for r in targets}


def _neighbours(rng: random.Random, n: int, det: bool, hi: int) -> list[Req]:
    return [Req(1000 + i, p, det and i % 3 == 0, start=rng.randrange(0, 3),
                temperature=0.7, seed=i)
            for i, p in enumerate(_prompts(rng, n, 1, hi))]


def _runs(model, det: bool) -> tuple[dict, list[tuple[str, dict]]]:
    """The targets alone, and every other way of running them."""
    rng = random.Random(5)
    targets = _targets(rng, det)
    alone = _alone(model, targets)
    runs = []
    for n, hi in ((8, 120), (64, 60), (256, 12)):
        got = _drive(model, _with(targets) + _neighbours(rng, n, det, hi), n)
        runs.append((f"beside {n}", got))
    got = _drive(model, _with(targets, chunk=None) + _neighbours(rng, 8, det, 80), 1)
    runs.append(("chunked at random", got))
    got = _drive(model, _with(targets[:2], chunk=1), 2)
    runs.append(("one token at a time", got))
    got = _drive(model, _with(targets, preempt_after=2) + _neighbours(rng, 8, det, 80), 3)
    runs.append(("preempted by recompute", got))
    # a prefix-cache hit: each target again, its first full blocks leased from itself
    hits = [Req(r.sid + 100, r.prompt, det, chunk=512, temperature=r.temperature,
                seed=r.seed, prefix_of=r.sid, cached=(len(r.prompt) - 1) // BLOCK * BLOCK)
            for r in targets]
    got = _drive(model, _with(targets) + hits + _neighbours(rng, 8, det, 80), 4)
    runs.append(("a prefix-cache hit", {r.sid - 100: got[r.sid] for r in hits}))
    got = _drive(_model(model.plan.attention_tiles), _with(targets), 0)
    runs.append(("a restarted executor", got))
    threads = torch.get_num_threads()      # the thread count never splits a row's sums
    torch.set_num_threads(1)
    try:
        got = _drive(model, _with(targets) + _neighbours(rng, 8, det, 80), 6)
    finally:
        torch.set_num_threads(threads)
    runs.append(("on one thread", got))
    return alone, runs


def test_deterministic_rows_are_batch_invariant(model):
    alone, runs = _runs(model, det=True)
    assert all(len(v) == DECODES and all(lp is not None for _, lp in v) for v in alone.values())
    assert sum(len(set(got) & set(alone)) for _, got in runs) == TARGETS * 8 + 2
    for label, got in runs:
        for sid in set(got) & set(alone):
            assert got[sid] == alone[sid], f"request {sid} differs {label}"


def test_without_the_flag_some_differ(model):
    """The same runs on the measured plan: at least one comparison differs (the test above
    can fail), and the invariant plan is not what the step runs without the flag."""
    alone, runs = _runs(model, det=False)
    differ = [label for label, got in runs
              if any(got[s] != alone[s] for s in set(got) & set(alone))]
    assert differ, "every run matched without the deterministic flag"


def test_plan_id_is_stable_and_says_what_runs(model):
    pid = determinism.plan_id(model.plan, model.dtype)
    again = _model(model.plan.attention_tiles).plan
    assert pid == determinism.plan_id(again, model.dtype)       # a restart: the same
    assert pid.startswith(f"det{determinism.VERSION}-")
    assert pid.endswith("-x") != determinism.is_invariant(model.plan)
    kernels = determinism.plan_kernels(model.plan, model.dtype)
    assert all(kernels[f"linear.{r}"] in determinism.INVARIANT_LINEAR for r in determinism.ROLES)
    assert "onednn" not in kernels.values()
    other = determinism.plan_id(model.plan, torch.float16)     # another build or dtype:
    assert other != pid                                        # another id


def test_the_pin_does_not_follow_the_plans_timings():
    """A plan measured again (a provisional one, at a quieter start) may time the paged
    tiles the other way round. The deterministic step's tiles come from what the machine
    can run, so the restarted engine keeps the pin and the bits: in an end-to-end run the
    plan's re-measurement flipped them, and a restart gave other bits under another pin."""
    assert determinism.invariant_tiles(True) == "amx"
    assert determinism.invariant_tiles(False) == "vector"
    assert determinism.invariant_tiles(True, "vector") == "vector"     # the engine's forced
    assert determinism.invariant_tiles(True, "auto") == "amx"
    ids = set()
    for measured in ("vector", "amx"):
        plan = KernelPlan(source="measured", attention="cpu", attention_tiles=measured,
                          elementwise="native", sampling="native")
        plan.invariant_linear = {r: "native" for r in determinism.ROLES}
        plan.invariant_tiles = determinism.invariant_tiles(True)
        ids.add(determinism.plan_id(plan, torch.bfloat16))
    assert len(ids) == 1
