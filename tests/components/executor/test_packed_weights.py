"""oneDNN-packed linear weights (the CPU default) give the unpacked model's logits."""
import pytest
import torch

from components.executor.model import LlamaModel, _can_pack
from components.executor.synthetic import ModelShape, random_weights
from kernels import AttentionMetadata

SHAPE = ModelShape("tiny", num_layers=2, hidden_size=64, intermediate_size=96, num_heads=6,
                   num_kv_heads=2, head_dim=16, vocab_size=101, max_position=128)


@pytest.mark.skipif(not _can_pack(), reason="this torch build has no oneDNN linear packing")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
def test_packed_equals_plain(dtype, tol):
    weights = random_weights(SHAPE, seed=3)
    packed = LlamaModel(SHAPE, weights, dtype=dtype, backend="torch")
    plain = LlamaModel(SHAPE, weights, dtype=dtype, backend="torch", pack_weights=False)
    assert packed.packed and not plain.packed
    lens = [5, 1, 9]
    meta = AttentionMetadata.build(lens, [0, 0, 0], [[0], [1], [2]], 16)
    ids = torch.randint(0, SHAPE.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([4, 5, 14])
    outs = []
    for model in (packed, plain):
        kv = model.new_kv_cache(4, 16)
        outs.append(model.forward(ids, meta.positions, kv, meta, rows))
    err = ((outs[0] - outs[1]).abs().max() / outs[1].abs().max()).item()
    assert err <= tol, err


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_native_ops_equal_the_torch_forward(dtype, tol):
    """The CPU forward with fused native ops (add+RMSNorm, in-place RoPE, SiLU x up) gives
    the torch forward's logits; contexts include cached prefixes (a second step)."""
    weights = random_weights(SHAPE, seed=4)
    fused = LlamaModel(SHAPE, weights, dtype=dtype)
    plain = LlamaModel(SHAPE, weights, dtype=dtype, native_ops=False)
    if fused.native is None:
        pytest.skip("native CPU kernels unavailable (no C++ compiler)")
    assert plain.native is None
    g = torch.Generator().manual_seed(1)
    outs = {}
    for name, model in (("fused", fused), ("plain", plain)):
        kv = model.new_kv_cache(8, 16)
        got = []
        for lens, ctx in (([5, 1, 9], [0, 0, 0]), ([1, 3, 1], [5, 1, 9])):
            meta = AttentionMetadata.build(lens, ctx, [[0, 1], [2, 3], [4, 5]], 16)
            ids = torch.randint(0, SHAPE.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(sum(ctx)))
            rows = torch.cumsum(torch.tensor(lens), 0) - 1
            got.append(model.forward(ids, meta.positions, kv, meta, rows))
        outs[name] = torch.cat(got)
    err = ((outs["fused"] - outs["plain"]).abs().max() / outs["plain"].abs().max()).item()
    assert err <= tol, err


@pytest.mark.parametrize("steps", [([5, 1, 9], [0, 0, 0]), ([1, 1, 1], [5, 1, 9])])
def test_small_batch_kernel_equals_onednn(steps):
    """bf16 steps of few tokens through the native small-batch linear kernel give oneDNN's
    logits within bf16 rounding (prefill and decode shapes)."""
    from kernels import cpu_native
    weights = random_weights(SHAPE, seed=5)
    small = LlamaModel(SHAPE, weights, dtype=torch.bfloat16, small_batch_max=64)
    onednn = LlamaModel(SHAPE, weights, dtype=torch.bfloat16, small_batch_max=0)
    if small.small_max == 0:
        pytest.skip("no native small-batch kernel on this CPU")
    assert onednn.small_max == 0 and small.layers[0].qkv_s is not None
    lens, ctx = steps
    meta = AttentionMetadata.build(lens, ctx, [[0, 1], [2, 3], [4, 5]], 16)
    ids = torch.randint(0, SHAPE.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(2))
    rows = torch.cumsum(torch.tensor(lens), 0) - 1
    outs = [m.forward(ids, meta.positions, m.new_kv_cache(8, 16), meta, rows)
            for m in (small, onednn)]
    err = ((outs[0] - outs[1]).abs().max() / outs[1].abs().max()).item()
    assert err <= 2e-2, err
    assert cpu_native.small_batch_supported()
