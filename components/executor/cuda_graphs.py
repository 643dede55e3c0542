"""CUDA graphs for decode-only steps: one captured forward per batch-size bucket.

A decode step (one new token per sequence) has the same shapes whenever the number of
sequences is the same, so its whole forward (about fifteen kernels per layer) is captured
once per *bucket* of batch sizes and then replayed with one launch.

Design:

- Buckets: 1, 2, 4, 8, then every 8 up to ``max_batch`` (default 256; pass the scheduler's
  ``max_num_seqs`` when smaller). A batch of ``n`` runs in the smallest bucket ``>= n``.
- Static inputs: one int32 staging buffer ``[max_batch, 4 + max_blocks]`` on the device
  holding, per row, token id, position, KV slot, sequence length and the block table padded
  to ``max_blocks = ceil(max_model_len / block_size)``. Each replay fills a pinned host twin
  and copies it with *one* H2D copy; the captured graph unpacks it (long casts, contiguous
  ``seq_lens``) and runs ``LlamaModel.forward`` on :meth:`AttentionMetadata.for_decode_buffers`.
  Logits are written to one static float32 ``[max_batch, vocab]`` buffer shared by all
  buckets (``forward(logits_out=...)``).
- Padding rows (``n .. bucket``): token 0, position 0, slot ``-1`` (the KV write skips it, so
  no real block is touched), sequence length 1 over block 0 (a harmless read); their logits
  are never returned.
- Kernels must be capture-safe: no host syncs, grids fixed per bucket. The Triton decode
  kernel sizes its partitions from ``max_model_len`` (the metadata's upper-bound context
  lengths) and masks by the device ``seq_lens``; flash-attn's ``flash_attn_with_kvcache``
  reads ``cache_seqlens``/``block_table`` from the same buffers. The backend must say
  ``graph_safe = True`` (triton, flash_attn); the torch reference is not.
- Capture: per bucket, largest first, one eager warm-up on the capture stream (Triton JIT,
  cuBLAS workspaces), then ``torch.cuda.graph(g, pool=shared, stream=capture_stream)``. All
  graphs share one memory pool; this is safe because they are replayed one at a time on one
  stream and hold no live tensors in the pool (inputs and logits live outside it).
- Without CUDA (or ``use_graphs=False``) the same static-buffer forward runs eagerly, so
  the padding and packing logic is checked on the CPU (Triton under TRITON_INTERPRET=1).

Integration (runner/service)::

    # startup, after the model and KV cache exist (GPU, backend graph_safe):
    graphs = DecodeGraphs(model, kv, max_model_len=eng.max_model_len,
                          max_batch=min(256, sched.max_num_seqs))
    info = graphs.capture()        # {"buckets", "seconds", "pool_reserved_bytes", ...}
    log.info("cuda_graphs_captured", **info)

    # per step, when every scheduled sequence has num_tokens == 1:
    if graphs.can_replay(len(seqs), max(s.num_computed + 1 for s in seqs)):
        logits = graphs.replay(input_ids, positions, block_tables, rows)
    else:
        ...eager forward as today...

``input_ids[i]`` is the new token of sequence ``i``, ``positions[i]`` its position (=
``num_computed``), ``block_tables[i]`` its block ids (extra lookahead blocks are fine),
``rows`` the indices of the sequences to sample (None = all). The returned logits are float32
``[len(rows), vocab]``; with ``rows=None`` they are a view of the static output buffer, valid
until the next replay.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from kernels import AttentionMetadata, KVCache

_ID, _POS, _SLOT, _LEN, _TABLE = 0, 1, 2, 3, 4


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to ``max_batch`` (which is always the last)."""
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    """Captured decode steps for one model and KV cache (see the module docstring)."""

    def __init__(self, model, kv: KVCache, max_model_len: int, max_batch: int = 256,
                 use_graphs: bool | None = None):
        if not getattr(model.backend, "graph_safe", False):
            raise ValueError(f"attention backend {model.backend.name!r} cannot run decode "
                             "from static buffers (use triton or flash_attn)")
        self.model, self.kv = model, kv
        self.device = kv.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.block_size = kv.block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // self.block_size)
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        width = _TABLE + self.max_blocks
        pin = self.device.type == "cuda"
        self._host = torch.zeros(self.max_batch, width, dtype=torch.int32, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._pad(0, self.max_batch)
        self._staging = self._host.to(self.device, copy=True)
        self._qsl = torch.arange(self.max_batch + 1, dtype=torch.int32, device=self.device)
        self._rows = torch.arange(self.max_batch, dtype=torch.long, device=self.device)
        self._logits = torch.zeros(self.max_batch, model.spec.vocab_size, dtype=torch.float32,
                                   device=self.device)
        self._copied = torch.cuda.Event() if pin else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def bucket_for(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def can_replay(self, num_seqs: int, max_context: int) -> bool:
        """Whether a decode step of ``num_seqs`` sequences, the longest holding
        ``max_context`` tokens after this step, fits the captured shapes."""
        return (1 <= num_seqs <= self.max_batch and max_context <= self.max_model_len
                and (not self.use_graphs or bool(self.graphs)))

    def _forward(self, b: int) -> torch.Tensor:
        """The captured region: unpack the staging rows ``[:b]`` and run the model."""
        st = self._staging[:b]
        positions = st[:, _POS].long()
        meta = AttentionMetadata.for_decode_buffers(
            positions=positions, slot_mapping=st[:, _SLOT].long(),
            seq_lens=st[:, _LEN].contiguous(), query_start_loc=self._qsl[:b + 1],
            block_tables=st[:, _TABLE:], block_size=self.block_size,
            max_seq_len=self.max_model_len)
        return self.model.forward(st[:, _ID].long(), positions, self.kv, meta,
                                  self._rows[:b], logits_out=self._logits[:b])

    def capture(self) -> dict:
        """Capture every bucket (largest first, one shared pool). Returns what to log:
        bucket sizes, seconds, and the device memory the graphs took (allocated and
        reserved deltas; the static buffers are counted separately)."""
        static = sum(t.numel() * t.element_size()
                     for t in (self._staging, self._qsl, self._rows, self._logits))
        if not self.use_graphs:
            return {"buckets": [], "seconds": 0.0, "pool_allocated_bytes": 0,
                    "pool_reserved_bytes": 0, "static_bytes": static}
        dev = self.device
        if self._copied is not None:
            self._copied.synchronize()
        self._pad(0, self.max_batch)  # warm-ups run on padding rows: they write no KV
        self._staging.copy_(self._host)
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
                self._forward(b)  # warm-up: Triton JIT, cuBLAS workspaces
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._forward(b)
            pool = graph.pool() if pool is None else pool
            self.graphs[b] = graph
        torch.cuda.synchronize(dev)
        return {"buckets": sorted(self.graphs), "seconds": round(time.perf_counter() - t0, 3),
                "pool_allocated_bytes": torch.cuda.memory_allocated(dev) - alloc0,
                "pool_reserved_bytes": torch.cuda.memory_reserved(dev) - reserved0,
                "static_bytes": static}

    def _fill(self, input_ids: Sequence[int], positions: Sequence[int],
              block_tables: Sequence[Sequence[int]], b: int) -> None:
        n = len(input_ids)
        if len(positions) != n or len(block_tables) != n:
            raise ValueError("input_ids, positions and block_tables differ in length")
        h = self._host_np
        pos = np.asarray(positions, dtype=np.int64)
        lens = np.fromiter((min(len(t), self.max_blocks) for t in block_tables), np.int64, n)
        if n and (pos.min() < 0 or (pos // self.block_size >= lens).any()
                  or pos.max() >= self.max_model_len):
            raise ValueError("a position is negative, past max_model_len or past its block table")
        h[:n, _ID] = np.asarray(input_ids, dtype=np.int32)
        h[:n, _POS] = pos
        h[:n, _LEN] = pos + 1
        table = h[:n, _TABLE:]
        table[np.arange(self.max_blocks) < lens[:, None]] = np.fromiter(
            chain.from_iterable(t[:self.max_blocks] for t in block_tables), np.int32,
            int(lens.sum()))
        h[:n, _SLOT] = table[np.arange(n), pos // self.block_size] * self.block_size \
            + pos % self.block_size
        self._pad(n, b)

    def _pad(self, start: int, stop: int) -> None:
        """Host rows ``start:stop`` become padding: token 0 at position 0, no KV write
        (slot -1), one key read from block 0."""
        h = self._host_np
        h[start:stop, [_ID, _POS, _TABLE]] = 0
        h[start:stop, _SLOT] = -1
        h[start:stop, _LEN] = 1

    def replay(self, input_ids: Sequence[int], positions: Sequence[int],
               block_tables: Sequence[Sequence[int]],
               rows: Sequence[int] | None = None) -> torch.Tensor:
        """Run one decode step for ``n = len(input_ids)`` sequences (``can_replay`` must
        hold) and return float32 logits for ``rows`` (default: all ``n``)."""
        n = len(input_ids)
        b = self.bucket_for(n)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's H2D copy has read the host rows
        self._fill(input_ids, positions, block_tables, b)
        self._staging[:b].copy_(self._host[:b], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if self.use_graphs:
            self.graphs[b].replay()
            logits = self._logits[:n]
        else:
            logits = self._forward(b)[:n]
        if rows is None:
            return logits
        return logits.index_select(0, torch.as_tensor(rows, dtype=torch.long).to(
            self.device, non_blocking=True))
