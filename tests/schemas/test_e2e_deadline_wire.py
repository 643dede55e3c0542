"""The end-to-end deadline on the wire: the ``deadline`` finish reason crosses every hop
it takes (scheduler → detokenizer in a ``TokenOut``, detokenizer → streamer → client in a
``Finished`` and its ``ChoiceEnd``s) through the receiving socket's own codec, a reason
outside the Literal still fails at decode, and the bound's fields (``Submit``,
``NewRequest``, ``Tokenized``/``Admitted``, ``Accepted``) round-trip and are absent from an
older peer's frame without harm."""
from __future__ import annotations

import msgspec
import pytest

from bus.codec import Codec, encode
from schemas.client import ServerMsg
from schemas.wire import (
    Accepted,
    AdmissionMsg,
    ChoiceEnd,
    ClientMsg,
    DetokenizerMsg,
    EventBatch,
    Finished,
    RequestTiming,
    SamplingParams,
    SchedulerMsg,
    StreamerMsg,
    Submit,
    TokenBatch,
    TokenizerMsg,
    TokenOut,
    Usage,
)
from tests import messages as msgs


def across(union, body):
    return Codec(union).decode(encode(body)).body


def test_the_deadline_finish_reason_crosses_every_hop():
    out = TokenOut("r", [], None, "deadline", Usage(8, 10, 2),
                   RequestTiming(0.005, 0.005, 0.09, 0, 0.005), 1)
    assert across(DetokenizerMsg, TokenBatch([out])) == TokenBatch([out])
    done = Finished("r", "deadline", Usage(8, 13, 2),
                    choices=(ChoiceEnd(0, "length", 3), ChoiceEnd(1, "deadline", 10)))
    assert across(StreamerMsg, EventBatch([done])) == EventBatch([done])
    assert across(ServerMsg, done) == done


def test_a_finish_reason_outside_the_literal_fails_at_decode():
    frame = encode(Finished("r", "stop", Usage(1, 1))).replace(b"stop", b"nope")
    with pytest.raises(msgspec.DecodeError, match="finish_reason"):
        Codec(ServerMsg).decode(frame)


def test_the_bound_round_trips_and_an_older_frame_has_none():
    sub = Submit("r", "hi", e2e_deadline_ms=2500)
    assert across(ClientMsg, sub) == sub
    new = msgs.new_request("r", "t", "hi", None, SamplingParams(), 0, e2e_deadline_ms=2500)
    assert across(TokenizerMsg, new) == new
    tok = msgs.tokenized("r", "t", [1, 2], [], SamplingParams(), 0, e2e_deadline_ms=2500)
    assert across(AdmissionMsg, tok) == tok
    adm = msgs.admitted("r", "t", [1, 2], [], SamplingParams(), 0, e2e_deadline_ms=2000,
                   drop_late=True)
    assert across(SchedulerMsg, adm) == adm
    acc = Accepted("r", 2, e2e_deadline_ms=2000)
    assert across(ServerMsg, acc) == acc
    # a peer that predates the field sends none: the map decodes, with no bound
    older = msgspec.msgpack.encode({"type": "submit", "request_id": "r", "prompt": "hi"})
    assert msgspec.msgpack.decode(older, type=ClientMsg).e2e_deadline_ms is None
    older = msgspec.msgpack.encode({"type": "accepted", "request_id": "r", "prompt_tokens": 2})
    assert msgspec.msgpack.decode(older, type=ServerMsg).e2e_deadline_ms is None
