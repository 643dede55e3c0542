"""DecodeGraphs' static-buffer decode (packing, padding, bucket choice) against the eager
forward. Without CUDA it runs without graphs, the Triton kernels under TRITON_INTERPRET=1;
with CUDA the same tests capture and replay real graphs (see also tests/kernels/test_gpu.py
and scripts/gpu_check)."""
import os
import random

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from components.executor.build import build_model  # noqa: E402 - after TRITON_INTERPRET is set
from components.executor.cuda_graphs import DecodeGraphs, batch_buckets  # noqa: E402 - after TRITON_INTERPRET is set
from components.executor.synthetic import ModelShape, random_weights  # noqa: E402 - after TRITON_INTERPRET is set
from kernels import AttentionMetadata  # noqa: E402 - after TRITON_INTERPRET is set

BS = 16
MAX_LEN = 200
SHAPE = ModelShape("tiny", num_layers=2, hidden_size=64, intermediate_size=96, num_heads=6,
                   num_kv_heads=2, head_dim=16, vocab_size=101, max_position=256)


@pytest.fixture(scope="module")
def model():
    return build_model(SHAPE, random_weights(SHAPE, seed=1), device=DEVICE, backend="triton")


def _batch(rng: random.Random, n: int, num_blocks: int, use_block0: bool):
    """n decode sequences with shuffled, non-contiguous tables (plus lookahead blocks)."""
    pool = list(range(1, num_blocks))
    rng.shuffle(pool)
    if use_block0:
        pool.insert(0, 0)
    ids, pos, tables = [], [], []
    edges = [0, BS - 1, BS, 2 * BS + 1, MAX_LEN - 1]
    for i in range(n):
        p = edges[i] if i < len(edges) else rng.randrange(MAX_LEN)
        need = p // BS + 1 + rng.randint(0, 2)
        tables.append([pool.pop(0) for _ in range(need)])
        ids.append(rng.randrange(SHAPE.vocab_size))
        pos.append(p)
    return ids, pos, tables


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    b = batch_buckets(256)
    assert b[:5] == [1, 2, 4, 8, 16] and b[-1] == 256 and len(b) == 35
    assert all(x % 8 == 0 for x in b[3:])


@pytest.mark.parametrize("n, use_block0", [(1, False), (3, True), (5, False), (12, True)])
def test_static_decode_matches_eager(model, n, use_block0):
    rng = random.Random(n)
    num_blocks = 12 * (MAX_LEN // BS + 3) + 1
    kv = model.new_kv_cache(num_blocks, BS)
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(n)))
    graphs = DecodeGraphs(model, kv, max_model_len=MAX_LEN, max_batch=12)
    info = graphs.capture()  # without CUDA: nothing captured, eager from the static buffers
    assert info["buckets"] == ([1, 2, 4, 8, 12] if DEVICE == "cuda" else [])
    assert graphs.can_replay(n, max(2, MAX_LEN)) and not graphs.can_replay(n, MAX_LEN + 1)
    ids, pos, tables = _batch(rng, n, num_blocks, use_block0)

    eager_kv = kv.data.clone()
    eager_cache = type(kv)(eager_kv)
    meta = AttentionMetadata.build([1] * n, pos, tables, BS, DEVICE)
    want = model.forward(torch.tensor(ids, device=DEVICE), meta.positions, eager_cache, meta,
                         torch.arange(n, device=DEVICE))

    before = kv.data.clone()
    got = graphs.replay(ids, pos, tables)
    assert got.shape == (n, SHAPE.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the new tokens' K/V landed where the eager step put them; nothing else changed
    # (padding rows up to the bucket write nothing, not even to block 0)
    slots = meta.slot_mapping
    flat = lambda t: t.view(t.shape[0], 2, -1, t.shape[-2], t.shape[-1])
    torch.testing.assert_close(flat(kv.data)[:, :, slots], flat(eager_kv)[:, :, slots],
                               rtol=1e-5, atol=1e-5)
    keep = torch.ones(flat(kv.data).shape[2], dtype=torch.bool, device=DEVICE)
    keep[slots] = False
    assert torch.equal(flat(kv.data)[:, :, keep], flat(before)[:, :, keep])

    rows = [n - 1, 0]
    torch.testing.assert_close(graphs.replay(ids, pos, tables, rows=rows), want[rows],
                               rtol=1e-4, atol=1e-4)


def test_refuses_bad_input(model):
    kv = model.new_kv_cache(40, BS)
    graphs = DecodeGraphs(model, kv, max_model_len=MAX_LEN, max_batch=4)
    assert graphs.buckets == [1, 2, 4] and not graphs.can_replay(5, 10)
    with pytest.raises(ValueError, match="block table"):
        graphs.replay([1], [BS], [[3]])  # position 16 needs a second block
    with pytest.raises(ValueError, match="max_model_len"):
        graphs.replay([1], [MAX_LEN], [list(range(MAX_LEN // BS + 1))])
    with pytest.raises(ValueError, match="differ"):
        graphs.replay([1, 2], [0], [[0]])
    with pytest.raises(ValueError, match="cannot run decode"):
        DecodeGraphs(build_model(SHAPE, random_weights(SHAPE), backend="torch"), kv,
                     max_model_len=MAX_LEN)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="CUDA"):
            DecodeGraphs(model, kv, max_model_len=MAX_LEN, use_graphs=True)


def test_runner_uses_the_decode_path_for_decode_only_steps(model):
    """The ModelRunner replays the static decode path (graphs on CUDA) for decode-only
    steps, runs prefill/mixed steps eagerly, and samples the same greedy tokens either way."""
    from components.executor.runner import ModelRunner
    from schemas.wire import NewSeq, SeqStep, StepPlan

    def run(use_graphs: bool) -> tuple[list[list[int]], int]:
        kv = model.new_kv_cache(32, BS)
        graphs = (DecodeGraphs(model, kv, max_model_len=MAX_LEN, max_batch=8,
                               use_graphs=DEVICE == "cuda") if use_graphs else None)
        if graphs is not None:
            graphs.capture()
        runner = ModelRunner(model, kv, graphs=graphs)
        prompts = [[3, 5, 7, 9, 11], list(range(20, 40)), [1]]
        tables = [[4, 9], [2, 7, 12], [30]]
        news = [NewSeq(i + 1, p, len(p), 0, t, 0.0, 1.0, 0, None)
                for i, (p, t) in enumerate(zip(prompts, tables))]
        out = [[] for _ in prompts]
        plan = StepPlan(1, news, [SeqStep(i + 1, len(p), [], True)
                                  for i, p in enumerate(prompts)], [])
        for step in range(6):
            res = runner.step(plan)
            for sid, tok in zip(res.seq_ids, res.token_ids):
                out[sid - 1].append(tok)
            plan = StepPlan(step + 2, [], [SeqStep(i + 1, 1, [], True) for i in range(3)], [])
        return out, runner.graph_steps

    eager, none = run(False)
    static, replays = run(True)
    assert none == 0 and replays == 5          # the prefill step is eager, decodes replay
    assert static == eager
