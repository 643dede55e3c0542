"""ModelRunner over StepPlans: a prompt prefilled in chunks, with nothing else in the batch,
gives the tokens of a one-step prefill, and its middle chunks (no row samples) return an
empty result instead of failing the step."""
import pytest
import torch

from components.executor.model import LlamaModel
from components.executor.runner import ModelRunner
from components.executor.synthetic import ModelShape, random_weights
from kernels import cpu_native
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
    native = cpu_native.available() and cpu_native.small_batch_supported(request.param)
    m = LlamaModel(SHAPE, random_weights(SHAPE, seed=7), dtype=request.param,
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
