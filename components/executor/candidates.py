"""What can run here: each linear weight's shape and the candidates that can run it on
this device and dtype, and whether the AMX attention tiles, the native elementwise ops and
Triton exist. Both the planner (:mod:`components.executor.autotune`) and the timings
(:mod:`components.executor.measure`) ask."""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from components.executor.linear import can_pack
from kernels import cpu_linear, native_lib

if TYPE_CHECKING:
    from schemas.model import ModelSpec


def shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Each linear weight's [out, in]."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * spec.intermediate_size, h),
            "down": (h, spec.intermediate_size), "lm_head": (spec.vocab_size, h)}


def linear_candidates(dtype: torch.dtype, device: torch.device,
                      shape: tuple[int, int], silu: bool = False) -> dict[str, int]:
    """The candidates that can run a weight of ``shape`` here: name -> largest M.
    ``silu``: the weight is gate_up and the plan times it with the SiLU x up that follows
    (the native elementwise ops): also oneDNN's GEMMs with SiLU x up in their epilogue
    (``onednn_silu``, ``fp32_onednn_silu``: components/executor/linear.py)."""
    if device.type != "cpu":
        return {"torch": 1 << 30}
    out = {"torch": 1 << 30}
    if can_pack(dtype):
        out["onednn"] = 1 << 30
    if dtype in (torch.bfloat16, torch.float16):
        out["fp32"] = 1 << 30
        if can_pack(torch.float32):
            out["fp32_onednn"] = 1 << 30
    if silu and n_even(shape):
        if "onednn" in out:
            out["onednn_silu"] = 1 << 30
        if "fp32_onednn" in out:
            out["fp32_onednn_silu"] = 1 << 30
    n, k = shape
    if (cpu_linear.small_batch_fits(dtype, n, k) and native_lib.available()
            and cpu_linear.small_batch_supported(dtype)):
        out["native"] = cpu_linear.SMALL_BATCH_MAX
    if cpu_linear.amx_linear_fits(dtype, n, k):       # (it checks the library builds)
        out["amx"] = 1 << 30                # one pass over the weights for any M
    return out


def n_even(shape: tuple[int, int]) -> bool:
    return shape[0] % 2 == 0


def amx_possible(dtype: torch.dtype, block_size: int) -> bool:
    """Whether the cpu backend's AMX paged kernel can run: bf16, blocks of a multiple of 16
    keys, and a native build with AMX that this process may use."""
    return dtype == torch.bfloat16 and block_size % 16 == 0 and native_lib.amx_supported()


def native_ops_possible(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and spec.head_dim <= 256 and native_lib.available())


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
