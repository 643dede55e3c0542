"""Encoding and checked decoding of enveloped messages.

Decoding is the trust boundary: whatever bytes arrive, ``Codec.decode`` and
``salvage_request_id`` either return a value or fail the one handled way
(``msgspec.DecodeError``, counted; ``None`` for salvage). Nesting depth is bounded by
msgspec's recursion guard, whose ``RecursionError`` (like any other exception a hostile
frame provokes: MemoryError, ValueError, OverflowError, ...) is turned into that path.
"""
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

# Frames larger than this are not searched for a request id (a ProtocolError answers them).
SALVAGE_MAX_BYTES = 1 << 20


def encode(body: Any, traceparent: str | None = None) -> bytes:
    """Wrap ``body`` in an Envelope (fresh message id, send time) and encode it."""
    return _ENCODER.encode(Envelope(next(_IDS), time.time_ns(), traceparent, body))


class Codec(Generic[T]):
    """Decodes exactly the union a socket accepts. Anything else is an error, counted."""

    def __init__(self, union: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(Envelope[union])
        self.malformed = 0

    def decode(self, data: bytes) -> Envelope[T]:
        """Decode one frame; raises msgspec.DecodeError (after counting it) on bad input,
        whatever the input: no other exception escapes."""
        try:
            return self._decoder.decode(data)
        except msgspec.DecodeError:
            self.malformed += 1
            raise
        except Exception as exc:        # RecursionError (deep nesting), MemoryError, ...
            self.malformed += 1
            raise msgspec.DecodeError(f"undecodable frame ({type(exc).__name__})") from None


class _RequestIdOnly(msgspec.Struct):
    """The one field salvage looks for; every other key of the body is skipped."""

    request_id: str


class _SalvageEnvelope(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    msg_id: msgspec.Raw
    sent_ns: msgspec.Raw
    traceparent: msgspec.Raw
    body: _RequestIdOnly


_SALVAGE = msgspec.msgpack.Decoder(_SalvageEnvelope)


def salvage_request_id(data: bytes) -> str | None:
    """Best effort: the ``request_id`` of an undecodable client message, for a clear reply.

    Typed (a four-item envelope whose body is a map with a string ``request_id``), so it
    never builds arbitrary Python objects from hostile input; never raises."""
    if len(data) > SALVAGE_MAX_BYTES:
        return None
    try:
        return _SALVAGE.decode(data).body.request_id
    except Exception:
        return None
