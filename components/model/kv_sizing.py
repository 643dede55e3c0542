"""The KV pool sized in bytes (``kv.memory_gib``, ``weir serve --kv-memory-gib``), as vLLM's
CPU build takes ``VLLM_CPU_KVCACHE_SPACE``, and its host tier (``kv.cpu_memory_gib``, as
vLLM's ``swap_space``): the number of blocks that fit, from the model's shape and the
cache's element type, so an fp8 cache holds twice the tokens of a bf16 one in the same
memory. Every process that reads a config file resolves it the same way (the
model's header gives the same shape), before any component sees ``kv.num_blocks``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import msgspec

from schemas.config import ConfigError, WeirConfig

GIB = 1 << 30
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2}


class KvShape(NamedTuple):
    layers: int
    kv_heads: int
    head_dim: int


def gguf_attention(meta: dict) -> tuple[int, KvShape]:
    """(attention heads, the KV shape) from a GGUF file's metadata, as the loader reads them."""
    arch = meta.get("general.architecture", "llama")
    heads = meta[f"{arch}.attention.head_count"]
    return heads, KvShape(meta[f"{arch}.block_count"],
                          meta.get(f"{arch}.attention.head_count_kv") or heads,
                          meta.get(f"{arch}.attention.key_length")
                          or meta[f"{arch}.embedding_length"] // heads)


def hf_attention(cfg: dict) -> tuple[int, KvShape]:
    """(attention heads, the KV shape) from a Hugging Face config.json, as the loader reads
    them."""
    heads = cfg["num_attention_heads"]
    return heads, KvShape(cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or heads,
                          cfg.get("head_dim") or cfg["hidden_size"] // heads)


def kv_shape(model: Path) -> KvShape:
    """Layers, KV heads and head dim of a GGUF file (its header only) or a Hugging Face
    directory (its config.json)."""
    if model.is_dir():
        return hf_attention(json.loads((model / "config.json").read_text()))[1]
    from components.model.gguf_header import read_header
    return gguf_attention(read_header(model, string_arrays=False).meta)[1]


def block_bytes(shape: KvShape, block_size: int, element_bytes: int) -> int:
    """One block of every layer's keys and values."""
    return 2 * shape.layers * block_size * shape.kv_heads * shape.head_dim * element_bytes


def element_bytes(config: WeirConfig) -> int:
    """The cache's element: one byte for fp8, else the model's dtype."""
    return 1 if config.kv.dtype.startswith("fp8") else _ELEMENT_BYTES[config.engine.dtype]


def sized(config: WeirConfig, shape: KvShape | None = None) -> WeirConfig:
    """``config`` with ``kv.num_blocks`` set to what ``kv.memory_gib`` holds and
    ``kv.num_cpu_blocks`` to what ``kv.cpu_memory_gib`` holds (each unchanged when 0).
    ``shape``: the model's (default: read from ``engine.model``). Raises ConfigError when
    the pool holds fewer than 2 blocks or less than max_model_len, or the config is then
    invalid (swap preemption with a host tier of no blocks)."""
    kv = config.kv
    if kv.memory_gib <= 0 and kv.cpu_memory_gib <= 0:
        return config
    if shape is None:
        from components.model.fetch import resolve_model
        try:
            shape = kv_shape(resolve_model(config.engine.model))
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"kv.memory_gib: cannot read the model's shape: {exc}") from exc
    per_block = block_bytes(shape, kv.block_size, element_bytes(config))
    raw = msgspec.to_builtins(config)
    if kv.memory_gib > 0:
        blocks = int(kv.memory_gib * GIB) // per_block
        if blocks < 2:
            raise ConfigError(f"kv.memory_gib {kv.memory_gib} holds {blocks} blocks of "
                              f"{per_block} bytes; at least 2 are needed")
        if blocks * kv.block_size < config.engine.max_model_len:
            raise ConfigError(f"engine.max_model_len {config.engine.max_model_len} exceeds "
                              f"the KV pool: kv.memory_gib {kv.memory_gib} holds {blocks} "
                              f"blocks of {kv.block_size} tokens")
        raw["kv"]["num_blocks"] = blocks
    if kv.cpu_memory_gib > 0:
        raw["kv"]["num_cpu_blocks"] = int(kv.cpu_memory_gib * GIB) // per_block
    try:
        return msgspec.convert(raw, WeirConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config once the KV pool is sized: {exc}") from exc
