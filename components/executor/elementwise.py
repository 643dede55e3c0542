"""The decoder's elementwise steps (add+RMSNorm, RoPE, SiLU x up) in the form a kernel plan
names: the CPU's native fused ops, Triton's fused kernels, or torch."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels import cpu_native

if TYPE_CHECKING:  # only needs the spec's attributes: no msgspec at run time (scripts/gpu_check)
    from schemas.model import ModelSpec


class ElementwiseOps:
    """The elementwise steps, each in one of three forms: fused, one pass per row instead of
    ~28 torch ops per layer, by the CPU's native ops (kernels/csrc/cpu_fused.cpp) or by
    Triton kernels (kernels/triton_fused.py, the GPU's; graph-capturable), both given as
    ``fused`` (a module with ``add_rms_norm``, ``rope_`` and ``silu_mul``); or torch (the
    CPU when measured faster or without a compiler, and a GPU without Triton)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 fused=None) -> None:
        self.spec, self.dtype, self.fused = spec, dtype, fused
        d = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freqs = torch.outer(torch.arange(spec.max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)

    def rope_tables(self, positions: torch.Tensor):
        """What :meth:`split_qkv` needs for ``positions`` (None for the fused RoPE, which
        reads the float32 tables itself)."""
        if self.fused is not None:
            return None
        return (self.cos[positions].to(self.dtype)[:, None, :],
                self.sin[positions].to(self.dtype)[:, None, :])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return weight * x32.to(self.dtype)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None,
                 weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream ``h + delta`` (``delta`` None: ``h``) and its RMSNorm
        scaled by ``weight`` (None: skipped). The native form updates ``h`` in place."""
        if self.fused is None:
            if delta is not None:
                h = h + delta
            return h, None if weight is None else self.rms_norm(h, weight)
        if weight is None:
            h += delta
            return h, None
        x = torch.empty_like(h)
        self.fused.add_rms_norm(h, delta, weight, x, self.spec.rms_norm_eps)
        return h, x

    def split_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rope, kv=None) -> tuple:
        """q, k, v views of the fused projection rows, with RoPE applied to q and k. ``kv``
        ``(k_cache, v_cache, slots)``: also store the new keys and values at ``slots`` of one
        layer's caches, in the same pass over the rows (the CPU's native ops only:
        :func:`~kernels.cpu_native.rope_write_kv_`)."""
        s = self.spec
        n_q, n_kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q, k = qkv[:, :n_q], qkv[:, n_q:n_q + n_kv]
        v = qkv[:, n_q + n_kv:].view(-1, s.num_kv_heads, s.head_dim)
        if kv is not None:
            k_cache, v_cache, slots = kv
            self.fused.rope_write_kv_(qkv, s.num_heads, s.num_kv_heads, s.head_dim, positions,
                                      self.cos, self.sin, k_cache, v_cache, slots)
        elif self.fused is None:
            cos, sin = rope
            return (self.rope(q.view(-1, s.num_heads, s.head_dim), cos, sin),
                    self.rope(k.view(-1, s.num_kv_heads, s.head_dim), cos, sin), v)
        else:
            self.fused.rope_(qkv, s.num_heads + s.num_kv_heads, s.head_dim, positions,
                             self.cos, self.sin)
        return (q.view(-1, s.num_heads, s.head_dim), k.view(-1, s.num_kv_heads, s.head_dim), v)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def fused_ops(elementwise: str):
    """The module of fused elementwise ops a plan's ``elementwise`` names (None: torch)."""
    if elementwise == "native":
        return cpu_native
    if elementwise == "triton":
        from kernels import triton_fused
        return triton_fused
    return None
