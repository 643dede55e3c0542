"""Random-weight Llama models of a given shape, for GPU checks and speed measurements.

Timing does not depend on weight values, so a model of the right shape with random weights
measures what a real checkpoint would. :class:`ModelShape` has the fields of
:class:`schemas.model.ModelSpec` that :class:`~components.executor.model.LlamaModel` reads,
without needing msgspec. :func:`weight_bytes` and :func:`decode_bytes` count what one decode
step must move through memory, for roofline numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def scaled(self, **changes) -> ModelShape:
        return replace(self, **changes)


SMOLLM2_135M = ModelShape("smollm2-135m-shape", num_layers=30, hidden_size=576,
                          intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                          vocab_size=49152, rope_theta=100000.0)
LLAMA_1B = ModelShape("llama-1b-shape", num_layers=16, hidden_size=2048,
                      intermediate_size=8192, num_heads=32, num_kv_heads=8, head_dim=64,
                      vocab_size=128256, rope_theta=500000.0)


def random_weights(shape: ModelShape, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights under the loader's canonical names (see :mod:`components.executor.loader`),
    drawn on ``device`` in ``dtype``: linear layers N(0, 0.02), norms near 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, d = shape.hidden_size, shape.head_dim

    def rand(*size: int, std: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*size, generator=g, device=device, dtype=dtype).mul_(std).add_(mean)

    w = {"embed": rand(shape.vocab_size, h), "norm": rand(h, mean=1.0)}
    w["lm_head"] = w["embed"] if shape.tie_word_embeddings else rand(shape.vocab_size, h)
    for i in range(shape.num_layers):
        p = f"layers.{i}."
        w.update({p + "attn_norm": rand(h, mean=1.0), p + "mlp_norm": rand(h, mean=1.0),
                  p + "q": rand(shape.num_heads * d, h), p + "k": rand(shape.num_kv_heads * d, h),
                  p + "v": rand(shape.num_kv_heads * d, h), p + "o": rand(h, shape.num_heads * d),
                  p + "gate": rand(shape.intermediate_size, h),
                  p + "up": rand(shape.intermediate_size, h),
                  p + "down": rand(h, shape.intermediate_size)})
    return w


def weight_bytes(shape: ModelShape, elem_bytes: int, batch: int = 1) -> int:
    """Bytes of weights one forward reads: every layer matrix and norm, the final norm, the
    LM head once, and ``batch`` embedding rows (the whole table only as the tied head)."""
    h, d = shape.hidden_size, shape.head_dim
    per_layer = (h * (shape.num_heads + 2 * shape.num_kv_heads) * d   # fused qkv
                 + shape.num_heads * d * h                              # o
                 + 3 * shape.intermediate_size * h                      # gate, up, down
                 + 2 * h)                                               # two norms
    head = shape.vocab_size * h
    embed_rows = batch * h
    return (shape.num_layers * per_layer + h + head + embed_rows) * elem_bytes


def kv_read_bytes(shape: ModelShape, seq_lens: list[int], elem_bytes: int) -> int:
    """Bytes of keys and values decode attention reads: every cached token of every
    sequence (its new one included), in every layer."""
    per_token = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * elem_bytes
    return sum(seq_lens) * per_token


def decode_bytes(shape: ModelShape, seq_lens: list[int], elem_bytes: int,
                 kv_elem_bytes: int | None = None) -> int:
    """Weights + KV read for one decode step over sequences of ``seq_lens`` tokens (the
    cache's elements ``kv_elem_bytes`` each, e.g. 1 for fp8; default ``elem_bytes``)."""
    return (weight_bytes(shape, elem_bytes, batch=len(seq_lens))
            + kv_read_bytes(shape, seq_lens, kv_elem_bytes or elem_bytes))
