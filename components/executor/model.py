"""Llama-family decoder over a flat batch of tokens from many sequences (selective batching).

Linear layers, norms and RoPE run on the flat ``[T, hidden]`` tensor; only attention
looks at sequence boundaries, through the paged-attention backend and its metadata.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels import AttentionBackend, AttentionMetadata, KVCache, cpu_native, get_backend

if TYPE_CHECKING:  # only needs the spec's attributes: no msgspec at run time (scripts/gpu_check)
    from schemas.model import ModelSpec


_PACK_HINT = 64          # the batch size oneDNN lays packed weights out for (any M works)


def _can_pack() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")


class _Layer:
    __slots__ = ("attn_norm", "qkv", "qkv_bias", "o", "mlp_norm", "gate_up", "down",
                 "qkv_s", "o_s", "gate_up_s", "down_s")      # *_s: small-batch packed (or None)


class LlamaModel:
    """Inference-only Llama/Qwen2-style model built from :func:`loader.load_model` output.

    Weights are converted to ``dtype`` on ``device``; Q/K/V and gate/up are fused.
    Norms and RoPE tables are computed in float32; logits are returned as float32.
    ``kv_block_size`` (the KV cache's block size, when known) lets the backend choice see
    it: flash-attn needs blocks of a multiple of 256 tokens, so ``"auto"`` only picks it
    when told the size.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 backend: AttentionBackend | str = "auto", kv_block_size: int | None = None,
                 pack_weights: bool = True, native_ops: bool = True,
                 small_batch_max: int = 64):
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)
        if isinstance(backend, str):
            backend = get_backend(backend, self.device, block_size=kv_block_size, dtype=dtype)
        self.backend = backend
        put = lambda t: t.to(device=self.device, dtype=dtype).contiguous()  # noqa: E731
        self.embed = put(weights["embed"])
        tied = spec.tie_word_embeddings or weights["lm_head"] is weights["embed"]
        self.lm_head = self.embed if tied else put(weights["lm_head"])
        self.norm = put(weights["norm"])
        self.layers: list[_Layer] = []
        for i in range(spec.num_layers):
            w = lambda name: weights[f"layers.{i}.{name}"]  # noqa: E731
            layer = _Layer()
            layer.attn_norm, layer.mlp_norm = put(w("attn_norm")), put(w("mlp_norm"))
            layer.qkv = put(torch.cat([w("q"), w("k"), w("v")]))
            biases = [weights.get(f"layers.{i}.{n}_bias") for n in "qkv"]
            layer.qkv_bias = None
            if any(b is not None for b in biases):
                sizes = [w(n).shape[0] for n in "qkv"]
                layer.qkv_bias = put(torch.cat([b if b is not None else torch.zeros(s)
                                                for b, s in zip(biases, sizes)]))
            layer.o = put(w("o"))
            layer.gate_up = put(torch.cat([w("gate"), w("up")]))
            layer.down = put(w("down"))
            self.layers.append(layer)
        d = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freqs = torch.outer(torch.arange(spec.max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(self.device), emb.sin().to(self.device)
        self.scale = 1.0 / math.sqrt(d)
        self.native = None
        if native_ops and self.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) \
                and d <= 256 and cpu_native.available():
            self.native = cpu_native
        self._pack_small_batch(small_batch_max)
        self.packed = pack_weights and self.device.type == "cpu" and _can_pack()
        if self.packed:
            self._pack()

    def _pack_small_batch(self, limit: int) -> None:
        """bf16 on a CPU with AVX512-BF16: a second copy of every linear weight in the
        layout of the native small-batch kernel (kernels/csrc/cpu_gemv.cpp), used for steps
        of at most ``limit`` tokens. It streams the weights at ~29 GB/s where oneDNN's GEMM
        reaches ~17 (30 SmolLM2 layers: M=1 12.2 -> 7.4 ms, M=64 41 -> 38 ms); oneDNN keeps
        the larger steps (M=512: 270 vs 275 ms). Costs the weights' size in memory again;
        ``limit`` 0 turns it off."""
        self.small_max, self.lm_head_s = 0, None
        for layer in self.layers:
            layer.qkv_s = layer.o_s = layer.gate_up_s = layer.down_s = None
        if not (limit > 0 and self.native is not None and self.dtype == torch.bfloat16
                and self.native.small_batch_supported()):
            return
        pack = self.native.pack_small_batch
        for layer in self.layers:
            layer.qkv_s, layer.o_s = pack(layer.qkv), pack(layer.o)
            layer.gate_up_s, layer.down_s = pack(layer.gate_up), pack(layer.down)
        self.lm_head_s = pack(self.lm_head)
        self.small_max = min(limit, self.native.SMALL_BATCH_MAX)

    def _lin(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
             small: torch.Tensor | None) -> torch.Tensor:
        if small is not None and x.shape[0] <= self.small_max:
            return self.native.small_batch_linear(x, small, b)
        return self._linear(x, w, b)

    def _pack(self) -> None:
        """Reorder every linear weight once into oneDNN's blocked layout, so no GEMM
        repacks it per call. Measured on 2 cores (bf16, 3072x576): M=1 0.098 -> 0.047 ms,
        M=64 0.59 -> 0.52, M=512 4.42 -> 4.23; the 49k-row lm_head at M=1 3.3 -> 1.75 ms.
        Results are bit-identical in bf16 (fp32 within 1e-6). The embedding keeps its
        plain copy for lookups; a tied lm_head gets its own packed one."""
        pack = lambda w: torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT)  # noqa: E731
        for layer in self.layers:
            layer.qkv, layer.o = pack(layer.qkv), pack(layer.o)
            layer.gate_up, layer.down = pack(layer.gate_up), pack(layer.down)
        self.lm_head = pack(self.lm_head)
        self._linear = _packed_linear

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """Allocate a paged KV cache that fits this model, in its dtype and device."""
        need = getattr(self.backend, "block_size", None)
        if need is not None and block_size != need:
            raise ValueError(f"the {self.backend.name} backend was built for KV blocks of "
                             f"{need} tokens, not {block_size}")
        s = self.spec
        return KVCache.allocate(s.num_layers, num_blocks, block_size, s.num_kv_heads,
                                s.head_dim, self.dtype, self.device)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return weight * x32.to(self.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                meta: AttentionMetadata, logits_indices: torch.Tensor,
                logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step over ``T`` flat tokens and return float32 logits ``[S, vocab]``
        for the rows ``logits_indices`` (e.g. each sequence's last new token).

        ``input_ids`` and ``positions`` are ``[T]`` long tensors laid out as in ``meta``;
        new keys/values are written to ``kv`` at ``meta.slot_mapping``. With
        ``logits_out`` (float32 ``[S, vocab]``, e.g. a CUDA graph's static output) the logits
        are written there and it is returned. With no ``logits_indices`` the step only
        fills the KV cache: the lm_head is skipped and the result is empty ``[0, vocab]``.

        No host syncs and no branching on tensor values, so with a graph-safe backend and
        :meth:`AttentionMetadata.for_decode_buffers` a call can be captured in a CUDA graph.
        """
        s = self.spec
        n_q = s.num_heads * s.head_dim
        rope = None if self.native is not None else (
            self.cos[positions].to(self.dtype)[:, None, :],
            self.sin[positions].to(self.dtype)[:, None, :])
        h, x = self._add_norm(F.embedding(input_ids, self.embed), None, self.layers[0].attn_norm)
        for i, layer in enumerate(self.layers):
            q, k, v = self._split_qkv(self._lin(x, layer.qkv, layer.qkv_bias, layer.qkv_s),
                                      positions, rope)
            k_cache, v_cache = kv.key(i), kv.value(i)
            self.backend.write_kv(k_cache, v_cache, k, v, meta)
            attn = self.backend.paged_attention(q, k_cache, v_cache, meta, self.scale)
            h, x = self._add_norm(h, self._lin(attn.reshape(-1, n_q), layer.o, None, layer.o_s),
                                  layer.mlp_norm)
            gate_up = self._lin(x, layer.gate_up, None, layer.gate_up_s)
            down = self._lin(self._silu_mul(gate_up), layer.down, None, layer.down_s)
            following = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else None
            h, x = self._add_norm(h, down, following)
        if logits_indices.numel() == 0:
            # no row samples (a step of middle prefill chunks): the layers wrote the KV,
            # which is all such a step is for; skip the final norm and lm_head (a shape
            # test, not a value one, so a captured graph is unaffected)
            if logits_out is not None:
                return logits_out[:0]
            return torch.empty(0, s.vocab_size, dtype=torch.float32, device=self.device)
        _, x = self._add_norm(h[logits_indices].contiguous(), None, self.norm)
        logits = self._lin(x, self.lm_head, None, self.lm_head_s)
        if logits_out is not None:
            return logits_out.copy_(logits)
        return logits.float()

    _linear = staticmethod(F.linear)

    # The elementwise steps, each in two forms: the CPU's fused native ops
    # (kernels/csrc/cpu_fused.cpp: one pass per row instead of ~30 torch ops per layer), or
    # torch (GPU, graph-capturable; and the CPU without a compiler).

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream ``h + delta`` (``delta`` None: ``h``) and its RMSNorm
        scaled by ``weight`` (None: skipped). The native form updates ``h`` in place."""
        if self.native is None:
            if delta is not None:
                h = h + delta
            return h, None if weight is None else self._rms_norm(h, weight)
        if weight is None:
            h += delta
            return h, None
        x = torch.empty_like(h)
        self.native.add_rms_norm(h, delta, weight, x, self.spec.rms_norm_eps)
        return h, x

    def _split_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rope) -> tuple:
        """q, k, v views of the fused projection rows, with RoPE applied to q and k."""
        s = self.spec
        n_q, n_kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q, k = qkv[:, :n_q], qkv[:, n_q:n_q + n_kv]
        v = qkv[:, n_q + n_kv:].view(-1, s.num_kv_heads, s.head_dim)
        if self.native is None:
            cos, sin = rope
            return (self._rope(q.view(-1, s.num_heads, s.head_dim), cos, sin),
                    self._rope(k.view(-1, s.num_kv_heads, s.head_dim), cos, sin), v)
        self.native.rope_(qkv, s.num_heads + s.num_kv_heads, s.head_dim, positions, self.cos,
                          self.sin)
        return (q.contiguous().view(-1, s.num_heads, s.head_dim),
                k.view(-1, s.num_kv_heads, s.head_dim), v)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    __call__ = forward
