"""Encoding and checked decoding of enveloped messages."""
from __future__ import annotations

import itertools
import os
import time
from typing import Any, Generic, TypeVar

import msgspec

from schemas.wire import Envelope

T = TypeVar("T")

_ENCODER = msgspec.msgpack.Encoder()
_IDS = itertools.count((os.getpid() & 0xFFFF) << 40)


def encode(body: Any, traceparent: str | None = None) -> bytes:
    """Wrap ``body`` in an Envelope (fresh message id, send time) and encode it."""
    return _ENCODER.encode(Envelope(next(_IDS), time.time_ns(), traceparent, body))


class Codec(Generic[T]):
    """Decodes exactly the union a socket accepts. Anything else is an error, counted."""

    def __init__(self, union: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(Envelope[union])
        self.malformed = 0

    def decode(self, data: bytes) -> Envelope[T]:
        """Decode one frame; raises msgspec.DecodeError (after counting it) on bad input."""
        try:
            return self._decoder.decode(data)
        except msgspec.DecodeError:
            self.malformed += 1
            raise


def salvage_request_id(data: bytes) -> str | None:
    """Best effort: the ``request_id`` of an undecodable client message, for a clear reply."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    body = raw[3] if isinstance(raw, list) and len(raw) == 4 else None
    if isinstance(body, dict) and isinstance(body.get("request_id"), str):
        return body["request_id"]
    return None
