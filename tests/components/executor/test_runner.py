"""ModelRunner over StepPlans: a prompt prefilled in chunks, with nothing else in the batch,
gives the tokens of a one-step prefill, and its middle chunks (no row samples) return an
empty result instead of failing the step."""
import pytest
import torch

from components.executor.build import build_model
from components.executor.model import LlamaModel
from components.executor.runner import ModelRunner
from components.executor.synthetic import ModelShape, random_weights
from kernels import cpu_linear, native_lib
from schemas.wire import NewSeq, SeqStep, StepPlan

# head_dim 64: the native attention kernel's shapes; vocab a multiple of 16, so the
# lm_head gets a small-batch packed copy (bf16 on AVX512-BF16), as SmolLM2's 49152 does
SHAPE = ModelShape("tiny64", num_layers=2, hidden_size=128, intermediate_size=192, num_heads=2,
                   num_kv_heads=1, head_dim=64, vocab_size=128, max_position=256)
BLOCK = 16
PROMPT = [(7 * i + 3) % SHAPE.vocab_size for i in range(40)]
BLOCKS = [5, 2, 7, 1]                      # 40 prompt + 4 decode tokens, non-contiguous


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request):
    native = native_lib.available() and cpu_linear.small_batch_supported(request.param)
    m = build_model(SHAPE, random_weights(SHAPE, seed=7), dtype=request.param,
                    kernels={"linear": "native"} if native else None)
    if native:      # the lm_head through the small-batch kernel: the path that failed
        assert m.plan.linear["lm_head"][0][1] == "native"
    return m


def _run(model: LlamaModel, chunks: list[int], decodes: int = 4) -> tuple[list, list[int]]:
    """Prefill PROMPT in ``chunks`` (the last one samples), then greedy decodes; return
    every step's result and the generated tokens."""
    assert sum(chunks) == len(PROMPT)
    runner = ModelRunner(model, model.new_kv_cache(8, BLOCK))
    results, step_id = [], 0
    new = [NewSeq(1, list(PROMPT), len(PROMPT), 0, list(BLOCKS), 0.0, 1.0, 0, None)]
    for i, n in enumerate(chunks):
        step_id += 1
        last = i == len(chunks) - 1
        results.append(runner.step(StepPlan(step_id, new, [SeqStep(1, n, [], last)], [])))
        new = []
    for _ in range(decodes):
        step_id += 1
        results.append(runner.step(StepPlan(step_id, [], [SeqStep(1, 1, [], True)], [])))
    tokens = [t for r in results for t in r.token_ids]
    assert runner.seqs[1].token_ids == PROMPT + tokens
    return results, tokens


def test_chunked_prefill_alone_equals_one_step(model):
    _, want = _run(model, [40])
    results, got = _run(model, [16, 16, 8])
    for r in results[:2]:                  # middle chunks: nothing sampled, nothing failed
        assert (r.seq_ids, r.token_ids, r.failed) == ([], [], False)
    assert results[2].seq_ids == [1]
    assert got == want and len(got) == 5


def test_forward_without_logit_rows_only_writes_kv(model):
    """No logits_indices: the layers run (the KV is written exactly as with them) and the
    lm_head is skipped; the result is an empty float32 [0, vocab]."""
    from kernels import AttentionMetadata
    meta = AttentionMetadata.build([len(PROMPT)], [0], [BLOCKS], BLOCK)
    ids = torch.tensor(PROMPT)
    caches = []
    for rows in (torch.tensor([len(PROMPT) - 1]), torch.tensor([], dtype=torch.long)):
        kv = model.new_kv_cache(8, BLOCK)
        out = model.forward(ids, meta.positions, kv, meta, rows)
        assert out.dtype == torch.float32 and out.shape == (rows.numel(), SHAPE.vocab_size)
        caches.append(kv.data)
    assert torch.equal(caches[0], caches[1])


def test_plan_without_steps_runs_no_forward(model):
    runner = ModelRunner(model, model.new_kv_cache(8, BLOCK))
    r = runner.step(StepPlan(1, [], [], [3]))
    assert (r.seq_ids, r.token_ids, r.failed) == ([], [], False)


def test_tier_copies_run_in_order_and_touch_only_their_blocks():
    """Copies between the device pool and the host tier (block ids past the pool's are the
    host's), in the order given: a chain main 1 -> host 0 -> main 3 carries block 1's
    contents, a copy that reads a block an earlier one wrote sees the new contents, and
    nothing else changes."""
    from kernels.kv_cache import KVCache
    from schemas.wire import BlockCopy
    kv = KVCache.allocate(2, 4, BLOCK, 1, 8)
    runner = ModelRunner(model=None, kv=kv, num_host_blocks=3)
    kv.data.normal_()
    runner.host.normal_()
    main, host = kv.data.clone(), runner.host.clone()
    runner.copy_blocks([BlockCopy(1, 4), BlockCopy(4, 3), BlockCopy(2, 5), BlockCopy(6, 2)])
    assert torch.equal(runner.host[:, :, 0], main[:, :, 1])
    assert torch.equal(kv.data[:, :, 3], main[:, :, 1])
    assert torch.equal(runner.host[:, :, 1], main[:, :, 2])
    assert torch.equal(kv.data[:, :, 2], host[:, :, 2])
    assert torch.equal(kv.data[:, :, :2], main[:, :, :2])
    assert torch.equal(runner.host[:, :, 2], host[:, :, 2])
    assert runner.copied_blocks == 4
    assert runner.measure_copy_bandwidth(blocks=2) > 0
    assert runner.copied_blocks == 0


def test_the_cpu_pool_is_zeroed_and_costs_no_memory_until_written():
    from components.executor.service import rss_bytes as rss
    from kernels.kv_cache import KVCache
    before = rss()
    kv = KVCache.allocate(30, 4096, 16, 3, 64, torch.bfloat16)    # 1.5 GB
    assert kv.data.is_contiguous() and kv.data.data_ptr() % 4096 == 0
    assert not kv.data[:, :, ::97].any()            # reading maps the zero page
    kv.data[:, :, 7] = 1.0
    assert rss() - before < 64 << 20
    assert kv.data[:, :, 7].eq(1.0).all() and not kv.data[:, :, 8].any()


def test_a_greedy_batch_takes_tokens_from_the_model_and_the_same_ones(model, monkeypatch):
    """Where every row is greedy and nothing else reads the logits, the runner asks the
    model for the tokens (``forward(greedy=True)``: on the AMX tiles, no logits written);
    they are the tokens of the logits and the sampler. A row that draws, or asks for
    logprobs, keeps the logits."""
    greedy_calls = []
    forward = model.forward

    def spy(*a, **k):
        greedy_calls.append(k.get("greedy", False))
        return forward(*a, **k)

    monkeypatch.setattr(model, "forward", spy)
    _, fused = _run(model, [16, 24])
    assert greedy_calls == [False, True, True, True, True, True]   # the middle chunk: no rows
    monkeypatch.setattr(ModelRunner, "_plain_greedy", staticmethod(lambda states: False))
    _, want = _run(model, [16, 24])
    assert fused == want
    monkeypatch.undo()
    runner = ModelRunner(model, model.new_kv_cache(8, BLOCK))
    greedy_calls.clear()
    monkeypatch.setattr(model, "forward", spy)
    runner.step(StepPlan(1, [NewSeq(1, list(PROMPT[:8]), 8, 0, [5], 0.0, 1.0, 0, None),
                             NewSeq(2, list(PROMPT[:8]), 8, 0, [2], 0.7, 1.0, 0, 3),
                             NewSeq(3, list(PROMPT[:8]), 8, 0, [7], 0.0, 1.0, 0, None,
                                    logprobs=2)],
                         [SeqStep(1, 8, [], True), SeqStep(2, 8, [], True)], []))
    runner.step(StepPlan(2, [], [SeqStep(3, 8, [], True)], []))
    assert greedy_calls == [False, False]
