"""PiecewiseGraphs' prefill and mixed steps (bucket choice, static buffers, padding, the
pieces with attention eager between them) against the model's eager forward. Without
CUDA the pieces run eagerly from the static buffers, the Triton kernels under
TRITON_INTERPRET=1; with CUDA the same tests capture and replay real graphs (see also
scripts/gpu_check [3c])."""
import os
import random

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from components.executor.build import build_model  # noqa: E402 - after TRITON_INTERPRET is set
from components.executor.piecewise_graphs import PiecewiseGraphs, token_buckets  # noqa: E402 - after TRITON_INTERPRET is set
from components.executor.synthetic import ModelShape, random_weights  # noqa: E402 - after TRITON_INTERPRET is set
from kernels import AttentionMetadata  # noqa: E402 - after TRITON_INTERPRET is set

BS = 16
MAX_LEN = 160
BUCKETS = [16, 32, 48]
SHAPE = ModelShape("tiny", num_layers=2, hidden_size=64, intermediate_size=96, num_heads=6,
                   num_kv_heads=2, head_dim=16, vocab_size=101, max_position=256)


@pytest.fixture(scope="module")
def model():
    return build_model(SHAPE, random_weights(SHAPE, seed=2), device=DEVICE, backend="triton",
                       kernels={"elementwise": "triton"})


def mixed_step(rng: random.Random, tokens: int, num_blocks: int):
    """A step of exactly ``tokens`` tokens: decode rows (one on a block's last slot), a
    prefill chunk after a cached prefix ending inside a block, and a fresh prompt's chunk
    taking the rest, over shuffled blocks (block 0 never used: padding must not touch it
    either). Returns (ids, query_lens, context_lens, tables)."""
    decode = min(3, tokens - 2) if tokens > 2 else tokens
    rest = tokens - decode
    query = [1] * decode
    context = [BS - 1] + [rng.randrange(1, MAX_LEN - 1) for _ in range(decode - 1)]
    if rest:
        chunk = rest // 2 or rest
        query += [chunk] + ([rest - chunk] if rest - chunk else [])
        context += [rng.randrange(1, MAX_LEN - chunk)] + ([0] if rest - chunk else [])
    pool = list(range(1, num_blocks))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-(q + c) // BS))] for q, c in zip(query, context)]
    ids = [rng.randrange(SHAPE.vocab_size) for _ in range(tokens)]
    return ids, query, context, tables


def _kv(model, seed: int):
    kv = model.new_kv_cache(48, BS)
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(seed)))
    return kv


def test_buckets():
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792,
                                   2048]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]
    assert token_buckets(600) == [16, 32, 64, 128, 256, 512, 600]
    with pytest.raises(ValueError):
        token_buckets(0)


@pytest.mark.parametrize("tokens", [16, 11, 32, 17, 48, 40, 1])
def test_mixed_steps_match_eager_in_every_bucket(model, tokens):
    """Full and padded steps in each bucket: the same logits (at every row, so padding
    reaching any real row would show) and the same KV as the eager forward, and no cache
    slot besides the step's own written (padding rows store nothing, not even in block 0)."""
    rng = random.Random(tokens)
    kv = _kv(model, tokens)
    pieces = PiecewiseGraphs(model, kv, buckets=BUCKETS)
    info = pieces.capture()
    assert info["pieces"] == SHAPE.num_layers + 1
    assert info["buckets"] == (BUCKETS if DEVICE == "cuda" else [])
    ids, query, context, tables = mixed_step(rng, tokens, kv.num_blocks)
    meta = AttentionMetadata.build(query, context, tables, BS, DEVICE)
    ids_t = torch.tensor(ids, device=DEVICE)
    rows = torch.arange(tokens, device=DEVICE)

    eager = type(kv)(kv.data.clone())
    want = model.forward(ids_t, meta.positions, eager, meta, rows)
    before = kv.data.clone()
    got = pieces.forward(ids_t, meta.positions, kv, meta, rows)
    assert got.shape == (tokens, SHAPE.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    flat = lambda t: t.view(t.shape[0], 2, -1, t.shape[-2], t.shape[-1])
    slots = meta.slot_mapping
    torch.testing.assert_close(flat(kv.data)[:, :, slots], flat(eager.data)[:, :, slots],
                               rtol=1e-5, atol=1e-5)
    keep = torch.ones(flat(kv.data).shape[2], dtype=torch.bool, device=DEVICE)
    keep[slots] = False
    assert torch.equal(flat(kv.data)[:, :, keep], flat(before)[:, :, keep])


def test_a_padded_step_after_a_full_one_reads_no_stale_rows(model):
    """The static rows a larger step left behind (its queries, attention output, residual)
    do not leak into a smaller step of the same bucket; the head's variants (sampled rows
    only, greedy tokens, no rows) agree with the eager forward's."""
    rng = random.Random(5)
    kv = _kv(model, 5)
    pieces = PiecewiseGraphs(model, kv, buckets=[32])
    pieces.capture()
    eager = type(kv)(kv.data.clone())
    for tokens in (32, 20, 3):
        ids, query, context, tables = mixed_step(rng, tokens, kv.num_blocks)
        meta = AttentionMetadata.build(query, context, tables, BS, DEVICE)
        ids_t = torch.tensor(ids, device=DEVICE)
        last = torch.tensor([tokens - 1, 0], device=DEVICE)
        want = model.forward(ids_t, meta.positions, eager, meta, last)
        got = pieces.forward(ids_t, meta.positions, kv, meta, last)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(pieces.forward(ids_t, meta.positions, kv, meta, last, greedy=True),
                           want.argmax(-1))
        none = pieces.forward(ids_t, meta.positions, kv, meta, last[:0])
        assert none.shape == (0, SHAPE.vocab_size)
        torch.testing.assert_close(kv.data, eager.data, rtol=1e-5, atol=1e-5)


def test_refuses(model):
    kv = _kv(model, 1)
    pieces = PiecewiseGraphs(model, kv, max_tokens=40)
    assert pieces.buckets == [16, 32, 40] and pieces.fits(40) and not pieces.fits(41)
    assert not pieces.fits(0) and pieces.bucket_for(17) == 32
    other = _kv(model, 2)
    meta = AttentionMetadata.build([2], [0], [[3]], BS, DEVICE)
    with pytest.raises(ValueError, match="cache they were built on"):
        pieces.forward(torch.tensor([1, 2], device=DEVICE), meta.positions, other, meta,
                       torch.tensor([1], device=DEVICE))
    torch_ops = build_model(SHAPE, random_weights(SHAPE), device=DEVICE, backend="triton",
                            kernels={"elementwise": "torch"})
    assert not torch_ops.rope_kv
    with pytest.raises(ValueError, match="fused RoPE"):
        PiecewiseGraphs(torch_ops, kv)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="CUDA"):
            PiecewiseGraphs(model, kv, use_graphs=True)


def test_runner_runs_prefill_and_mixed_steps_through_the_pieces(model):
    """The ModelRunner sends prefill and mixed steps that fit a bucket through the pieces
    (decode-only steps still replay the decode path), and samples the same greedy tokens
    as the eager forward."""
    from components.executor.cuda_graphs import DecodeGraphs
    from components.executor.runner import ModelRunner
    from schemas.wire import NewSeq, SeqStep, StepPlan

    def run(static: bool) -> tuple[list[list[int]], int, int]:
        kv = model.new_kv_cache(32, BS)
        graphs = pieces = None
        if static:
            graphs = DecodeGraphs(model, kv, max_model_len=MAX_LEN, max_batch=4)
            pieces = PiecewiseGraphs(model, kv, buckets=[16, 32])
            graphs.capture()
            pieces.capture()
        runner = ModelRunner(model, kv, graphs=graphs, pieces=pieces)
        prompts = [[3, 5, 7, 9, 11], list(range(20, 40)), [1, 8, 6, 4]]
        tables = [[4, 9], [2, 7, 12], [30]]
        news = [NewSeq(i + 1, p, len(p), 0, t, 0.0, 1.0, 0, None)
                for i, (p, t) in enumerate(zip(prompts, tables))]
        out = [[] for _ in prompts]
        # step 1: two prompts (25 tokens: bucket 32); step 2: two decode rows and the third
        # prompt (mixed, 6 tokens: bucket 16); then decode-only steps
        plans = [StepPlan(1, news[:2], [SeqStep(i + 1, len(prompts[i]), [], True)
                                        for i in range(2)], []),
                 StepPlan(2, news[2:], [SeqStep(1, 1, [], True), SeqStep(2, 1, [], True),
                                        SeqStep(3, 4, [], True)], [])]
        plans += [StepPlan(3 + k, [], [SeqStep(i + 1, 1, [], True) for i in range(3)], [])
                  for k in range(3)]
        for plan in plans:
            res = runner.step(plan)
            for sid, tok in zip(res.seq_ids, res.token_ids):
                out[sid - 1].append(tok)
        return out, runner.graph_steps, runner.piecewise_steps

    eager, none, no_pieces = run(False)
    static, replays, pieced = run(True)
    assert (none, no_pieces) == (0, 0)
    assert pieced == 2 and replays == 3
    assert static == eager
