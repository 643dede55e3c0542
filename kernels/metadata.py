"""Per-step attention metadata, built once on the host and shared by every layer.

Token layout: the step's ``T`` new tokens are concatenated sequence by sequence, so
sequence ``i`` owns rows ``query_start_loc[i] : query_start_loc[i + 1]`` of the flat batch,
and its new tokens sit at positions ``context_lens[i] .. context_lens[i] + query_lens[i] - 1``.

Two constructors: :meth:`AttentionMetadata.build` computes everything for one step from
host lists; :meth:`AttentionMetadata.for_decode_buffers` wraps preallocated device buffers
(one query per sequence) without touching their contents, for CUDA-graph capture.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionGroup:
    """Sequences attended together as one padded batch (``b`` sequences, ``q`` padded
    query rows, ``l`` padded key rows each)."""

    token_rows: torch.Tensor    # [n] long: flat-batch rows of this group's real query tokens
    query_index: torch.Tensor   # [b, q] long: flat-batch row for each padded query (pads repeat)
    out_index: torch.Tensor     # [n] long: index into the [b * q] padded output, per token_rows
    kv_slots: torch.Tensor      # [b, l] long: cache slot of each key (pads: any valid slot)
    mask: torch.Tensor          # [b, 1, q, l] bool: True where the query may attend the key


@dataclass
class AttentionMetadata:
    """Everything the attention kernels need for one forward step."""

    num_tokens: int
    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    positions: torch.Tensor        # [T] long: absolute position of each new token
    slot_mapping: torch.Tensor     # [T] long: cache slot each new token's K/V is written to
    seq_lens: torch.Tensor         # [B] int32: context + query length per sequence
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    block_tables: torch.Tensor     # [B, max_blocks] int32, padded with 0
    token_seq: torch.Tensor | None = None   # [T] long: the sequence of each new token
    # per-step values a backend derives once and reuses in every layer (e.g. the native CPU
    # kernel's row lengths), keyed by the backend
    derived: dict = field(default_factory=dict, repr=False)
    _group_inputs: tuple | None = field(default=None, repr=False)
    _groups: list[AttentionGroup] | None = field(default=None, repr=False)

    @property
    def groups(self) -> list[AttentionGroup]:
        """Gather groups for the torch reference: decode rows (query len 1) and the rest,
        when present. Built on first use: the native CPU and GPU kernels read the block
        tables directly and never pay for them."""
        if self._groups is None:
            self._groups = [] if self._group_inputs is None else _groups(*self._group_inputs)
        return self._groups

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int],
              block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu") -> AttentionMetadata:
        """Precompute slot mapping, gather indices and masks for one step.

        ``context_lens[i]`` counts tokens of sequence ``i`` already in the cache before this
        step; ``block_tables[i]`` lists its blocks in order and must cover
        ``context_lens[i] + query_lens[i]`` tokens.
        """
        n = len(query_lens)
        if len(context_lens) != n or len(block_tables) != n:
            raise ValueError("query_lens, context_lens and block_tables differ in length")
        if any(q < 1 for q in query_lens) or any(c < 0 for c in context_lens):
            raise ValueError("query lengths must be >= 1 and context lengths >= 0")
        for i, (q, c, bt) in enumerate(zip(query_lens, context_lens, block_tables)):
            if len(bt) * block_size < q + c:
                raise ValueError(f"block table of sequence {i} is too short for {q + c} tokens")
        # numpy, then one torch view each: a handful of small-array ops at ~1 us, not ~10
        # (64 decode rows: 121 -> 55 us)
        q = np.asarray(query_lens, dtype=np.int64)
        c = np.asarray(context_lens, dtype=np.int64)
        width = max((len(bt) for bt in block_tables), default=0) or 1
        # padded in Python, one array: a row at a time was ~5 us a sequence (0.3 ms at 64)
        table = np.array([list(bt) + [0] * (width - len(bt)) for bt in block_tables],
                         dtype=np.int64).reshape(n, width)
        st = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q, out=st[1:])
        seq = np.repeat(np.arange(n), q)
        pos = c[seq] + np.arange(len(seq)) - st[seq]
        slots = table[seq, pos // block_size] * block_size + pos % block_size
        q_lens, ctx, starts = torch.from_numpy(q), torch.from_numpy(c), torch.from_numpy(st)
        seq_idx, positions, table_t = torch.from_numpy(seq), torch.from_numpy(pos), \
            torch.from_numpy(table)
        to = lambda t: t.to(device, non_blocking=True)
        return cls(
            token_seq=to(seq_idx),
            num_tokens=int(st[-1]), query_lens=list(query_lens),
            context_lens=list(context_lens), block_size=block_size,
            positions=to(positions), slot_mapping=to(torch.from_numpy(slots)),
            seq_lens=to(torch.from_numpy((q + c).astype(np.int32))),
            query_start_loc=to(torch.from_numpy(st.astype(np.int32))),
            block_tables=to(torch.from_numpy(table.astype(np.int32))),
            _group_inputs=(q_lens, ctx, starts, table_t, block_size, device),
        )

    @classmethod
    def for_decode_buffers(cls, positions: torch.Tensor, slot_mapping: torch.Tensor,
                           seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           block_tables: torch.Tensor, block_size: int,
                           max_seq_len: int) -> AttentionMetadata:
        """Decode metadata (one new token per sequence) over static device buffers.

        Nothing is copied or read: the tensors are used as given, so their contents may
        change between CUDA-graph replays. ``B = len(seq_lens)``; ``positions``,
        ``slot_mapping`` [B] long (slot ``-1`` = write nothing), ``seq_lens`` [B] int32
        (each ``<= max_seq_len``), ``query_start_loc`` [B + 1] int32 (``arange``),
        ``block_tables`` [B, >= ceil(max_seq_len / block_size)] int32 (last dim contiguous).

        The host lists hold upper bounds (``context_lens`` = ``max_seq_len - 1``), so kernels
        size their grids for ``max_seq_len`` and mask by ``seq_lens``. There are no gather
        groups: the torch reference cannot run from these; the Triton and flash-attn
        backends can.
        """
        b = seq_lens.shape[0]
        if not (positions.shape[0] == slot_mapping.shape[0] == block_tables.shape[0] == b
                and query_start_loc.shape[0] == b + 1):
            raise ValueError("decode buffers disagree on the number of sequences")
        if block_tables.shape[1] * block_size < max_seq_len:
            raise ValueError(f"block table width {block_tables.shape[1]} cannot hold "
                             f"{max_seq_len} tokens of {block_size}")
        if seq_lens.dtype != torch.int32 or block_tables.dtype != torch.int32:
            raise ValueError("seq_lens and block_tables must be int32")
        return cls(num_tokens=b, query_lens=[1] * b, context_lens=[max_seq_len - 1] * b,
                   block_size=block_size, positions=positions, slot_mapping=slot_mapping,
                   seq_lens=seq_lens, query_start_loc=query_start_loc,
                   block_tables=block_tables)


def _groups(q_lens: torch.Tensor, ctx: torch.Tensor, starts: torch.Tensor, table: torch.Tensor,
            block_size: int, device: torch.device | str) -> list[AttentionGroup]:
    decode = q_lens == 1
    return [AttentionGroup(*(t.to(device, non_blocking=True)
                             for t in _group(sel, q_lens, ctx, starts, table, block_size)))
            for sel in (decode.nonzero()[:, 0], (~decode).nonzero()[:, 0]) if len(sel)]


def _group(sel: torch.Tensor, q_lens: torch.Tensor, ctx: torch.Tensor, starts: torch.Tensor,
           table: torch.Tensor, block_size: int) -> tuple[torch.Tensor, ...]:
    ql, cl, st = q_lens[sel], ctx[sel], starts[sel]
    q_max, l_max = int(ql.max()), int((ql + cl).max())
    j = torch.arange(q_max)
    valid = j[None, :] < ql[:, None]
    jc = torch.minimum(j[None, :], ql[:, None] - 1)
    query_index = st[:, None] + jc
    kpos = torch.arange(l_max)
    kv_slots = table[sel][:, kpos // block_size] * block_size + kpos % block_size
    mask = kpos[None, None, :] <= (cl[:, None] + jc)[:, :, None]
    out_index = (torch.arange(len(sel))[:, None] * q_max + j[None, :])[valid]
    return query_index[valid], query_index, out_index, kv_slots, mask[:, None]
