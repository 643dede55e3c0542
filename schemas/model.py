"""The model's shape, as read from a GGUF file or a Hugging Face directory."""
from __future__ import annotations

import msgspec


class ModelSpec(msgspec.Struct, frozen=True):
    """Architecture of a Llama-family decoder. Derived from the weights file, never hand-written."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
