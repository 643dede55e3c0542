"""Llama-family decoder over a flat batch of tokens from many sequences (selective batching).

Linear layers, norms and RoPE run on the flat ``[T, hidden]`` tensor; only attention
looks at sequence boundaries, through the paged-attention backend and its metadata.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from components.executor.elementwise import ElementwiseOps, fused_ops
from components.executor.linear import (
    GREEDY_HEAD,
    RUN,
    SILU_FUSED,
    Linear,
    StepMode,
    amx_linear_f32,
)
from kernels import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    cpu_forward,
    cpu_linear,
    cpu_native,
    get_backend,
    native_lib,
)
from kernels.tuning import KernelPlan

if TYPE_CHECKING:  # only needs the spec's attributes: no msgspec at run time (scripts/gpu_check)
    from schemas.model import ModelSpec


class _Layer:
    __slots__ = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")


class LlamaModel:
    """Inference-only Llama/Qwen2-style model built from :func:`loader.load_model` output.

    Weights are converted to ``dtype`` on ``device``; Q/K/V and gate/up are fused.
    Norms and RoPE tables are computed in float32; logits are returned as float32.
    ``kv_block_size`` (the KV cache's block size, when known) lets the backend choice see
    it: flash-attn needs blocks of a multiple of 256 tokens, so ``"auto"`` only picks it
    when told the size.

    Which kernel runs each linear layer (by step size), the elementwise ops, argmax and
    attention is the ``plan``, made before the model, on this machine, by
    :func:`components.executor.autotune.plan_kernels` (``build.build_model`` plans, then
    builds). Given a name, ``backend`` is resolved here: on the CPU to the plan's
    ``attention``, elsewhere to the name itself.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], *,
                 plan: KernelPlan, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", backend: AttentionBackend | str = "auto",
                 kv_block_size: int | None = None, kv_dtype: torch.dtype | None = None):
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)
        self.kv_dtype = kv_dtype or dtype
        self.plan = plan
        if isinstance(backend, str):
            name = plan.attention if self.device.type == "cpu" else backend
            backend = get_backend(name, self.device, block_size=kv_block_size, dtype=dtype,
                                  kv_dtype=self.kv_dtype)
        self.backend = backend
        self._new_kv = getattr(backend, "takes_new_kv", False)
        self._invariant_attention = getattr(backend, "name", "") in ("cpu", "triton")
        if hasattr(backend, "fresh_prompts"):     # (an fp8 cache: every row reads it)
            backend.fresh_prompts = plan.fresh_prompts if self.kv_dtype == dtype else "native"
        if hasattr(backend, "tiles"):
            backend.tiles = plan.attention_tiles
            backend.invariant_tiles = plan.invariant_tiles
        self.native = cpu_native if plan.elementwise == "native" else None
        self.ops = ElementwiseOps(spec, dtype, self.device, fused_ops(plan.elementwise))
        # RoPE and the KV write as one launch (attention_input): Triton's elementwise ops
        # beside the Triton backend, whose write_kv it replaces
        self.rope_kv = hasattr(self.ops.fused, "rope_write_kv") \
            and getattr(backend, "name", "") == "triton" and not self._new_kv
        # ... and the CPU's native ops beside the cpu backend (rope_write_kv_: in place)
        self.native_rope_kv = self.native is not None and getattr(backend, "name", "") == "cpu"
        self.runs = dict(RUN)
        self.runs["amx+silu"] = cpu_linear.amx_silu_mul_linear   # gate_up fused (Linear)
        self.runs["amx+f32"] = amx_linear_f32                     # float32 logits (Linear)
        self.runs["amx+argmax"] = cpu_linear.amx_argmax_linear    # greedy tokens (Linear)
        for cand, run in SILU_FUSED.items():                      # SiLU x up in the epilogue
            self.runs[cand + "+silu"] = run
        put = lambda t: t.to(device=self.device, dtype=dtype).contiguous()
        # a deterministic step (forward(deterministic=True)) runs each linear layer by its
        # invariant kernel, attention by the invariant paged kernel
        self.mode = StepMode()
        inv = plan.invariant_linear
        lin = lambda role, w, b=None: Linear(w, plan.linear[role], self.runs, b,
                                             invariant=inv.get(role), mode=self.mode)
        self.embed = put(weights["embed"])
        tied = spec.tie_word_embeddings or weights["lm_head"] is weights["embed"]
        self.lm_head = Linear(self.embed if tied else put(weights["lm_head"]),
                              plan.linear["lm_head"], self.runs,
                              greedy_table=plan.linear.get(GREEDY_HEAD),
                              invariant=inv.get("lm_head"), mode=self.mode)
        self.norm = put(weights["norm"])
        self.layers: list[_Layer] = []
        for i in range(spec.num_layers):
            w = lambda name, i=i: weights[f"layers.{i}.{name}"]
            layer = _Layer()
            layer.attn_norm, layer.mlp_norm = put(w("attn_norm")), put(w("mlp_norm"))
            biases = [weights.get(f"layers.{i}.{n}_bias") for n in "qkv"]
            qkv_bias = None
            if any(b is not None for b in biases):
                sizes = [w(n).shape[0] for n in "qkv"]
                qkv_bias = put(torch.cat([b if b is not None else torch.zeros(s)
                                          for b, s in zip(biases, sizes)]))
            layer.qkv = lin("qkv", put(torch.cat([w("q"), w("k"), w("v")])), qkv_bias)
            layer.o = lin("o", put(w("o")))
            layer.gate_up = lin("gate_up", put(torch.cat([w("gate"), w("up")])))
            layer.down = lin("down", put(w("down")))
            self.layers.append(layer)
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        self._native_args: dict[tuple, object] = {}     # LayerArgs arrays by picks and cache
        # float64 [len(cpu_forward.LAYER_PARTS)]: where the native layer loop adds each
        # part's seconds (a profiler sets it; None: not timed)
        self.layer_seconds: torch.Tensor | None = None

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """Allocate a paged KV cache that fits this model, in its KV dtype (the model's,
        or fp8) and on its device."""
        need = getattr(self.backend, "block_size", None)
        if need is not None and block_size != need:
            raise ValueError(f"the {self.backend.name} backend was built for KV blocks of "
                             f"{need} tokens, not {block_size}")
        s = self.spec
        return KVCache.allocate(s.num_layers, num_blocks, block_size, s.num_kv_heads,
                                s.head_dim, self.kv_dtype, self.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                meta: AttentionMetadata, logits_indices: torch.Tensor,
                logits_out: torch.Tensor | None = None, greedy: bool = False,
                deterministic: bool = False) -> torch.Tensor:
        """Run one step over ``T`` flat tokens and return float32 logits ``[S, vocab]``
        for the rows ``logits_indices`` (e.g. each sequence's last new token).

        ``input_ids`` and ``positions`` are ``[T]`` long tensors laid out as in ``meta``;
        new keys/values are written to ``kv`` at ``meta.slot_mapping``. With
        ``logits_out`` (float32 ``[S, vocab]``, e.g. a CUDA graph's static output) the logits
        are written there and it is returned. ``greedy``: each row's greedy token instead,
        ``[S]`` long, the first maximum of its logits (on the AMX tiles without writing
        them: :meth:`Linear.argmax`). With no ``logits_indices`` the step only
        fills the KV cache: the lm_head is skipped and the result is empty ``[0, vocab]``.

        No host syncs and no branching on tensor values, so with a graph-safe backend and
        :meth:`AttentionMetadata.for_decode_buffers` a call can be captured in a CUDA graph.

        ``deterministic``: every kernel computes each row in an order that depends on the
        row alone (components/executor/determinism.py): its logits and KV are the same
        whatever the rest of the step is, and however its sequence was chunked.
        """
        self.mode.invariant = deterministic
        try:
            return self._forward(input_ids, positions, kv, meta, logits_indices, logits_out,
                                 greedy, deterministic)
        finally:
            self.mode.invariant = False

    __call__ = forward

    def _forward(self, input_ids, positions, kv, meta, logits_indices, logits_out, greedy,
                 invariant: bool) -> torch.Tensor:
        ops = self.ops
        rope = ops.rope_tables(positions)
        h, x = ops.add_norm(F.embedding(input_ids, self.embed), None, self.layers[0].attn_norm)
        layers = self._native_layers(input_ids.shape[0], kv, meta, invariant)
        if layers is not None:
            down = self._run_native_layers(layers, h, x, kv, positions, meta, invariant)
        else:
            for i, layer in enumerate(self.layers):
                k_cache, v_cache = kv.key(i), kv.value(i)
                if self.rope_kv:
                    q = self.attention_input(i, x, positions, kv, meta.slot_mapping)
                    attn = self.backend.paged_attention(q, k_cache, v_cache, meta, self.scale,
                                                        **self._invariant_kw(invariant))
                    h, x = self.mlp(i, h, attn, defer_last=True)
                    continue
                if self.native_rope_kv:
                    q, k, v = ops.split_qkv(layer.qkv(x), positions, rope,
                                            kv=(k_cache, v_cache, meta.slot_mapping))
                else:
                    q, k, v = ops.split_qkv(layer.qkv(x), positions, rope)
                    self.backend.write_kv(k_cache, v_cache, k, v, meta)
                attn = self.backend.paged_attention(q, k_cache, v_cache, meta, self.scale,
                                                    new_kv=(k, v), invariant=invariant) \
                    if self._new_kv else \
                    self.backend.paged_attention(q, k_cache, v_cache, meta, self.scale,
                                                 **self._invariant_kw(invariant))
                h, x = self.mlp(i, h, attn, defer_last=True)
            down = x
        # (the last layer's down projection: head adds the sampled rows' only)
        return self.head(h, logits_indices, logits_out, greedy, down)

    def _invariant_kw(self, invariant: bool) -> dict[str, bool]:
        """The backend's argument for a deterministic step, where it has an invariant form
        (the cpu and Triton backends; the torch reference computes each sequence on its
        own and takes none)."""
        return {"invariant": True} if invariant and self._invariant_attention else {}

    def attention_input(self, i: int, x: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                        slots: torch.Tensor, q_out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer ``i``'s queries ``[T, heads, head_dim]`` from its normed input ``x``: the
        qkv projection, then RoPE and the KV write at ``slots`` in one Triton launch
        (:func:`kernels.triton_fused.rope_write_kv`; ``rope_kv`` must hold). ``q_out``: where
        the queries go (a CUDA graph's static buffer)."""
        s = self.spec
        return self.ops.fused.rope_write_kv(
            self.layers[i].qkv(x), s.num_heads, s.num_kv_heads, s.head_dim, positions,
            self.ops.cos, self.ops.sin, kv.key(i), kv.value(i), slots, q_out)

    def mlp(self, i: int, h: torch.Tensor, attn: torch.Tensor, defer_last: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rest of layer ``i`` after attention: the o projection into the residual
        stream ``h``, the MLP, and the next layer's normed input (None after the last
        layer). Returns ``(h, x)``; the fused ops update ``h`` in place. ``defer_last``:
        after the last layer, ``x`` is its down projection, not added to ``h`` (for
        :meth:`head`, which adds only the sampled rows': a prefill step samples one row
        of each sequence, and the full add was a pass over every row, 3 ms of an
        8,192-token step)."""
        ops, layer = self.ops, self.layers[i]
        n_q = self.spec.num_heads * self.spec.head_dim
        h, x = ops.add_norm(h, layer.o(attn.reshape(-1, n_q)), layer.mlp_norm)
        down = layer.down(layer.gate_up.silu_mul(x, ops))
        following = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else None
        if following is None and defer_last:
            return h, down
        return ops.add_norm(h, down, following)

    def head(self, h: torch.Tensor, logits_indices: torch.Tensor,
             logits_out: torch.Tensor | None = None, greedy: bool = False,
             down: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm and the lm_head on the rows ``logits_indices`` of the residual
        stream ``h`` (plus the last layer's ``down`` projection where not yet added): what
        :meth:`forward` returns."""
        s, ops = self.spec, self.ops
        if logits_indices.numel() == 0:
            # no row samples (a step of middle prefill chunks): the layers wrote the KV,
            # which is all such a step is for; skip the final norm and lm_head (a shape
            # test, not a value one, so a captured graph is unaffected)
            if logits_out is not None:
                return logits_out[:0]
            if greedy:
                return torch.empty(0, dtype=torch.long, device=self.device)
            return torch.empty(0, s.vocab_size, dtype=torch.float32, device=self.device)
        rows = h[logits_indices] if down is None else h[logits_indices] + down[logits_indices]
        _, x = ops.add_norm(rows.contiguous(), None, self.norm)
        if greedy:
            return self.lm_head.argmax(x, self.plan.sampling == "native")
        if logits_out is not None:
            return logits_out.copy_(self.lm_head(x))
        return self.lm_head.float32(x)

    def _native_layers(self, rows: int, kv: KVCache, meta: AttentionMetadata,
                       invariant: bool = False):
        """The decoder layers as one native call (``cpu_forward.LayerArgs`` for every layer)
        where this step would run each of their parts on the native CPU kernels anyway:
        the plan's ``layer_loop`` is "native", the elementwise ops are native, attention is
        the cpu backend's paged kernel for every row (no fresh prompt through SDPA), and
        every linear layer's candidate at ``rows`` is the vector or AMX small-batch kernel.
        None: the Python loop runs the step."""
        if self.plan.layer_loop != "native" or self.native is None \
                or getattr(self.backend, "name", "") != "cpu" or meta.token_seq is None \
                or self.dtype not in (torch.bfloat16, torch.float32) or not kv.data.is_contiguous():
            return None
        s = self.spec
        if not cpu_native.supports(s.num_heads, s.num_kv_heads, s.head_dim) \
                or meta.slot_mapping.dtype != torch.long:
            return None
        if not invariant and not self.backend.paged_only(meta):
            return None
        first = self.layers[0]
        picks = tuple(getattr(first, r).pick(rows)[0] for r in ("qkv", "o", "gate_up", "down"))
        if any(p not in cpu_forward.LINEAR_KINDS for p in picks) \
                or ("amx" in picks and self.dtype != torch.bfloat16):
            return None
        key = (picks, kv.data.data_ptr(), kv.data.shape)
        args = self._native_args.get(key)
        if args is None:
            args = (cpu_forward.LayerArgs * len(self.layers))()
            for i, layer in enumerate(self.layers):
                lin = {r: cpu_forward.linear_args(getattr(layer, r).pick(rows)[1], p,
                                                 getattr(layer, r).bias)
                       for r, p in zip(("qkv", "o", "gate_up", "down"), picks)}
                nxt = self.layers[i + 1].attn_norm.data_ptr() if i + 1 < len(self.layers) \
                    else None
                args[i] = cpu_forward.LayerArgs(lin["qkv"], lin["o"], lin["gate_up"],
                                               lin["down"], layer.mlp_norm.data_ptr(), nxt,
                                               kv.key(i).data_ptr(), kv.value(i).data_ptr())
            if len(self._native_args) >= 8:    # a new cache or plan buckets: a handful
                self._native_args.clear()
            self._native_args[key] = args
        return args

    def _run_native_layers(self, layers, h: torch.Tensor, x: torch.Tensor, kv: KVCache,
                           positions: torch.Tensor, meta: AttentionMetadata,
                           invariant: bool = False) -> torch.Tensor:
        """Run ``layers`` over the residual stream ``h`` (in place) from the first layer's
        normed input ``x``; returns the last layer's down projection (head adds its sampled
        rows')."""
        s, rows = self.spec, h.shape[0]
        n_q, n_kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        inter = s.intermediate_size
        qkv = h.new_empty(rows, n_q + 2 * n_kv)
        attn = h.new_empty(rows, n_q)
        gate_up = h.new_empty(rows, 2 * inter)    # untouched where SiLU x up is fused in
        act = h.new_empty(rows, inter)
        delta = torch.empty_like(h)
        seqs, row_lens, tables = cpu_native.kernel_rows(meta)
        pos, slots = positions.contiguous(), meta.slot_mapping.contiguous()
        block_size = kv.block_size
        tiles = self.plan.invariant_tiles if invariant else self.backend.tiles
        amx = tiles == "amx" and self.dtype == torch.bfloat16 and block_size % 16 == 0
        step = cpu_forward.StepArgs(
            dtype=0 if self.dtype == torch.float32 else 1, threads=torch.get_num_threads(),
            rows=rows, hidden=s.hidden_size, heads=s.num_heads, kv_heads=s.num_kv_heads,
            head_dim=s.head_dim, inter=inter, h=h.data_ptr(), x=x.data_ptr(),
            qkv=qkv.data_ptr(), attn=attn.data_ptr(), gate_up=gate_up.data_ptr(),
            act=act.data_ptr(), delta=delta.data_ptr(), positions=pos.data_ptr(),
            cos=self.ops.cos.data_ptr(), sin=self.ops.sin.data_ptr(), slots=slots.data_ptr(),
            seqs=seqs.data_ptr(), row_lens=row_lens.data_ptr(), tables=tables.data_ptr(),
            table_width=tables.shape[1], block_size=block_size, scale=self.scale,
            eps=s.rms_norm_eps, amx_attention=cpu_native.attention_mode(amx, invariant),
            kv_dtype=native_lib.KV_DTYPES[kv.dtype],
            seconds=None if self.layer_seconds is None else self.layer_seconds.data_ptr())
        cpu_forward.forward_layers(layers, step)
        return delta
