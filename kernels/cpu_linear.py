"""The small-batch linear layers on the native library (csrc/cpu_gemv.cpp): weights packed
once (:func:`pack_small_batch`), then ``F.linear`` by vdpbf16ps (or AVX2) rows, or on the
AMX tiles; the AMX forms with SiLU x up fused in (gate_up) and with the argmax fused in
(a greedy lm_head). Which one a layer runs is measured per machine (executor autotune)."""
from __future__ import annotations

import torch

from kernels.native_lib import amx_supported, load

SMALL_BATCH_MAX = 256     # beyond this oneDNN's blocked GEMM is as fast or faster
_GEMV_BITS = {torch.bfloat16: 1, torch.float32: 2}


def small_batch_supported(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this CPU runs the small-batch linear kernel for ``dtype``: bf16 with
    AVX512-BF16 or AVX2 + FMA, float32 with AVX2 + FMA (csrc/cpu_gemv.cpp)."""
    return bool(load().weir_gemv_supported() & _GEMV_BITS.get(dtype, 0))


def small_batch_fits(dtype: torch.dtype, n: int, k: int) -> bool:
    """Whether a weight [N, K] of ``dtype`` has a small-batch layout: N % 16, and for bf16
    K % 2 (its k-pairs)."""
    return n % 16 == 0 and (dtype == torch.float32 or (dtype == torch.bfloat16 and k % 2 == 0))


def pack_small_batch(w: torch.Tensor) -> torch.Tensor | None:
    """A weight [N, K] in the small-batch kernel's layout: bf16 [N/16, K/2, 16, 2], float32
    [N/16, K, 16]; None when its dtype or shape does not fit (:func:`small_batch_fits`)."""
    n, k = w.shape
    if not small_batch_fits(w.dtype, n, k):
        return None
    if w.dtype == torch.bfloat16:
        return w.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.reshape(n // 16, 16, k).permute(0, 2, 1).contiguous()


def amx_linear_fits(dtype: torch.dtype, n: int, k: int) -> bool:
    """Whether a weight [N, K] runs on the AMX tiles (:func:`small_batch_linear` with
    ``tiles="amx"``): bf16, N % 16, K % 32, and a CPU and process with AMX."""
    return dtype == torch.bfloat16 and n % 16 == 0 and k % 32 == 0 and amx_supported()


def amx_silu_mul_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``silu_mul(F.linear(x, w))`` for a fused gate_up weight ``w`` [2 * inter, K] packed
    by ``pack_small_batch``, on AMX tiles in one pass: [M, inter], equal to the bit to
    :func:`small_batch_linear` (``tiles="amx"``) then :func:`silu_mul`, without the
    [M, 2 * inter] intermediate. bf16, and ``amx_linear_fits`` for the weight."""
    nb = packed.shape[0]
    k, inter = packed.shape[1] * 2, nb * 8
    y = x.new_empty(x.shape[0], inter)
    if x.shape[0] == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16 or packed.dim() != 4 \
            or nb % 2:
        raise ValueError(f"the fused AMX gate_up runs a bf16 gate_up weight, not {x.dtype} "
                         f"rows against {packed.dtype} {tuple(packed.shape)}")
    rc = load().weir_gemm_amx_bf16_silu_mul(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                            y.data_ptr(), x.shape[0], inter, k,
                                            torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the fused AMX gate_up refused {tuple(x.shape)} x {2 * inter}")
    return y


def small_batch_linear(x: torch.Tensor, packed: torch.Tensor,
                       bias: torch.Tensor | None = None, tiles: str = "vector",
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for ``x`` [M, K] against ``pack_small_batch(w)``, of the
    same dtype; M = 0 gives an empty [0, N] (as ``F.linear`` does). ``tiles="amx"``: the
    bf16 weights through AMX tile multiplies (:func:`amx_linear_fits`), any M at one pass
    over the weights; "vector": vdpbf16ps (or AVX2) rows against the same layout.
    ``out_dtype=torch.float32`` (AMX only): each output rounded to bf16 as always, then
    written widened, which is ``.float()`` of the bf16 result without a second pass (the
    lm_head's logits)."""
    nb = packed.shape[0]
    k = packed.shape[1] * 2 if packed.dim() == 4 else packed.shape[1]
    if out_dtype not in (None, x.dtype) and (tiles != "amx" or out_dtype != torch.float32):
        raise ValueError(f"small-batch linear: no {out_dtype} output for {tiles} tiles")
    y = x.new_empty(x.shape[0], nb * 16, dtype=out_dtype or x.dtype)
    if x.shape[0] == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dtype != packed.dtype or (bias is not None and bias.dtype != packed.dtype):
        raise ValueError(f"small-batch linear: {x.dtype} rows against {packed.dtype} weights")
    lib = load()
    run = lib.weir_gemv_bf16 if packed.dtype == torch.bfloat16 else lib.weir_gemv_f32
    if tiles == "amx":
        if packed.dtype != torch.bfloat16:
            raise ValueError(f"the AMX linear runs bf16 weights, not {packed.dtype}")
        run = lib.weir_gemm_amx_bf16_f32 if y.dtype == torch.float32 else \
            lib.weir_gemm_amx_bf16
    if bias is not None:
        bias = bias.contiguous()
    rc = run(x.data_ptr(), x.stride(0), packed.data_ptr(),
             None if bias is None else bias.data_ptr(), y.data_ptr(),
             x.shape[0], nb * 16, k, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"small-batch linear refused {tuple(x.shape)} x {nb * 16}")
    return y


def amx_argmax_linear(x: torch.Tensor, packed: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``argmax(small_batch_linear(x, packed, bias, "amx", torch.float32))`` without the
    logits: [M] int64, each row's first maximum (greedy decoding's lm_head; 64 x 49k logits
    are 12.6 MB written, then read again). bf16, and ``amx_linear_fits`` for the weight."""
    nb = packed.shape[0]
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0] == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16 or packed.dim() != 4 \
            or (bias is not None and bias.dtype != torch.bfloat16):
        raise ValueError(f"the AMX argmax linear runs bf16 rows and weights, not {x.dtype} "
                         f"against {packed.dtype}")
    if bias is not None:
        bias = bias.contiguous()
    rc = load().weir_gemm_amx_bf16_argmax(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                          None if bias is None else bias.data_ptr(),
                                          out.data_ptr(), x.shape[0], nb * 16,
                                          packed.shape[1] * 2, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the AMX argmax linear refused {tuple(x.shape)} x {nb * 16}")
    return out
