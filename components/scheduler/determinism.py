"""Fixed chunk boundaries for a deterministic prompt (``SamplingParams.deterministic``).

A deterministic prompt is computed in chunks of exactly ``chunk`` tokens
(``config.deterministic_chunk``: ``scheduler.deterministic_chunk`` in whole KV blocks),
aligned at position 0: chunk ``i`` is positions ``[i·chunk, (i+1)·chunk)``, the last one
ending at the prompt's end. The load never moves a boundary: a chunk is planned whole or
not at all (``chunk_tokens``), and a prefix-cache hit is taken only down to a boundary
(``cached_blocks``), so the chunks computed after it are those computed without it. A
recompute after preemption starts at position 0 again (its prompt is then the prompt and
the output so far), and so meets the same boundaries; so does a router's continuation.
Decode tokens after the prompt are computed one a step, as for any request. Pure."""
from __future__ import annotations


def chunk_tokens(planned: int, todo: int, chunk: int) -> int:
    """The tokens a deterministic sequence at position ``planned``, with ``todo`` tokens
    left to compute, computes in its next step: up to its next chunk boundary, or to its
    end if that comes first."""
    return min(todo, chunk - planned % chunk)


def cached_blocks(num_tokens: int, chunk: int, block_size: int) -> tuple[int, int]:
    """What a deterministic prompt of ``num_tokens`` tokens may take from the prefix cache:
    at most this many leading blocks, in a multiple of the second (a chunk's blocks), so
    a hit ends on a chunk boundary. The last prompt token is always computed."""
    per_chunk = chunk // block_size
    return (num_tokens - 1) // chunk * per_chunk, per_chunk
