"""Request records on disk, chosen by extension: ``.jsonl`` (one JSON object a line, exact) or
``.csv`` (one row a request, for a spreadsheet: ``itl_s`` is one space-separated cell, ``tpot_s``
is added as a computed column, and an absent value is an empty cell)."""
from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path

import msgspec

from weir.replay.types import RequestRecord

_FIELDS = msgspec.structs.fields(RequestRecord)
_COLUMNS = [f.name for f in _FIELDS] + ["tpot_s"]
_HAS_DEFAULT = {f.name for f in _FIELDS if not f.required}


def _kind(path: Path) -> str:
    kind = path.suffix.lower()
    if kind not in (".jsonl", ".csv"):
        raise ValueError(f"{path}: records go to .jsonl or .csv, not {kind or 'no suffix'}")
    return kind


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)                   # str(float) is its shortest exact form


def write_records(records: Iterable[RequestRecord], path: Path) -> None:
    path = Path(path)
    if _kind(path) == ".jsonl":
        encoder = msgspec.json.Encoder()
        with path.open("wb") as f:
            for rec in records:
                f.write(encoder.encode(rec) + b"\n")
        return
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(_COLUMNS)
        for rec in records:
            writer.writerow([_cell(getattr(rec, name)) for name in _COLUMNS])


def read_records(path: Path) -> list[RequestRecord]:
    """The records ``write_records`` wrote (the CSV's computed ``tpot_s`` is dropped)."""
    path = Path(path)
    if _kind(path) == ".jsonl":
        decoder = msgspec.json.Decoder(RequestRecord)
        with path.open("rb") as f:
            return [decoder.decode(line) for line in f if line.strip()]
    records = []
    with path.open(newline="") as f:
        for n, row in enumerate(csv.DictReader(f), start=2):
            row.pop("tpot_s", None)
            row["itl_s"] = [float(v) for v in (row.get("itl_s") or "").split()]
            row = {k: v for k, v in row.items() if not (v == "" and k in _HAS_DEFAULT)}
            try:
                records.append(msgspec.convert(row, RequestRecord, strict=False))
            except msgspec.ValidationError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    return records
