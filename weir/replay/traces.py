"""Trace loaders: public request traces (Mooncake, Azure, BurstGPT), Weir's own JSONL and
Weir's OpenTelemetry span export, each read into ``TraceRequest`` records.

Every loader returns the requests sorted by arrival (stable: ties keep file order), with
``index`` renumbered from 0, ``arrival_s`` relative to the first request, and ``source``
set to ``"path:line"``. A bad row is a ``TraceError`` naming the file and line; nothing is
skipped silently. The formats and their rules are documented in docs/replay.md.
"""
from __future__ import annotations

import csv
import difflib
import io
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta
from operator import itemgetter
from pathlib import Path
from typing import Any

import msgspec

from weir.replay.types import TraceRequest

FORMATS = ("mooncake", "azure", "burstgpt", "weir", "otel")

_Row = tuple[float | int, int, dict]   # (arrival in the format's unit, line, TraceRequest fields)
_decode = msgspec.json.Decoder().decode
_EPOCH, _SECOND = datetime(1970, 1, 1), timedelta(seconds=1)
_AZURE_TIME = re.compile(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?", re.ASCII)
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
_REQUEST_LOG = re.compile(rb"# weir request log v1: block_size=(\d+)")
_WEIR_STRINGS = {"tenant": "tenant", "api_key": "api_key", "class": "service_class",
                 "session_id": "session_id"}
_WEIR_REQUIRED = ("arrival_s", "arrival_ms", "prompt", "input_tokens")   # one of each pair
_WEIR_FIELDS = (*_WEIR_REQUIRED, "hash_ids", "output_tokens", "deadline_ms", "max_tokens",
                "cancel_after_s", "n", *_WEIR_STRINGS)


class TraceError(ValueError):
    """A trace that cannot be replayed as written. The message starts with ``file:line:``,
    or ``file:`` alone when the whole file is at fault (unreadable, empty)."""


class _Bad(Exception):
    """A value check failed; the loop that knows the line turns it into a TraceError."""


def load_trace(path: str | os.PathLike, fmt: str = "auto") -> list[TraceRequest]:
    """Load a trace file. ``fmt`` is "auto" (detect from the first non-empty line) or one
    of ``FORMATS``."""
    loaders: dict[str, Callable[[_Source], list[TraceRequest]]] = {
        "mooncake": _load_mooncake, "azure": _load_azure, "burstgpt": _load_burstgpt,
        "weir": _load_weir, "otel": _load_otel}
    if fmt != "auto" and fmt not in loaders:
        raise TraceError(f"{os.fspath(path)}: unknown trace format {fmt!r}; expected auto or "
                         f"one of {', '.join(FORMATS)}")
    src = _Source(path)
    return loaders[src.detect() if fmt == "auto" else fmt](src)


class _Source:
    """One trace file's bytes, read once, and the ways to walk them line by line."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        try:
            self.data = Path(path).read_bytes().removeprefix(b"\xef\xbb\xbf")
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot read the trace: {exc.strerror or exc}") from None

    def error(self, line: int, message: str) -> TraceError:
        return TraceError(f"{self.path}:{line}: {message}")

    def lines(self) -> Iterator[tuple[int, bytes]]:
        """Non-blank lines that are not ``#`` comments, numbered from 1."""
        for n, raw in enumerate(self.data.split(b"\n"), 1):
            raw = raw.strip()
            if raw and not raw.startswith(b"#"):
                yield n, raw

    def objects(self) -> Iterator[tuple[int, dict]]:
        for n, raw in self.lines():
            try:
                obj = _decode(raw)
            except msgspec.DecodeError as exc:
                raise self.error(n, f"invalid JSON: {exc}") from None
            if type(obj) is not dict:
                raise self.error(n, f"expected a JSON object, got {_got(obj)}")
            yield n, obj

    def rows(self, parse: Callable[[dict], tuple[float | int, dict]]) -> list[_Row]:
        """``parse`` applied to every JSON object line; its ``_Bad`` gets this line."""
        out = []
        for n, obj in self.objects():
            try:
                t, fields = parse(obj)
            except _Bad as bad:
                raise self.error(n, str(bad)) from None
            out.append((t, n, fields))
        return out

    def table(self, columns: tuple[str, ...]) -> Iterator[tuple[int, list[str]]]:
        """CSV rows as the values of ``columns`` (named by the header), with their line."""
        try:
            text = self.data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(self.data.count(b"\n", 0, exc.start) + 1, "not UTF-8 text") from None
        reader = csv.reader(io.StringIO(text, newline=""))
        header: list[str] | None = None
        try:
            for row in reader:
                if not any(field.strip() for field in row):
                    continue
                if header is None:
                    header = [field.strip() for field in row]
                    missing = [c for c in columns if c not in header]
                    if missing:
                        raise self.error(reader.line_num, f'missing column "{missing[0]}" in '
                                         f"the header ({', '.join(header)})")
                    where = [header.index(c) for c in columns]
                elif len(row) != len(header):
                    raise self.error(reader.line_num,
                                     f"expected {len(header)} fields, got {len(row)}")
                else:
                    yield reader.line_num, [row[i] for i in where]
        except csv.Error as exc:
            raise self.error(reader.line_num, f"malformed CSV: {exc}") from None

    def detect(self) -> str:
        first = next(self.lines(), None)
        if first is None:
            raise TraceError(f"{self.path}: no requests in the trace")
        n, raw = first
        if raw.startswith(b"{"):
            obj = next(self.objects())[1]
            if "input_length" in obj and ("hash_ids" in obj or "timestamp" in obj):
                return "mooncake"
            if "arrival_s" in obj or "arrival_ms" in obj:
                return "weir"
            if {"trace_id", "span_id", "name", "start_ns"} <= obj.keys():
                return "otel"
            raise self.error(n, "unknown trace format: a JSON object with fields "
                             f"{', '.join(obj)}; pass the format explicitly")
        header = {f.strip() for f in next(csv.reader([raw.decode("utf-8", "replace")]), [])}
        if set(_AZURE_COLUMNS) <= header:
            return "azure"
        if {"Request tokens", "Response tokens"} <= header:
            return "burstgpt"
        raise self.error(n, "unknown trace format: neither a JSONL trace nor an Azure or "
                         "BurstGPT CSV header")


def _finish(src: _Source, rows: list[_Row], per_second: float) -> list[TraceRequest]:
    """Sort (stable), make arrivals relative to the first, convert to seconds, renumber."""
    if not rows:
        raise TraceError(f"{src.path}: no requests in the trace")
    rows.sort(key=itemgetter(0))
    t0 = rows[0][0]
    return [TraceRequest(index=i, arrival_s=(t - t0) / per_second, source=f"{src.path}:{n}",
                         **fields) for i, (t, n, fields) in enumerate(rows)]


# -- value checks: each returns the value or raises _Bad with the message

def _got(value: Any) -> str:
    try:
        text = msgspec.json.encode(value).decode()
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _need(obj: dict, key: str) -> Any:
    if key not in obj:
        raise _Bad(f'missing required field "{key}"')
    return obj[key]


def _count(value: Any, name: str) -> int:
    if type(value) is not int or value < 0:
        raise _Bad(f"{name} must be a non-negative integer, got {_got(value)}")
    return value


def _positive(value: Any, name: str) -> int:
    if type(value) is not int or value < 1:
        raise _Bad(f"{name} must be an integer >= 1, got {_got(value)}")
    return value


def _time(value: Any, name: str) -> float | int:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise _Bad(f"{name} must be a non-negative number, got {_got(value)}")
    return value


def _text(value: Any, name: str) -> str:
    if type(value) is not str or not value:
        raise _Bad(f"{name} must be a non-empty string, got {_got(value)}")
    return value


def _hash_ids(value: Any) -> tuple[int, ...]:
    if type(value) is not list:
        raise _Bad(f"hash_ids must be a list of non-negative integers, got {_got(value)}")
    for i, h in enumerate(value):
        if type(h) is not int or h < 0:
            raise _Bad(f"hash_ids[{i}] must be a non-negative integer, got {_got(h)}")
    return tuple(value)


def _csv_count(text: str, name: str) -> int:
    s = text.strip()
    if not (s.isascii() and s.isdigit()):
        raise _Bad(f"{name} must be a non-negative integer, got {_got(text)}")
    return int(s)


def _csv_seconds(text: str, name: str) -> float:
    try:
        value = float(text) if "_" not in text else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise _Bad(f"{name} must be a non-negative number of seconds, got {_got(text)}")
    return value


def _azure_ns(text: str) -> int:
    """``2023-11-16 18:15:46.6805900`` (0-9 fractional digits) as integer nanoseconds."""
    m = _AZURE_TIME.fullmatch(text.strip())
    try:
        if m is None:
            raise ValueError
        whole = datetime.fromisoformat(m[1])
    except ValueError:
        raise _Bad('TIMESTAMP must be a date and time like "2023-11-16 18:15:46.6805900", '
                   f"got {_got(text)}") from None
    return (whole - _EPOCH) // _SECOND * 1_000_000_000 + int((m[2] or "").ljust(9, "0"))


# -- the formats

def _load_mooncake(src: _Source) -> list[TraceRequest]:
    def parse(obj: dict) -> tuple[float | int, dict]:
        return _time(_need(obj, "timestamp"), "timestamp"), {
            "input_tokens": _count(_need(obj, "input_length"), "input_length"),
            "output_tokens": _count(_need(obj, "output_length"), "output_length"),
            "hash_ids": _hash_ids(obj.get("hash_ids", []))}
    return _finish(src, src.rows(parse), 1e3)


def _load_csv(src: _Source, columns: tuple[str, ...], when: Callable[[str], float | int],
              per_second: float) -> list[TraceRequest]:
    rows = []
    for n, (t, prompt, output) in src.table(columns):
        try:
            rows.append((when(t), n, {"input_tokens": _csv_count(prompt, columns[1]),
                                      "output_tokens": _csv_count(output, columns[2])}))
        except _Bad as bad:
            raise src.error(n, str(bad)) from None
    return _finish(src, rows, per_second)


def _load_azure(src: _Source) -> list[TraceRequest]:
    return _load_csv(src, _AZURE_COLUMNS, _azure_ns, 1e9)


def _load_burstgpt(src: _Source) -> list[TraceRequest]:
    return _load_csv(src, _BURSTGPT_COLUMNS, lambda t: _csv_seconds(t, "Timestamp"), 1.0)


def _load_weir(src: _Source) -> list[TraceRequest]:
    return _finish(src, src.rows(_weir_row), 1.0)


def _weir_row(obj: dict) -> tuple[float, dict]:
    for key in obj:
        if key not in _WEIR_FIELDS:
            close = difflib.get_close_matches(key, _WEIR_FIELDS, n=1)
            hint = f' (did you mean "{close[0]}"?)' if close else ""
            raise _Bad(f'unknown field "{key}"{hint}')
    obj = {k: v for k, v in obj.items() if v is not None or k in _WEIR_REQUIRED}  # null: unset
    _one_of(obj, "arrival_s", "arrival_ms")
    arrival = (_time(obj["arrival_s"], "arrival_s") if "arrival_s" in obj
               else _time(obj["arrival_ms"], "arrival_ms") / 1e3)
    _one_of(obj, "prompt", "input_tokens")
    fields: dict[str, Any] = {}
    if "prompt" in obj:
        fields["prompt"] = _text(obj["prompt"], "prompt")
        if "hash_ids" in obj:
            raise _Bad('"hash_ids" goes with "input_tokens"; a prompt\'s prefixes are its text')
    else:
        fields["input_tokens"] = _count(obj["input_tokens"], "input_tokens")
        fields["hash_ids"] = _hash_ids(obj.get("hash_ids", []))
    for key in ("output_tokens", "deadline_ms"):
        if key in obj:
            fields[key] = _count(obj[key], key)
    for key in ("max_tokens", "n"):
        if key in obj:
            fields[key] = _positive(obj[key], key)
    if "cancel_after_s" in obj:
        fields["cancel_after_s"] = float(_time(obj["cancel_after_s"], "cancel_after_s"))
    for key, field in _WEIR_STRINGS.items():
        if key in obj:
            fields[field] = _text(obj[key], key)
    return arrival, fields


def _one_of(obj: dict, a: str, b: str) -> None:
    if a not in obj and b not in obj:
        raise _Bad(f'missing required field "{a}" (or "{b}")')
    if a in obj and b in obj:
        raise _Bad(f'give "{a}" or "{b}", not both')


def _load_otel(src: _Source) -> list[TraceRequest]:
    """One request per ``weir.request_id`` with an ``admission.decide`` span. Arrival: the
    earliest start of a span carrying that id (the client's ``weir.submit``, the streamer's
    ``weir.request``). Output: the ``decode`` span's count, found through the parent the
    decide span shares with it (the request's root), else the root's, else max_tokens."""
    decides: dict[str, tuple[int, dict, tuple]] = {}    # id -> (line, fields, parent)
    first: dict[str, int] = {}                           # id -> earliest start_ns
    decoded: dict[tuple, int] = {}                       # (trace, parent span) -> output
    finished: dict[str, int] = {}                        # id -> output, from weir.request
    for n, span in src.objects():
        try:
            name = _text(_need(span, "name"), "name")
            start = _count(_need(span, "start_ns"), "start_ns")
            attrs = _need(span, "attributes")
            if type(attrs) is not dict:
                raise _Bad(f"attributes must be an object, got {_got(attrs)}")
            parent = (span.get("trace_id"), span.get("parent_span_id"))
            rid = attrs.get("weir.request_id")
            if name == "admission.decide":
                rid = _text(rid, "admission.decide span's weir.request_id")
                decides.setdefault(rid, (n, _decision(attrs), parent))
            if type(rid) is str:
                first[rid] = min(first.get(rid, start), start)
            output = attrs.get("gen_ai.usage.output_tokens")
            if output is not None and name in ("decode", "weir.request"):
                output = _count(output, f"{name} span's gen_ai.usage.output_tokens")
                if name == "decode":
                    decoded[parent] = output
                elif type(rid) is str:
                    finished[rid] = output
        except _Bad as bad:
            raise src.error(n, str(bad)) from None
    rows = []
    for rid, (n, fields, parent) in decides.items():
        output = decoded.get(parent) if parent[1] is not None else None
        output = output if output is not None else finished.get(rid, fields["max_tokens"])
        rows.append((first[rid], n, {**fields, "output_tokens": output}))
    return _finish(src, rows, 1e9)


def _decision(attrs: dict) -> dict:
    """TraceRequest fields from an ``admission.decide`` span's attributes (-1 = not set)."""
    def optional(key: str, least: int) -> int | None:
        value = attrs.get(key, -1)
        if type(value) is not int:
            raise _Bad(f"admission.decide span's {key} must be an integer, got {_got(value)}")
        return value if value >= least else None

    if "gen_ai.usage.input_tokens" not in attrs:
        raise _Bad("admission.decide span has no gen_ai.usage.input_tokens")
    fields = {"input_tokens": _count(attrs["gen_ai.usage.input_tokens"],
                                     "admission.decide span's gen_ai.usage.input_tokens"),
              "max_tokens": optional("gen_ai.request.max_tokens", 1),
              # the client's own deadline; an export from before it was recorded apart has
              # only the one decided on (the class's, where the request set none)
              "deadline_ms": optional("weir.request.deadline_ms" if "weir.request.deadline_ms"
                                      in attrs else "weir.admission.deadline_ms", 0)}
    for key, field in (("weir.tenant", "tenant"), ("weir.service_class", "service_class")):
        if key in attrs:
            fields[field] = _text(attrs[key], f"admission.decide span's {key}")
    return fields


def request_log_block_size(path: str | os.PathLike) -> int | None:
    """The block size a recorded request log (components/admission/request_log.py) names
    on its first line, its prefix blocks' size in tokens; None for any other file."""
    try:
        with open(path, "rb") as f:
            first = f.readline(256).removeprefix(b"\xef\xbb\xbf")
    except OSError:
        return None
    m = _REQUEST_LOG.match(first)
    return int(m[1]) if m else None


def write_weir(requests: Iterable[TraceRequest], path: str | os.PathLike) -> None:
    """Write ``requests`` as a Weir JSONL trace (one object a line, only the fields that are
    set). ``load_trace`` reads back the same requests, but for ``source`` and the arrival
    times, which it counts from the first request."""
    strings = {field: key for key, field in _WEIR_STRINGS.items()}
    lines = []
    for r in requests:
        row: dict[str, Any] = {"arrival_s": r.arrival_s}
        if r.prompt is not None:
            row["prompt"] = r.prompt
        else:
            row["input_tokens"] = r.input_tokens if r.input_tokens is not None else 0
            if r.hash_ids:
                row["hash_ids"] = list(r.hash_ids)
        for key in ("output_tokens", "deadline_ms", "max_tokens", "cancel_after_s"):
            if getattr(r, key) is not None:
                row[key] = getattr(r, key)
        if r.n != 1:
            row["n"] = r.n
        for field, key in strings.items():
            if getattr(r, field) is not None:
                row[key] = getattr(r, field)
        lines.append(msgspec.json.encode(row).decode())
    Path(path).write_text("\n".join(lines) + "\n")
