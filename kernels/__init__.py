"""Attention kernels behind a small backend registry.

A backend is any object with ``name``, ``write_kv(k_cache, v_cache, k, v, meta)`` and
``paged_attention(q, k_cache, v_cache, meta, scale)`` (see :mod:`kernels.torch_ref`).
Backends are registered by name with a zero-argument factory, imported lazily.
"""
from __future__ import annotations

import importlib.util
from typing import Callable, Protocol

import torch

from kernels.kv_cache import KVCache
from kernels.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, meta: AttentionMetadata) -> None: ...

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


class _TorchBackend:
    name = "torch"

    def __init__(self) -> None:
        from kernels import torch_ref
        self.write_kv = torch_ref.write_kv
        self.paged_attention = torch_ref.paged_attention


def _triton_backend() -> AttentionBackend:
    from kernels.triton_paged import TritonBackend
    return TritonBackend()


_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {"torch": _TorchBackend}
if importlib.util.find_spec("triton") is not None:
    _REGISTRY["triton"] = _triton_backend


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    """Make ``factory()`` available as ``get_backend(name)``."""
    _REGISTRY[name] = factory


def get_backend(name: str = "auto", device: torch.device | str | None = None) -> AttentionBackend:
    """Return the named backend; ``"auto"`` picks the best registered one for ``device``
    (currently always ``"torch"``; a GPU kernel backend would be preferred on CUDA)."""
    if name == "auto":
        is_cuda = device is not None and torch.device(device).type == "cuda"
        name = next((n for n in ("triton", "flash_attn") if is_cuda and n in _REGISTRY), "torch")
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; have {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache", "get_backend", "register_backend"]
