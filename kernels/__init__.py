"""Attention kernels behind a small backend registry.

A backend is any object with ``name``, ``write_kv(k_cache, v_cache, k, v, meta)`` and
``paged_attention(q, k_cache, v_cache, meta, scale)`` (see :mod:`kernels.torch_ref`), and
optionally ``graph_safe = True`` when its decode path runs from
:meth:`AttentionMetadata.for_decode_buffers` inside a CUDA graph.

Backends are registered by name with a factory, imported lazily and called with keyword
arguments ``block_size``, ``dtype`` and ``device`` (each may be None = unknown); a factory
raises ``ValueError`` when its backend cannot serve that configuration.

``get_backend("auto", device)`` tries, on CUDA: ``flash_attn`` (registered only when the
package is installed; needs KV blocks of a multiple of 256 tokens and fp16/bf16), then
``triton``, then ``torch``; on the CPU: ``cpu`` (native decode kernel, if it builds), then
``torch``. A named backend is built or refused.

Importing the package does not import torch: ``kernels.machine`` (the host's usable cores
and CPU model) is read by processes that never run a kernel (the scheduler), and torch's
import is about 1 s of CPU. ``KVCache`` and ``AttentionMetadata`` load on first use.
"""
from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from kernels.kv_cache import KVCache
    from kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)


def __getattr__(name: str) -> Any:
    if name == "KVCache":
        from kernels.kv_cache import KVCache
        return KVCache
    if name == "AttentionMetadata":
        from kernels.metadata import AttentionMetadata
        return AttentionMetadata
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, meta: AttentionMetadata) -> None: ...

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


class _TorchBackend:
    name = "torch"

    def __init__(self, **_opts) -> None:
        from kernels import torch_ref
        self.write_kv = torch_ref.write_kv
        self.paged_attention = torch_ref.paged_attention


def _triton_backend(block_size: int | None = None, **_opts) -> AttentionBackend:
    if block_size is not None and block_size < 16:  # tl.dot needs tiles of >= 16
        raise ValueError(f"the Triton kernels need KV blocks of >= 16 tokens, not {block_size}")
    from kernels.triton_paged import TritonBackend
    return TritonBackend()


def _cpu_backend(device: torch.device | str | None = None, **opts) -> AttentionBackend:
    import torch
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError("the native CPU attention kernel runs on CPU tensors only")
    from kernels.cpu_native import CpuBackend
    return CpuBackend(**opts)


def _flash_attn_backend(**opts) -> AttentionBackend:
    from kernels.flash_attn_backend import FlashAttnBackend
    return FlashAttnBackend(**opts)


_REGISTRY: dict[str, Callable[..., AttentionBackend]] = {"torch": _TorchBackend,
                                                         "cpu": _cpu_backend}
if importlib.util.find_spec("triton") is not None:
    _REGISTRY["triton"] = _triton_backend
if importlib.util.find_spec("flash_attn") is not None:
    _REGISTRY["flash_attn"] = _flash_attn_backend

AUTO_ORDER_CUDA = ("flash_attn", "triton", "torch")
AUTO_ORDER_CPU = ("cpu", "torch")


def register_backend(name: str, factory: Callable[..., AttentionBackend]) -> None:
    """Make ``factory(block_size=..., dtype=..., device=...)`` available as
    ``get_backend(name)``."""
    _REGISTRY[name] = factory


def get_backend(name: str = "auto", device: torch.device | str | None = None, *,
                block_size: int | None = None, dtype: torch.dtype | None = None,
                kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """Return the named backend, built for KV blocks of ``block_size`` tokens, a model in
    ``dtype`` and caches in ``kv_dtype`` (None: ``dtype``; fp8, kv.dtype); ``"auto"`` picks
    the first usable one for ``device`` (see the module docstring)."""
    import torch
    opts = {"block_size": block_size, "dtype": dtype, "device": device}
    if kv_dtype is not None and kv_dtype != dtype:
        opts["kv_dtype"] = kv_dtype
    if name == "auto":
        is_cuda = device is not None and torch.device(device).type == "cuda"
        for candidate in AUTO_ORDER_CUDA if is_cuda else AUTO_ORDER_CPU:
            if candidate not in _REGISTRY:
                continue
            try:
                return _REGISTRY[candidate](**opts)
            except ValueError as e:
                log.info("attention backend %s not usable, trying the next: %s", candidate, e)
        raise ValueError("no usable attention backend")
    if name not in _REGISTRY:
        hint = " (the flash_attn package is not installed)" if name == "flash_attn" else ""
        raise ValueError(f"unknown attention backend {name!r}{hint}; have {sorted(_REGISTRY)}")
    return _REGISTRY[name](**opts)


__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache", "get_backend", "register_backend"]
