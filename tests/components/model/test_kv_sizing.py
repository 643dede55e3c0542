"""``kv.memory_gib``: the KV pool in bytes, resolved to the blocks that fit by the model's
shape (a GGUF header, a Hugging Face config.json) and the cache's element type."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from components.model.kv_sizing import GIB, KvShape, block_bytes, kv_shape, sized
from schemas.config import ConfigError, WeirConfig, load_config

SMOL = KvShape(layers=30, kv_heads=3, head_dim=64)
SMOL_BLOCK = 2 * 30 * 16 * 3 * 64 * 2          # bf16 keys and values of 16 tokens, 30 layers


def _config(tmp_path, **kv) -> WeirConfig:
    return load_config(None, topology={"run_dir": str(tmp_path)},
                       engine={"dtype": kv.pop("dtype", "bfloat16")}, kv=kv)


def test_blocks_that_fit_by_element_type(tmp_path):
    assert block_bytes(SMOL, 16, 2) == SMOL_BLOCK == 368_640
    bf16 = sized(_config(tmp_path, memory_gib=1.0), SMOL)
    assert bf16.kv.num_blocks == GIB // SMOL_BLOCK == 2912
    e4m3 = sized(load_config(None, topology={"run_dir": str(tmp_path)},
                             engine={"dtype": "bfloat16"},
                             kv={"memory_gib": 1.0, "dtype": "fp8"}), SMOL)
    assert e4m3.kv.num_blocks == GIB // (SMOL_BLOCK // 2) == 5825     # twice the tokens
    f32 = sized(_config(tmp_path, memory_gib=1.0, dtype="float32"), SMOL)
    assert f32.kv.num_blocks == GIB // (SMOL_BLOCK * 2) == 1456
    big = sized(load_config(None, topology={"run_dir": str(tmp_path)},
                            engine={"dtype": "bfloat16"},
                            kv={"memory_gib": 1.0, "block_size": 32}), SMOL)
    assert big.kv.num_blocks == GIB // (SMOL_BLOCK * 2)
    assert bf16.kv.memory_gib == 1.0 and bf16.engine == _config(tmp_path).engine


def test_zero_leaves_the_config_as_it_is(tmp_path):
    cfg = _config(tmp_path, num_blocks=200)
    assert sized(cfg) is cfg and sized(cfg).kv.num_blocks == 200


def test_too_little_memory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="holds 0 blocks"):
        sized(_config(tmp_path, memory_gib=0.0001), SMOL)
    # 2912 blocks of 16 tokens hold 46592; a longer max_model_len does not fit, whatever
    # num_blocks says (it is what the GiB hold): the pool is checked once it is sized
    long = {"dtype": "bfloat16", "max_model_len": 65536}
    cfg = load_config(None, topology={"run_dir": str(tmp_path)}, engine=long,
                      kv={"memory_gib": 1.0})
    with pytest.raises(ConfigError, match="max_model_len 65536 exceeds the KV pool"):
        sized(cfg, SMOL)
    assert sized(load_config(None, topology={"run_dir": str(tmp_path)}, engine=long,
                             kv={"memory_gib": 2.0}), SMOL).kv.num_blocks == 5825
    with pytest.raises(ConfigError, match="max_model_len exceeds the KV pool"):
        load_config(None, topology={"run_dir": str(tmp_path)}, engine=long)   # 2048 blocks
    with pytest.raises(ConfigError, match="memory_gib must be >= 0"):
        _config(tmp_path, memory_gib=-1.0)


def test_shape_from_a_hugging_face_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576}))
    assert kv_shape(tmp_path) == SMOL
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
        "head_dim": 128}))
    assert kv_shape(tmp_path) == KvShape(2, 4, 128)           # MHA, an explicit head dim


def test_shape_from_a_gguf_header(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(4)
    w.add_head_count(8)
    w.add_head_count_kv(2)
    w.add_embedding_length(512)
    w.add_tensor("token_embd.weight", np.zeros((4, 512), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert kv_shape(path) == KvShape(4, 2, 64)
    cfg = load_config(None, topology={"run_dir": str(tmp_path)},
                      engine={"dtype": "bfloat16", "model": str(path)},
                      kv={"memory_gib": 0.5})
    assert sized(cfg).kv.num_blocks == (GIB // 2) // (2 * 4 * 16 * 2 * 64 * 2)


def test_the_default_models_shape(model_path):
    assert kv_shape(model_path) == SMOL


def test_an_unreadable_model_is_a_config_error(tmp_path):
    cfg = load_config(None, topology={"run_dir": str(tmp_path)},
                      engine={"model": str(tmp_path / "absent.gguf")}, kv={"memory_gib": 1.0})
    with pytest.raises(ConfigError, match="cannot read the model's shape"):
        sized(cfg)


def test_the_host_tier_in_gib(tmp_path):
    def cfg(**kv):
        return load_config(None, topology={"run_dir": str(tmp_path)},
                           engine={"dtype": "bfloat16"}, kv=kv)
    both = sized(cfg(memory_gib=1.0, cpu_memory_gib=0.5), SMOL)
    assert (both.kv.num_blocks, both.kv.num_cpu_blocks) == (2912, 1456)
    host = sized(cfg(num_blocks=300, cpu_memory_gib=2.0), SMOL)       # the pool by blocks
    assert (host.kv.num_blocks, host.kv.num_cpu_blocks) == (300, 5825)
    fp8 = sized(cfg(cpu_memory_gib=0.5, dtype="fp8_e5m2"), SMOL)
    assert fp8.kv.num_cpu_blocks == 2912 and fp8.kv.num_blocks == 2048
    assert sized(cfg(cpu_memory_gib=0.0001), SMOL).kv.num_cpu_blocks == 0    # no host tier
    with pytest.raises(ConfigError, match="swap"):         # swap preemption needs the tier
        sized(cfg(cpu_memory_gib=0.0001, preemption_mode="swap"), SMOL)
    with pytest.raises(ConfigError, match="cpu_memory_gib must be >= 0"):
        cfg(cpu_memory_gib=float("nan"))
