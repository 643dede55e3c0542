"""CUDA graphs for prefill and mixed steps: the dense parts captured piecewise, per bucket of
token counts, with attention run eagerly between the pieces.

A step of ``T`` flat tokens (prefill chunks, decode rows, speculative verify rows, in any
mix) has ``T``-shaped dense work (embedding, norms, the qkv/o/gate_up/down linears, SiLU x
up, RoPE and the KV write) and attention whose launch depends on the step's sequences.
Eagerly that is ~15 Triton/cuBLAS launches a layer at 35-60 us of host time each, so a
small model's prefill step costs 12-22 ms whatever its size. Here the dense parts replay as
graphs and attention is one launch a layer.

Design:

- Buckets: 16, 32, 64, 128, 256, then every 256 up to ``max_tokens`` (the scheduler's step
  budget; 2048 gives 12 buckets), or a given list. A step of ``T`` tokens runs in the
  smallest bucket ``>= T``; past the largest it runs eagerly.
- Pieces: ``L + 1`` graphs a bucket for ``L`` layers. Piece 0: the embedding, layer 0's
  input norm, its qkv projection, and RoPE + the KV write (one kernel,
  :func:`kernels.triton_fused.rope_write_kv`). Piece ``i`` (1..L-1): the rest of layer
  ``i - 1`` (o projection, add+norm, gate_up, SiLU x up, down, add+norm) then layer ``i``'s
  qkv and RoPE + KV write. Piece ``L``: the rest of the last layer. Between pieces ``i``
  and ``i + 1`` layer ``i``'s attention runs eagerly over the step's own metadata; after
  the last, the head (final norm and lm_head on the sampled rows, whose number varies)
  runs eagerly as :meth:`LlamaModel.head`.
- Why attention is not captured: the Triton prefill kernel's grid is (sequences, query
  tiles of the longest chunk, heads) and it reads per-sequence starts and block tables. A
  static grid would be ``max_num_seqs x B / 16 x heads`` programs (256 x 128 x 9 at B =
  2048), nearly all idle, and static tables of ``max_num_seqs x max_blocks``, to save one
  launch a layer. vLLM splits its graphs at attention for the same reason.
- Static buffers, shared by every bucket and sized for the largest (``M`` rows): input ids,
  positions and KV slots ``[3, M]`` long; the residual stream ``[M, hidden]``; the rotated
  queries and the attention output, ``[M, heads, head_dim]`` each. The pieces read and write
  these in place (the fused add+RMSNorm updates the residual in place); everything else a
  piece makes is dead when it ends and lives in the graphs' one shared pool, so the pool
  holds about one piece's intermediates at ``M`` rows: ``M x (3 hidden + qkv + 3 inter)``
  elements (SmolLM2-135M bf16 at 2048: ~30 MB; Llama-1B: ~140 MB), plus the static
  buffers (``M x (hidden + 2 heads x head_dim)`` elements: 7 MB and 25 MB).
- Padding rows ``T .. B``: token 0 at position 0, slot ``-1``: the RoPE + KV kernel stores
  nothing for them, attention's metadata covers only the ``T`` real rows, and every other op
  works row by row, so no padding row reaches a real one or the cache.
- Capture: largest bucket first; per bucket one eager warm-up of every piece on the capture
  stream (on padding rows: no KV written), then each piece under ``torch.cuda.graph`` into
  the shared pool. Replays run one step at a time, pieces in their captured order.
- Without CUDA (or ``use_graphs=False``) the same pieces run eagerly from the static
  buffers, so bucketing, padding and the pieces' buffer use are checked on the CPU (Triton
  under TRITON_INTERPRET=1).

Needs the model's fused RoPE + KV write (``model.rope_kv``: Triton's elementwise ops and the
Triton attention backend). Decode-only steps keep :class:`~components.executor.cuda_graphs.
DecodeGraphs` (one graph a step, attention inside).
"""
from __future__ import annotations

import gc
import time

import torch

from kernels import AttentionMetadata, KVCache

_ID, _POS, _SLOT = 0, 1, 2


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, 256, then multiples of 256 up to ``max_tokens`` (always the last)."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    sizes = [b for b in (16, 32, 64, 128, 256) if b < max_tokens]
    return sorted(set(sizes + list(range(512, max_tokens, 256)) + [max_tokens]))


class PiecewiseGraphs:
    """Captured dense pieces of prefill and mixed steps for one model and KV cache (see the
    module docstring). :meth:`forward` takes :meth:`LlamaModel.forward`'s arguments."""

    def __init__(self, model, kv: KVCache, max_tokens: int = 2048,
                 buckets: list[int] | tuple[int, ...] | None = None,
                 use_graphs: bool | None = None):
        if not getattr(model, "rope_kv", False):
            raise ValueError("piecewise graphs need the fused RoPE + KV write (Triton's "
                             "elementwise ops and the triton attention backend)")
        self.model, self.kv = model, kv
        self.device = kv.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.buckets = sorted(set(buckets)) if buckets else token_buckets(max_tokens)
        if self.buckets[0] < 1:
            raise ValueError("token buckets must be >= 1")
        self.max_tokens = m = self.buckets[-1]
        s, dev = model.spec, self.device
        self._pad = torch.zeros(3, m, dtype=torch.long, device=dev)
        self._pad[_SLOT] = -1
        self._inputs = self._pad.clone()
        self._h = torch.zeros(m, s.hidden_size, dtype=model.dtype, device=dev)
        self._q = torch.zeros(m, s.num_heads, s.head_dim, dtype=model.dtype, device=dev)
        self._attn = torch.zeros_like(self._q)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    @property
    def num_pieces(self) -> int:
        return len(self.model.layers) + 1

    def bucket_for(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def fits(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` flat tokens runs here (captured, on CUDA)."""
        return 1 <= num_tokens <= self.max_tokens and (not self.use_graphs or bool(self.graphs))

    def _piece(self, b: int, i: int) -> None:
        """Piece ``i`` of bucket ``b``: static rows ``[:b]`` in, static rows out."""
        m = self.model
        h = self._h[:b]
        if i == 0:
            torch.index_select(m.embed, 0, self._inputs[_ID, :b], out=h)
            _, x = m.ops.add_norm(h, None, m.layers[0].attn_norm)
        else:
            _, x = m.mlp(i - 1, h, self._attn[:b])
        if i < len(m.layers):
            m.attention_input(i, x, self._inputs[_POS, :b], self.kv, self._inputs[_SLOT, :b],
                              q_out=self._q[:b])

    def _run(self, b: int, i: int) -> None:
        if self.use_graphs:
            self.graphs[b][i].replay()
        else:
            self._piece(b, i)

    def static_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self._pad, self._inputs, self._h, self._q, self._attn))

    @torch.inference_mode()
    def capture(self) -> dict:
        """Capture every bucket's pieces (largest first, one shared pool). Returns what to
        log: buckets, pieces a bucket, seconds, the device memory the graphs took
        (allocated and reserved deltas) and the static buffers' bytes."""
        info = {"buckets": [], "pieces": self.num_pieces, "seconds": 0.0,
                "pool_allocated_bytes": 0, "pool_reserved_bytes": 0,
                "static_bytes": self.static_bytes()}
        if not self.use_graphs:
            return info
        dev = self.device
        self._inputs.copy_(self._pad)  # warm-ups run on padding rows: they write no KV
        torch.cuda.synchronize(dev)
        gc.collect()
        torch.cuda.empty_cache()  # so the reserved delta is the graphs' pool alone
        alloc0, reserved0 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(dev)
        pool = None
        for b in sorted(self.buckets, reverse=True):
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for i in range(self.num_pieces):
                    self._piece(b, i)  # warm-up: Triton JIT, cuBLAS workspaces
            torch.cuda.current_stream(dev).wait_stream(stream)
            pieces = []
            for i in range(self.num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._piece(b, i)
                pool = graph.pool() if pool is None else pool
                pieces.append(graph)
            self.graphs[b] = pieces
        torch.cuda.synchronize(dev)
        info.update(buckets=sorted(self.graphs), seconds=round(time.perf_counter() - t0, 3),
                    pool_allocated_bytes=torch.cuda.memory_allocated(dev) - alloc0,
                    pool_reserved_bytes=torch.cuda.memory_reserved(dev) - reserved0)
        return info

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                meta: AttentionMetadata, logits_indices: torch.Tensor,
                logits_out: torch.Tensor | None = None, greedy: bool = False) -> torch.Tensor:
        """:meth:`LlamaModel.forward` for a step of ``T = len(input_ids)`` tokens (``fits``
        must hold): the dense pieces of its bucket replayed, attention eager between them
        over ``meta``, then the head. ``kv`` must be the cache the pieces were built on."""
        if kv.data.data_ptr() != self.kv.data.data_ptr():
            raise ValueError("piecewise graphs write the KV cache they were built on")
        t = input_ids.shape[0]
        b = self.bucket_for(t)
        st = self._inputs
        st[_ID, :t].copy_(input_ids, non_blocking=True)
        st[_POS, :t].copy_(positions, non_blocking=True)
        st[_SLOT, :t].copy_(meta.slot_mapping, non_blocking=True)
        if b > t:
            st[:, t:b].copy_(self._pad[:, t:b])
        m = self.model
        self._run(b, 0)
        for i in range(len(m.layers)):
            m.backend.paged_attention(self._q[:t], kv.key(i), kv.value(i), meta, m.scale,
                                      out=self._attn[:t])
            self._run(b, i + 1)
        return m.head(self._h[:t], logits_indices, logits_out, greedy)
