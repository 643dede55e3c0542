"""The decoder layer's elementwise steps as Triton kernels, one launch each (the GPU's form
of kernels/csrc/cpu_fused.cpp; checked on the CPU under TRITON_INTERPRET=1).

In torch a layer's elementwise work is ~28 kernel launches (each add+RMSNorm is an add, a
cast, a square, a mean, an add, a rsqrt, two multiplies and a cast; RoPE is a negation, a
concatenation and three multiplies and adds per q and k; SiLU x up is two). A decode step
of a small model is bound by launches, not bytes: on an H200 SmolLM2's batch-1 step ran
~1130 kernels in 2.5 ms of device time. Here each step is one kernel:

- ``add_rms_norm``: ``h += delta`` (rounded to ``h``'s dtype, as torch's add rounds) and
  ``x = weight * rmsnorm(h)``, one program per row;
- ``rope_``: RoPE on the q and k heads of the fused qkv rows, in place, from the float32
  cos/sin tables at each token's position;
- ``silu_mul``: ``silu(gate) * up`` of the fused gate_up rows;
- ``rope_write_kv``: RoPE on the q and k heads and the paged KV write in one launch, in
  place of ``rope_`` then :func:`kernels.triton_paged.write_kv`: q goes to its own rows
  (a CUDA graph's static buffer, or new), the rotated k and the v straight to their cache
  slot (skipping slot -1, the padding rows of a captured batch), rounded as the two
  kernels round.

Every computation is in float32 from the stored values, so the results agree with torch's
to the rounding of the output dtype. No host syncs and no tensor-dependent shapes: each is
CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_cache import FP8_FORMATS
from kernels.triton_paged import _fp8_code


@triton.jit
def _add_rms_norm_kernel(H, D, W, X, stride_h, stride_d, stride_x, n, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    h = tl.load(H + r * stride_h + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(D + r * stride_d + cols, mask=ok, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + r * stride_h + cols, h, mask=ok)
    x = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
    y = (x * inv).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(X + r * stride_x + cols, (w * y).to(X.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(QKV, POS, COS, SIN, stride_t, stride_pos, heads,
                 HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    hh = tl.arange(0, HEADS_PAD)
    j = tl.arange(0, half)
    ok = (hh < heads)[:, None]
    pos = tl.load(POS + t).to(tl.int64)
    cos = tl.load(COS + pos * stride_pos + j)[None, :]
    sin = tl.load(SIN + pos * stride_pos + j)[None, :]
    lo = QKV + t * stride_t + hh[:, None] * HEAD_DIM + j[None, :]
    x1 = tl.load(lo, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(lo + half, mask=ok, other=0.0).to(tl.float32)
    tl.store(lo, (x1 * cos - x2 * sin).to(QKV.dtype.element_ty), mask=ok)
    tl.store(lo + half, (x2 * cos + x1 * sin).to(QKV.dtype.element_ty), mask=ok)


@triton.jit
def _rope_write_kv_kernel(QKV, POS, COS, SIN, QO, KC, VC, SLOTS, stride_t, stride_pos,
                          stride_qo, heads, kv_heads, HEAD_DIM: tl.constexpr,
                          HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr, MANT: tl.constexpr,
                          BIAS: tl.constexpr, MAX_CODE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    j = tl.arange(0, half)
    pos = tl.load(POS + t).to(tl.int64)
    cos = tl.load(COS + pos * stride_pos + j)[None, :]
    sin = tl.load(SIN + pos * stride_pos + j)[None, :]
    row = QKV + t * stride_t
    hq = tl.arange(0, HEADS_PAD)
    ok = (hq < heads)[:, None]
    at = hq[:, None] * HEAD_DIM + j[None, :]
    x1 = tl.load(row + at, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(row + at + half, mask=ok, other=0.0).to(tl.float32)
    out = QO + t * stride_qo + at
    tl.store(out, (x1 * cos - x2 * sin).to(QO.dtype.element_ty), mask=ok)
    tl.store(out + half, (x2 * cos + x1 * sin).to(QO.dtype.element_ty), mask=ok)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:  # padding rows of a captured batch have slot -1
        hk = tl.arange(0, KV_PAD)
        ok = (hk < kv_heads)[:, None]
        at = hk[:, None] * HEAD_DIM + j[None, :]
        k = row + heads * HEAD_DIM + at
        x1 = tl.load(k, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(k + half, mask=ok, other=0.0).to(tl.float32)
        # rounded to the model's dtype first, as rope_ stores it before write_kv reads it
        k1 = (x1 * cos - x2 * sin).to(QKV.dtype.element_ty)
        k2 = (x2 * cos + x1 * sin).to(QKV.dtype.element_ty)
        v = row + (heads + kv_heads) * HEAD_DIM + at
        v1 = tl.load(v, mask=ok, other=0.0)
        v2 = tl.load(v + half, mask=ok, other=0.0)
        if MANT > 0:  # an fp8 cache (its bytes): rounded as quantize rounds
            k1, k2 = _fp8_code(k1, MANT, BIAS, MAX_CODE), _fp8_code(k2, MANT, BIAS, MAX_CODE)
            v1, v2 = _fp8_code(v1, MANT, BIAS, MAX_CODE), _fp8_code(v2, MANT, BIAS, MAX_CODE)
        dst = slot * kv_heads * HEAD_DIM + at
        tl.store(KC + dst, k1.to(KC.dtype.element_ty), mask=ok)
        tl.store(KC + dst + half, k2.to(KC.dtype.element_ty), mask=ok)
        tl.store(VC + dst, v1.to(VC.dtype.element_ty), mask=ok)
        tl.store(VC + dst + half, v2.to(VC.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, stride_out, n, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < n
    g = tl.load(GU + r * stride_gu + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + r * stride_gu + n + c, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + r * stride_out + c, (s * u).to(OUT.dtype.element_ty), mask=ok)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 out: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` (in place, if given), then ``out = weight * rmsnorm(h)``; rows
    ``[T, hidden]`` with unit stride along the row (the signature of
    :func:`kernels.cpu_native.add_rms_norm`)."""
    t, n = h.shape
    if t:
        _add_rms_norm_kernel[(t,)](
            h, delta if delta is not None else h, weight, out, h.stride(0),
            delta.stride(0) if delta is not None else 0, out.stride(0), n, eps,
            HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(n))
    return out


def rope_(qkv: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor,
          cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE in place on the first ``heads`` heads of each row of ``qkv`` (the q heads then
    the k heads), at ``positions`` in the float32 ``cos``/``sin`` tables
    ``[max_position, head_dim]`` (the two halves of each row are equal)."""
    t = qkv.shape[0]
    if t == 0:
        return
    _rope_kernel[(t,)](qkv, positions, cos, sin, qkv.stride(0), cos.stride(0), heads,
                       HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(heads))


def rope_write_kv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                  positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  q_out: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE and the KV write of fused qkv rows ``[T, (heads + 2 kv_heads) x head_dim]`` in
    one launch: returns the rotated q ``[T, heads, head_dim]`` (in ``q_out`` when given: any
    row stride, each row's heads dense) and stores each token's rotated k and its v at
    ``slots[t]`` of one layer's caches ``[num_blocks, block_size, kv_heads, head_dim]``
    (contiguous; fp8 caches as their rounded bytes); a negative slot stores nothing.
    ``qkv`` itself is left as it was. The same values, bit for bit, as ``rope_`` then
    :func:`kernels.triton_paged.write_kv`."""
    t = qkv.shape[0]
    if q_out is None:
        q_out = torch.empty(t, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q_out
    if qkv.stride(1) != 1 or q_out.stride(2) != 1 or q_out.stride(1) != head_dim \
            or not k_cache.is_contiguous() \
            or not v_cache.is_contiguous():
        raise ValueError("rope_write_kv needs rows of unit stride and contiguous caches")
    mant, bias, max_code = FP8_FORMATS.get(k_cache.dtype, (0, 0, 0))
    if mant:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _rope_write_kv_kernel[(t,)](
        qkv, positions, cos, sin, q_out, k_cache, v_cache, slots, qkv.stride(0),
        cos.stride(0), q_out.stride(0), heads, kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(heads), KV_PAD=triton.next_power_of_2(kv_heads),
        MANT=mant, BIAS=bias, MAX_CODE=max_code)
    return q_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of rows ``[T, 2 x inter]`` (gate first), as ``[T, inter]``."""
    t, two = gate_up.shape
    n = two // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0),
                                                 out.stride(0), n, BLOCK=block)
    return out
