"""A GGUF file's header, its metadata and tensor table, read in one pass without torch.

``gguf.GGUFReader`` builds numpy views for every field, every item of every array and every
tensor: 5.4 s for SmolLM2's header on a 2-core EPYC, paid at each start by the tokenizer and
the detokenizer, which need only the vocabulary. The header is a flat run of typed values
(the GGUF spec: magic, version, counts, then key/value pairs, then tensor infos), so a
straight reader takes ~0.1 s for the same file, most of it decoding the 49,152 token strings
and 48,900 merges. The executor (weights) and the tokenizers (vocabulary) both read it here.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

# GGUF value types (the spec's numbering)
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = 8, 9, 10, 11, 12
_SCALARS = {_UINT8: "B", _INT8: "b", _UINT16: "H", _INT16: "h", _UINT32: "I", _INT32: "i",
            _FLOAT32: "f", _BOOL: "?", _UINT64: "Q", _INT64: "q", _FLOAT64: "d"}


class TensorInfo(NamedTuple):
    name: str
    dims: list[int]         # GGUF order: innermost first
    qtype: int              # a gguf.GGMLQuantizationType value
    offset: int             # from the start of the data section


class GGUFHeader(NamedTuple):
    data: np.memmap         # the whole file, mapped read-only (copy on write)
    meta: dict[str, Any]    # arrays as lists; a string array as list[str]
    tensors: list[TensorInfo]
    data_start: int         # where the tensor data begins (aligned)


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf: memoryview, path: Path, string_arrays: bool):
        self.buf, self.pos, self.path = buf, 0, path
        self.string_arrays = string_arrays

    def strings(self, n: int, keep: bool) -> list[str] | None:
        """``n`` strings in a row (a string array: the vocabulary, the merges): each a
        u64 length and its bytes. One tight loop, not a method call per value: ~100k of
        them in SmolLM2's header. ``keep`` False: skipped, only their lengths are read."""
        buf, pos, end, unpack = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out: list[str] | None = [] if keep else None
        try:
            for _ in range(n):
                (length,) = unpack(buf, pos)
                pos += 8
                if pos + length > end:
                    raise ValueError(f"{self.path}: GGUF string of {length} bytes runs past "
                                     f"the file's end")
                if out is not None:
                    out.append(str(buf[pos:pos + length], "utf-8"))
                pos += length
        except struct.error:
            raise ValueError(f"{self.path}: GGUF header ends early at byte {pos}") from None
        self.pos = pos
        return out

    def scalar(self, code: str):
        try:
            (v,) = struct.unpack_from("<" + code, self.buf, self.pos)
        except struct.error:
            raise ValueError(f"{self.path}: GGUF header ends early at byte {self.pos}") from None
        self.pos += struct.calcsize(code)
        return v

    def string(self) -> str:
        return self.strings(1, True)[0]

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        etype, n = self.scalar("I"), self.scalar("Q")
        if etype == _STRING:
            return self.strings(n, self.string_arrays)
        if etype not in _SCALARS:
            raise ValueError(f"{self.path}: GGUF arrays of type {etype} are not supported")
        dt = np.dtype("<" + _SCALARS[etype])
        if self.pos + n * dt.itemsize > len(self.buf):
            raise ValueError(f"{self.path}: GGUF array of {n} items runs past the file's end")
        arr = np.frombuffer(self.buf, dt, count=n, offset=self.pos)
        self.pos += n * dt.itemsize
        return arr.tolist()


def read_header(path: str | Path, string_arrays: bool = True) -> GGUFHeader:
    """The metadata and tensor table of the GGUF file at ``path`` (versions 2 and 3).
    ``string_arrays=False``: string arrays (the vocabulary, the merges) are skipped and read
    as None, for a reader that needs only the tensors. Raises ValueError for anything that
    is not a well-formed GGUF header."""
    path = Path(path)
    mm = np.memmap(path, dtype=np.uint8, mode="c")
    r = _Cursor(memoryview(mm), path, string_arrays)
    if bytes(r.buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    r.pos = 4
    version, n_tensors, n_kv = r.scalar("I"), r.scalar("Q"), r.scalar("Q")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version}")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.scalar("I"))
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.scalar("Q") for _ in range(r.scalar("I"))]
        tensors.append(TensorInfo(name, dims, r.scalar("I"), r.scalar("Q")))
    align = meta.get("general.alignment", 32)
    return GGUFHeader(mm, meta, tensors, (r.pos + align - 1) // align * align)
