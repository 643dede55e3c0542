"""The recorded request log, exact: each line as written, block ids renumbered and
forgotten, rotation; and read back as a trace (what ``weir qualify`` replays)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.admission.request_log import BlockIds, RequestLog
from schemas.wire import RequestHeader, SamplingParams, Tokenized
from weir.replay.traces import load_trace, request_log_block_size

T0 = 1_700_000_000_000_000_000          # the streamer's wall clock, ns


def _tok(rid: str, arrival_ms: int, prompt: int, hashes: list[int], *, tenant: str = "a",
         cls: str | None = None, max_tokens: int | None = None, deadline_ms: int | None = None,
         n: int = 1) -> Tokenized:
    arrival = T0 + arrival_ms * 1_000_000
    header = RequestHeader(rid, tenant, SamplingParams(max_tokens=max_tokens, n=n), arrival,
                           asked_class=cls,
                           ttft_deadline_ns=None if deadline_ms is None
                           else arrival + deadline_ms * 1_000_000)
    return Tokenized(header, list(range(prompt)), hashes)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()[1:]]


def test_block_ids_number_in_first_seen_order_and_forget_the_oldest() -> None:
    b = BlockIds(remember=4)                      # two generations of 2
    assert b.ids([901, 902]) == [0, 1]
    assert b.ids([901, 903]) == [0, 2]            # 901 known; 903 fills a generation
    assert b.ids([904]) == [3]
    assert b.ids([905]) == [4]                    # 901 and 902 have gone out of memory
    assert b.ids([901, 904]) == [5, 3]            # 901 seen again: a new id; 904 kept


def test_each_end_writes_one_line_of_lengths_and_ids(tmp_path: Path) -> None:
    now = [T0 + 2_500_000_000]
    log = RequestLog(tmp_path / "requests.jsonl", 16, max_bytes=1 << 20, remember=1000,
                     clock=lambda: now[0])
    log.arrived(_tok("r1", 0, 40, [77, 78], cls="interactive", deadline_ms=800))
    log.arrived(_tok("r2", 250, 20, [77], tenant="b", max_tokens=64))
    log.arrived(_tok("r3", 500, 10, [], n=2))
    log.arrived(_tok("r4", 1000, 18, [55], max_tokens=32))
    log.arrived(_tok("r1", 0, 40, [77, 78]))      # a replay after a restart: no second row
    log.expected("r3", 30)
    log.end("r2")                                 # refused: its max_tokens stands in
    log.cancelled("r4")                           # cancelled 1.5 s after it arrived
    now[0] += 1_000_000_000
    log.cancelled("r4")                           # the first cancel counts
    log.end("r4")
    log.end("r1", 12)
    log.end("r3", 9)                              # two choices: 5 each (rounded up)
    log.end("r3", 9)                              # gone already: nothing
    assert log.rows == {} and log.written == 4
    assert (tmp_path / "requests.jsonl").read_text().splitlines()[0] == \
        "# weir request log v1: block_size=16"
    assert _lines(tmp_path / "requests.jsonl") == [
        {"arrival_ms": 1_700_000_000_250, "input_tokens": 20, "hash_ids": [0], "output_tokens": 64,
         "tenant": "b"},
        {"arrival_ms": 1_700_000_001_000, "input_tokens": 18, "hash_ids": [2], "output_tokens": 32,
         "tenant": "a", "cancel_after_s": 1.5},
        {"arrival_ms": 1_700_000_000_000, "input_tokens": 40, "hash_ids": [0, 1],
         "output_tokens": 12, "tenant": "a", "class": "interactive", "deadline_ms": 800},
        {"arrival_ms": 1_700_000_000_500, "input_tokens": 10, "output_tokens": 5, "tenant": "a",
         "n": 2},
    ]


def test_read_back_it_is_a_trace_in_arrival_order(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    log = RequestLog(path, 16, max_bytes=1 << 20, remember=1000)
    log.arrived(_tok("late", 300, 40, [5, 6], cls="batch"))
    log.arrived(_tok("early", 100, 33, [5], tenant="b", deadline_ms=500))
    log.end("late", 7)
    log.end("early", 3)
    assert request_log_block_size(path) == 16
    reqs = load_trace(path)                       # auto-detected: a Weir JSONL trace
    assert [(r.input_tokens, r.hash_ids, r.output_tokens, r.tenant, r.service_class,
             r.deadline_ms) for r in reqs] == [(33, (0,), 3, "b", None, 500),
                                               (40, (0, 1), 7, "a", "batch", None)]
    # unix milliseconds made relative in seconds: a double's rounding at 1.7e9 s
    assert [r.arrival_s for r in reqs] == [0.0, pytest.approx(0.2, abs=1e-6)]


def test_request_log_block_size_is_none_for_other_traces(tmp_path: Path) -> None:
    other = tmp_path / "t.jsonl"
    other.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1}\n')
    assert request_log_block_size(other) is None
    assert request_log_block_size(tmp_path / "missing.jsonl") is None


def test_past_its_size_the_file_is_rotated_once(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    log = RequestLog(path, 16, max_bytes=200, remember=1000)
    for i in range(3):
        log.arrived(_tok(f"r{i}", i, 5, []))
        log.end(f"r{i}", 1)
    # the header (37 bytes) and 2 lines of 77 fit in 200; the third starts a new file
    assert [len(_lines(path)), len(_lines(path.with_name("requests.jsonl.1")))] == [1, 2]
    assert path.read_text().startswith("# weir request log v1: block_size=16\n")
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_restarted_admission_appends(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    for i in range(2):
        log = RequestLog(path, 16, max_bytes=1 << 20, remember=1000)
        log.arrived(_tok(f"r{i}", i, 5, []))
        log.end(f"r{i}", 1)
        log.close()
    text = path.read_text()
    assert text.count("# weir request log") == 1 and len(_lines(path)) == 2
