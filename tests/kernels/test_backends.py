"""Backend registry: the flash-attn adapter refuses what flash-attn 2 cannot do, and
get_backend("auto") falls back to Triton (then torch) on CUDA."""
import pytest
import torch

import kernels
from components.executor.build import build_model
from components.executor.synthetic import ModelShape, random_weights
from kernels import get_backend
from kernels.flash_attn_backend import FlashAttnBackend

HAS_TRITON = "triton" in kernels._REGISTRY


@pytest.mark.parametrize("block_size", [16, 32, 128, 384])
def test_flash_attn_refuses_small_pages(block_size):
    with pytest.raises(ValueError, match="multiple of 256.*" + str(block_size)):
        FlashAttnBackend(block_size=block_size, dtype=torch.bfloat16)


def test_flash_attn_refuses_unknown_size_fp32_and_cpu():
    with pytest.raises(ValueError, match="needs the KV block size"):
        FlashAttnBackend(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        FlashAttnBackend(block_size=256, dtype=torch.float32)
    with pytest.raises(ValueError, match="CUDA"):
        FlashAttnBackend(block_size=256, dtype=torch.bfloat16, device="cpu")


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("block_size, dtype", [(16, torch.bfloat16), (256, torch.float32),
                                               (None, torch.bfloat16)])
def test_auto_falls_back_to_triton_on_cuda(monkeypatch, block_size, dtype):
    # registered as if flash_attn were installed: the real adapter refuses and auto moves on
    monkeypatch.setitem(kernels._REGISTRY, "flash_attn", kernels._flash_attn_backend)
    backend = get_backend("auto", "cuda", block_size=block_size, dtype=dtype)
    assert backend.name == "triton"


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_refuses_blocks_below_16():
    with pytest.raises(ValueError, match=">= 16 tokens, not 8"):
        get_backend("triton", "cuda", block_size=8)
    assert get_backend("auto", "cuda", block_size=8).name == "torch"
    assert get_backend("auto", "cuda", block_size=16).name == "triton"


def test_auto_order_and_explicit_names(monkeypatch):
    assert kernels.AUTO_ORDER_CPU == ("cpu", "torch")      # native decode kernel if it builds
    assert get_backend("auto", "cpu").name in ("cpu", "torch")
    assert get_backend("torch", "cpu").name == "torch"
    assert kernels.AUTO_ORDER_CUDA == ("flash_attn", "triton", "torch")
    made = []

    def usable(**opts):
        made.append(opts)
        return kernels._TorchBackend()

    monkeypatch.setitem(kernels._REGISTRY, "flash_attn", usable)
    get_backend("auto", "cuda", block_size=256, dtype=torch.bfloat16)
    assert made == [{"block_size": 256, "dtype": torch.bfloat16, "device": "cuda"}]
    monkeypatch.delitem(kernels._REGISTRY, "flash_attn")
    monkeypatch.delitem(kernels._REGISTRY, "triton", raising=False)
    assert get_backend("auto", "cuda").name == "torch"
    with pytest.raises(ValueError, match="flash_attn package is not installed"):
        get_backend("flash_attn", "cuda", block_size=256)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_backend("nope")


def test_model_checks_the_cache_block_size_against_its_backend():
    shape = ModelShape("tiny", num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
                       num_kv_heads=1, head_dim=16, vocab_size=11, max_position=64)

    class Paged256(kernels._TorchBackend):
        name, block_size = "paged256", 256

    model = build_model(shape, random_weights(shape), backend=Paged256())
    assert model.new_kv_cache(2, 256).block_size == 256
    with pytest.raises(ValueError, match="blocks of 256 tokens, not 16"):
        model.new_kv_cache(2, 16)
    model = build_model(shape, random_weights(shape), kv_block_size=16)
    assert model.backend.name in ("cpu", "torch")


def test_flash_attn_refuses_an_fp8_cache_so_auto_moves_on():
    """The flash-attn adapter reads caches of the model's dtype: given an fp8 kv.dtype it
    refuses at construction (get_backend("auto") then tries the next backend) instead of
    failing inside the first step."""
    with pytest.raises(ValueError, match="kv.dtype"):
        FlashAttnBackend(block_size=256, dtype=torch.bfloat16, device="cuda",
                         kv_dtype=torch.float8_e4m3fn)
