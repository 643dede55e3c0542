"""flash-attn 2 adapter: paged attention straight from Weir's KV cache (GPU only).

Weir's per-layer cache ``[num_blocks, block_size, kv_heads, head_dim]`` is exactly the
paged layout flash-attn takes with a ``block_table``, so nothing is copied:

- mixed or prefill steps: ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q,
  cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, block_table=...)``; the causal mask
  is aligned bottom-right, so each sequence's new queries see its cached prefix;
- decode-only steps: ``flash_attn_with_kvcache(q[:, None], k_cache, v_cache,
  cache_seqlens=seq_lens, block_table=...)`` (its split-KV path), CUDA-graph safe.

New keys/values are written first by ``write_kv`` (the Triton kernel, which skips the slot
``-1`` of padding rows; the torch reference when Triton is missing).

Constraints, checked at construction with a ``ValueError`` so ``get_backend("auto")`` can
fall back to Triton: flash-attn 2 requires the paged KV block size to be a multiple of 256
(``Paged KV cache block size must be divisible by 256`` in its ``mha_fwd_kvcache`` and
``mha_varlen_fwd``), fp16/bf16 only, CUDA only, and a flash-attn whose
``flash_attn_varlen_func`` takes ``block_table`` (2.5.x and later).
"""
from __future__ import annotations

import importlib.util
import inspect

import torch

from kernels.metadata import AttentionMetadata

PAGE_MULTIPLE = 256


def is_installed() -> bool:
    """Whether ``flash_attn`` can be found (without importing it)."""
    return importlib.util.find_spec("flash_attn") is not None


class FlashAttnBackend:
    name = "flash_attn"

    def __init__(self, block_size: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 kv_dtype: torch.dtype | None = None):
        if block_size is None:
            raise ValueError("the flash_attn backend needs the KV block size "
                             f"(a multiple of {PAGE_MULTIPLE})")
        if block_size % PAGE_MULTIPLE:
            raise ValueError(f"flash-attn 2 paged KV needs the KV block size (kv.block_size) "
                             f"to be a multiple of {PAGE_MULTIPLE}; it is {block_size}")
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"flash-attn runs in float16/bfloat16 only, not {dtype}")
        if kv_dtype not in (None, dtype):
            raise ValueError(f"this flash-attn adapter reads caches of the model's dtype, not "
                             f"{kv_dtype} (kv.dtype): the triton backend reads fp8 caches")
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"flash-attn needs a CUDA device, not {device}")
        if not torch.cuda.is_available():
            raise ValueError("flash-attn needs CUDA, which is not available")
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except Exception as e:  # ImportError, or a build that does not match this torch
            raise ValueError(f"flash_attn cannot be imported: {e}") from e
        if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
            raise ValueError("this flash_attn has no paged varlen attention (block_table); "
                             "it needs flash-attn >= 2.5")
        self.block_size = block_size
        self._varlen, self._kvcache = flash_attn_varlen_func, flash_attn_with_kvcache
        try:
            from kernels.triton_paged import write_kv
            self.graph_safe = True
        except ImportError:
            from kernels.torch_ref import write_kv
            self.graph_safe = False
        self._write_kv = write_kv

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, meta: AttentionMetadata) -> None:
        self._write_kv(k_cache, v_cache, k, v, meta)

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Same contract as :func:`kernels.torch_ref.paged_attention`."""
        if k_cache.shape[1] % PAGE_MULTIPLE:
            raise ValueError(f"KV cache block size {k_cache.shape[1]} is not a multiple of "
                             f"{PAGE_MULTIPLE}")
        n = len(meta.query_lens)
        if n == 0:
            return torch.empty_like(q)
        if all(ql == 1 for ql in meta.query_lens):
            out = self._kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                block_table=meta.block_tables, softmax_scale=scale,
                                causal=True)
            return out.squeeze(1)
        cu_k = torch.zeros(n + 1, dtype=torch.int32, device=q.device)
        torch.cumsum(meta.seq_lens, 0, dtype=torch.int32, out=cu_k[1:])
        max_k = max(c + ql for c, ql in zip(meta.context_lens, meta.query_lens))
        return self._varlen(q, k_cache, v_cache, meta.query_start_loc, cu_k,
                            max(meta.query_lens), max_k, softmax_scale=scale, causal=True,
                            block_table=meta.block_tables)
