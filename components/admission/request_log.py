"""The recorded request log: what ``weir qualify`` replays a candidate policy on. One line
per request admission saw, written when the request leaves it, as a Weir JSONL trace
(docs/replay.md, "Weir JSONL"): lengths and ids only, never text.

A line keeps the request's tenant, the class it asked for (the policy under test resolves
it again), its arrival (the streamer's wall clock, unix milliseconds), its prompt length, its
prefix blocks, its output length, its own TTFT deadline, ``n``, and, for one the client
cancelled, how long after arrival. Prefix blocks are the tokenizer's block hashes (chained,
scoped per tenant, a public prefix in its own scope) renumbered 0, 1, 2, ... in the order
the log first saw them, as the Mooncake traces number theirs: two requests share a
leading id where they shared a cached block, and no content hash leaves the engine. The
renumbering remembers the most recent ``remember`` blocks (two generations of half that,
so its memory is bounded); a block seen again after it was forgotten gets a new id,
as a pool that evicted it would have to compute it again.

The output length is what the request generated (all choices, divided by ``n``). A request
that generated nothing known (refused, expired in the queue, cancelled before its end, or
held when the scheduler restarted) has admission's expectation instead: its ``max_tokens``
if the client gave one, else what admission expected it to generate.

The first line of each file is a ``#`` comment naming the block size; past ``max_bytes``
the file is renamed to ``NAME.1`` (replacing the last one) and a new one begun, so at most
twice ``max_bytes`` is on disk. Each line is one ``O_APPEND`` write.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from schemas.config import WeirConfig
from schemas.wire import Tokenized

HEADER = "# weir request log v1: block_size={block_size}\n"
_encode = msgspec.json.Encoder().encode


def log_path(config: WeirConfig) -> Path | None:
    """Where admission writes the log: ``telemetry.request_log`` under
    ``topology.run_dir`` (an absolute one as it is). None: off (no name, or a relative
    one and no run directory). The run directory also holds the ipc sockets, but only with
    ipc transport: over tcp it is only where these files go."""
    name, run_dir = config.telemetry.request_log, config.topology.run_dir
    if not name or not (os.path.isabs(name) or run_dir):
        return None
    return Path(run_dir) / name


class _Row(msgspec.Struct):
    arrival_ns: int
    input_tokens: int
    hash_ids: list[int]
    tenant: str
    asked_class: str | None
    max_tokens: int | None
    deadline_ms: int | None
    n: int
    expected_output: int | None = None
    cancel_ns: int | None = None


class BlockIds:
    """Block hashes renumbered in the order first seen, remembering about the last
    ``remember`` of them."""

    def __init__(self, remember: int) -> None:
        self.half = max(1, remember // 2)
        self.young: dict[int, int] = {}
        self.old: dict[int, int] = {}
        self.next_id = 0

    def ids(self, hashes: list[int]) -> list[int]:
        out = []
        for h in hashes:
            i = self.young.get(h)
            if i is None:
                i = self.old.pop(h, None)
                if i is None:
                    i, self.next_id = self.next_id, self.next_id + 1
                if len(self.young) >= self.half:
                    self.old, self.young = self.young, {}
                self.young[h] = i
            out.append(i)
        return out


class RequestLog:
    """Rows of the requests admission holds, each written when the request leaves."""

    def __init__(self, path: Path, block_size: int, *, max_bytes: int, remember: int,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.path, self.block_size, self.max_bytes = Path(path), block_size, max_bytes
        self.blocks = BlockIds(remember)
        self.clock = clock
        self.rows: dict[str, _Row] = {}
        self.written = self.errors = 0
        self._fd = -1
        self._size = 0
        self._open()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._size = os.fstat(self._fd).st_size
        if self._size == 0:
            self._write(HEADER.format(block_size=self.block_size).encode())

    def _write(self, line: bytes) -> None:
        if self._fd < 0:
            self._open()
        os.write(self._fd, line)
        self._size += len(line)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ------------------------------------------------------------------ what admission saw
    def arrived(self, req: Tokenized) -> None:
        if req.request_id in self.rows:
            return
        h = req.header
        deadline = (None if h.ttft_deadline_ns is None
                    else max(0, round((h.ttft_deadline_ns - h.arrival_ns) / 1e6)))
        self.rows[req.request_id] = _Row(
            h.arrival_ns, len(req.prompt_token_ids), self.blocks.ids(req.block_hashes),
            h.tenant, h.asked_class, h.params.max_tokens, deadline, h.params.n)

    def expected(self, request_id: str, output: int) -> None:
        """Admission's expectation of its output, at its decision."""
        if (row := self.rows.get(request_id)) is not None:
            row.expected_output = output

    def cancelled(self, request_id: str) -> None:
        if (row := self.rows.get(request_id)) is not None and row.cancel_ns is None:
            row.cancel_ns = self.clock()

    def end(self, request_id: str, output_tokens: int | None = None) -> None:
        """The request left admission: write its line (``output_tokens``: all choices',
        None where nothing finished)."""
        row = self.rows.pop(request_id, None)
        if row is None:
            return
        output: int | None
        if output_tokens is not None:
            output = -(-output_tokens // row.n)
        else:
            output = row.max_tokens if row.max_tokens is not None else row.expected_output
        line: dict[str, object] = {"arrival_ms": round(row.arrival_ns / 1e6),
                                   "input_tokens": row.input_tokens}
        if row.hash_ids:
            line["hash_ids"] = row.hash_ids
        if output is not None:
            line["output_tokens"] = output
        line["tenant"] = row.tenant
        if row.asked_class is not None:
            line["class"] = row.asked_class
        if row.deadline_ms is not None:
            line["deadline_ms"] = row.deadline_ms
        if row.n != 1:
            line["n"] = row.n
        if row.cancel_ns is not None:
            line["cancel_after_s"] = max(0.0, (row.cancel_ns - row.arrival_ns) / 1e9)
        data = _encode(line) + b"\n"
        try:
            if self._size + len(data) > self.max_bytes:
                self.close()
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                self._open()
            self._write(data)
        except OSError:                  # a full disk costs the log a line, never admission
            self.errors += 1
            return
        self.written += 1
