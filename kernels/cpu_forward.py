"""The decoder layers of a step in one native call (csrc/cpu_forward.cpp): the argument
structures it reads (``LayerArgs`` per layer, ``StepArgs`` per step), and a chain of linear
layers in one call for timing (bench_step's GEMM floor). The library is
:mod:`kernels.native_lib`; :meth:`LlamaModel._native_layers` decides when a step runs
this way."""
from __future__ import annotations

import ctypes

import torch

from kernels.native_lib import DTYPES, load


class LinearArgs(ctypes.Structure):
    """A packed weight (:func:`pack_small_batch`) and its kernel: kind 0 the vector
    kernel, 1 the AMX tiles."""
    _fields_ = [("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("kind", ctypes.c_int32), ("pad", ctypes.c_int32)]


class LayerArgs(ctypes.Structure):
    _fields_ = [("qkv", LinearArgs), ("o", LinearArgs), ("gate_up", LinearArgs),
                ("down", LinearArgs), ("mlp_norm", ctypes.c_void_p),
                ("next_norm", ctypes.c_void_p), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p)]


class StepArgs(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int32), ("threads", ctypes.c_int32)] + [
        (n, ctypes.c_int64) for n in ("rows", "hidden", "heads", "kv_heads", "head_dim",
                                      "inter")] + [
        (n, ctypes.c_void_p) for n in ("h", "x", "qkv", "attn", "gate_up", "act", "delta",
                                       "positions", "cos", "sin", "slots", "seqs",
                                       "row_lens", "tables")] + [
        ("table_width", ctypes.c_int64), ("block_size", ctypes.c_int64),
        ("scale", ctypes.c_float), ("eps", ctypes.c_float), ("amx_attention", ctypes.c_int32),
        ("kv_dtype", ctypes.c_int32), ("seconds", ctypes.c_void_p)]


# what weir_forward_layers times into StepArgs.seconds (a float64 tensor of this many)
LAYER_PARTS = ("qkv", "rope+kv write", "attention", "o", "add+rmsnorm", "gate_up+silu",
               "down")


LINEAR_KINDS = {"native": 0, "amx": 1}      # the plan's candidates these layers can run


def linear_args(packed: torch.Tensor, kind: str, bias: torch.Tensor | None) -> LinearArgs:
    n = packed.shape[0] * 16
    k = packed.shape[1] * 2 if packed.dim() == 4 else packed.shape[1]
    return LinearArgs(packed.data_ptr(), None if bias is None else bias.data_ptr(), n, k,
                      LINEAR_KINDS[kind], 0)


def forward_layers(layers: ctypes.Array, step: StepArgs) -> None:
    """Run the decoder layers ``layers`` (a ``LayerArgs`` array) of one step."""
    rc = load().weir_forward_layers(ctypes.addressof(layers), len(layers),
                                    ctypes.addressof(step))
    if rc != 0:
        raise ValueError(f"a native kernel of layer {rc - 1} refused the step's shapes")


def linear_chain(x: torch.Tensor, weights: list[torch.Tensor], kind: str) -> torch.Tensor:
    """``F.linear(x, w)`` for each packed weight in turn, all in one native call (no Python
    between them, as in :func:`forward_layers`); returns the last output. For timing."""
    chain = (LinearArgs * len(weights))(*[linear_args(w, kind, None) for w in weights])
    y = x.new_empty(x.shape[0], chain[0].n)
    if any(c.n != chain[0].n for c in chain) or x.stride(-1) != 1:
        raise ValueError("a linear chain runs weights of one shape on rows with unit stride")
    rc = load().weir_linear_chain(ctypes.addressof(chain), len(chain), DTYPES[x.dtype],
                                  x.data_ptr(), x.stride(0), y.data_ptr(), x.shape[0],
                                  torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the {kind} linear refused {tuple(x.shape)} x {chain[0].n}")
    return y
