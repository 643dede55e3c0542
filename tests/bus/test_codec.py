"""Envelope encoding, checked decoding against a union, and a typed PUSH/PULL socket."""
from __future__ import annotations

import os
import random
import time

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from bus.codec import Codec, encode, salvage_request_id
from bus.socket import BusSocket, MalformedFrame
from schemas.wire import (
    AdmissionMsg,
    Cancel,
    ClientMsg,
    ControlMsg,
    DetokenizerMsg,
    Envelope,
    ExecutorMsg,
    KvEventsMsg,
    KvGrant,
    KvGrants,
    KvMsg,
    SamplingParams,
    SchedulerMsg,
    StepPlan,
    StepResult,
    StreamerMsg,
    Submit,
    SupervisorMsg,
    TokenizerMsg,
)

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def raw_envelope(body) -> bytes:
    return msgspec.msgpack.encode([7, 123, None, body])


# ---------------------------------------------------------------- codec

def test_roundtrip_client_union():
    codec = Codec(ClientMsg)
    sub = Submit("r1", prompt="hi", params=SamplingParams(max_tokens=3, stop=("x",)),
                 tenant="acme")
    before = time.time_ns()
    env = codec.decode(encode(sub, TRACE))
    assert type(env) is Envelope
    assert env.body == sub and type(env.body) is Submit
    assert env.traceparent == TRACE
    assert before <= env.sent_ns <= time.time_ns()
    assert codec.decode(encode(Cancel("r1"))).body == Cancel("r1")
    assert codec.malformed == 0


def test_message_ids_are_unique_and_increasing():
    codec = Codec(ClientMsg)
    ids = [codec.decode(encode(Cancel(str(i)))).msg_id for i in range(3)]
    assert ids[1] == ids[0] + 1 and ids[2] == ids[1] + 1
    assert ids[0] >> 40 == os.getpid() & 0xFFFF


def test_roundtrip_internal_union():
    codec = Codec(SchedulerMsg)
    grants = KvGrants([KvGrant(3, 1, True, [4, 5], 16), KvGrant(3, 2, False, [], 0)])
    assert codec.decode(encode(grants)).body == grants
    res = StepResult(9, [1, 2], [10, 11], 1234)
    env = codec.decode(encode(res))
    assert env.body == res and env.traceparent is None


def test_client_messages_are_maps_with_a_type_tag():
    raw = msgspec.msgpack.decode(encode(Cancel("r9")))
    assert isinstance(raw, list) and len(raw) == 4
    assert raw[3] == {"type": "cancel", "request_id": "r9"}


@pytest.mark.parametrize("data", [
    b"\xc1",                                            # never-used msgpack byte
    b"",                                                # empty frame
    encode(Cancel("r1"))[:-1],                          # truncated
    msgspec.msgpack.encode({"type": "cancel", "request_id": "r1"}),   # no envelope
    raw_envelope({"type": "nope", "request_id": "r1"}),               # unknown tag
    raw_envelope({"type": "cancel", "request_id": 5}),                # wrong field type
    raw_envelope({"type": "cancel"}),                                 # missing field
    raw_envelope({"type": "cancel", "request_id": "r1", "extra": 1}),  # unknown field
], ids=["reserved-byte", "empty", "truncated", "no-envelope", "unknown-tag", "wrong-type",
        "missing-field", "unknown-field"])   # names, not bytes: an envelope holds a timestamp
def test_malformed_raises_and_counts(data):
    codec = Codec(ClientMsg)
    with pytest.raises(msgspec.DecodeError):
        codec.decode(data)
    assert codec.malformed == 1
    assert codec.decode(encode(Cancel("ok"))).body == Cancel("ok")
    assert codec.malformed == 1


def test_wrong_type_for_the_union():
    codec = Codec(ClientMsg)
    with pytest.raises(msgspec.ValidationError):
        codec.decode(encode(StepPlan(1, [], [], [])))
    with pytest.raises(msgspec.DecodeError):
        codec.decode(encode(StepResult(1, [], [], 0)))
    assert codec.malformed == 2
    # and the other way round
    internal = Codec(SchedulerMsg)
    with pytest.raises(msgspec.DecodeError):
        internal.decode(encode(Cancel("r1")))
    assert internal.malformed == 1 and codec.malformed == 2


def test_unknown_field_on_submit_and_salvage():
    codec = Codec(ClientMsg)
    data = raw_envelope({"type": "submit", "request_id": "r42", "prompt": "x", "bogus": True})
    with pytest.raises(msgspec.ValidationError, match="bogus"):
        codec.decode(data)
    assert codec.malformed == 1
    assert salvage_request_id(data) == "r42"
    # unknown field nested in params is refused too
    nested = raw_envelope({"type": "submit", "request_id": "r43",
                           "params": {"max_tokens": 2, "beam": 4}})
    with pytest.raises(msgspec.ValidationError):
        codec.decode(nested)
    assert codec.malformed == 2
    assert salvage_request_id(nested) == "r43"


@pytest.mark.parametrize("data", [
    b"\xc1",
    msgspec.msgpack.encode({"request_id": "r1"}),                 # not an envelope
    msgspec.msgpack.encode([1, 2, None]),                         # short envelope
    raw_envelope({"type": "submit", "request_id": 7}),            # not a string
    raw_envelope(["submit", "r1"]),                               # body not a map
])
def test_salvage_gives_up(data):
    assert salvage_request_id(data) is None


# ---------------------------------------------------------------- socket

@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_pull_drops_malformed_and_returns_valid(tmp_path):
    address = f"ipc://{tmp_path}/inbox.sock"
    pull = BusSocket(zmq.PULL, "test.inbox", ClientMsg).bind(address)
    push = BusSocket(zmq.PUSH, "test.out").connect(address)
    seen: list[MalformedFrame] = []

    async def on_malformed(frame: MalformedFrame) -> None:
        seen.append(frame)

    try:
        junk = random.Random(0).randbytes(64)
        await push._sock.send(junk)
        await push.send(Submit("r1", prompt="hello"), traceparent=TRACE)
        with anyio.fail_after(5):
            got = await pull.recv(on_malformed)
        assert got.body == Submit("r1", prompt="hello")
        assert got.envelope.traceparent == TRACE and got.identity is None
        assert pull.malformed == 1 and push.malformed == 0
        assert [f.data for f in seen] == [junk] and seen[0].identity is None

        # a multi-frame message on a PULL socket is malformed as well
        await push._sock.send_multipart([b"a", encode(Cancel("r1"))])
        await push.send(Cancel("r2"))
        with anyio.fail_after(5):
            got = await pull.recv()
        assert got.body == Cancel("r2")
        assert pull.malformed == 2
    finally:
        push.close()
        pull.close()


# ---------------------------------------------------------------- hostile frames

ALL_UNIONS = [ClientMsg, TokenizerMsg, AdmissionMsg, SchedulerMsg, KvMsg, ExecutorMsg,
              DetokenizerMsg, StreamerMsg, SupervisorMsg, ControlMsg, KvEventsMsg]
ENV = b"\x94\x01\x01\xc0"                  # [1, 1, nil, <body>]
DEEP_ARRAY = b"\x91" * 100_000 + b"\xc0"   # the frame from the reliability issue
DEEP_MAP = b"\x81\xa1k" * 100_000 + b"\xc0"

PATHOLOGICAL = {
    "deep_array": DEEP_ARRAY,
    "deep_map": DEEP_MAP,
    "deep_body": ENV + DEEP_ARRAY,
    "deep_unknown_field": ENV + b"\x83\xa4type\xa9step_plan\xa7step_id\x01\xa1x" + DEEP_ARRAY,
    "deep_request_id": ENV + b"\x82\xa4type\xa6submit\xaarequest_id" + DEEP_ARRAY,
    "deep_envelope_field": b"\x94" + DEEP_ARRAY + b"\x01\xc0\x80",
    "deep_ext": b"\xc7\x05\x01" + b"\x91" * 5,
    "huge_array_len": ENV + b"\xdd\xff\xff\xff\xff",
    "huge_map_len": ENV + b"\xdf\xff\xff\xff\xff",
    "huge_str_len": ENV + b"\xdb\xff\xff\xff\xff",
    "huge_bin_len": ENV + b"\xc6\xff\xff\xff\xff",
    "huge_int_ids": b"\x94\xcf" + b"\xff" * 8 + b"\xd3" + b"\x80" + b"\x00" * 7 + b"\xc0\xc0",
    "float_as_id": b"\x94\xcb" + b"\x7f\xf8" + b"\x00" * 6 + b"\x01\xc0\xc0",
    "invalid_utf8_tag": ENV + b"\x81\xa4type\xa2\xff\xfe",
    "timestamp_ext": ENV + b"\xd6\xff\xff\xff\xff\xff",
    "bad_timestamp_ext": ENV + b"\xc7\x0c\xff" + b"\xff" * 12,
    "nul": b"\x00",
    "empty": b"",
}


@pytest.mark.parametrize("name", PATHOLOGICAL)
def test_pathological_frames_fail_the_counted_way(name):
    data = PATHOLOGICAL[name]
    for union in ALL_UNIONS:
        codec = Codec(union)
        with pytest.raises(msgspec.DecodeError):
            codec.decode(data)
        assert codec.malformed == 1, union
    assert salvage_request_id(data) is None


def test_salvage_never_raises_on_the_issue_frame():
    assert salvage_request_id(DEEP_ARRAY) is None
    assert salvage_request_id(ENV + DEEP_MAP) is None
    # an undecodable submit with a deeply nested unknown field: no id either, but no error
    frame = ENV + b"\x83\xa4type\xa6submit\xaarequest_id\xa2r1\xa1x" + DEEP_ARRAY
    assert salvage_request_id(frame) is None
    # a large but shallow malformed frame is not searched
    big = raw_envelope({"type": "submit", "request_id": "r1", "prompt": "x" * (1 << 20),
                        "bogus": 1})
    assert salvage_request_id(big) is None
    small = raw_envelope({"type": "submit", "request_id": "r1", "prompt": [[["x"]]], "b": 1})
    assert salvage_request_id(small) == "r1"


@pytest.mark.anyio
async def test_router_survives_the_issue_frame_and_a_failing_handler(tmp_path):
    """The streamer's path: ROUTER.recv(on_malformed) salvages and replies. Neither the
    frame nor an exception in the handler stops the receive loop."""
    address = f"ipc://{tmp_path}/clients.sock"
    router = BusSocket(zmq.ROUTER, "test.clients", ClientMsg).bind(address)
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    salvaged: list = []

    async def on_malformed(frame: MalformedFrame) -> None:
        salvaged.append(salvage_request_id(frame.data))
        if len(salvaged) == 2:
            raise RuntimeError("handler bug")

    try:
        for data in (DEEP_ARRAY, *PATHOLOGICAL.values()):
            await dealer.send(data)
        await dealer.send_multipart([b"a", b"b"])
        await dealer.send(encode(Cancel("ok")))
        with anyio.fail_after(10):
            got = await router.recv(on_malformed)
        assert got.body == Cancel("ok") and got.identity is not None
        assert router.malformed == len(PATHOLOGICAL) + 2
        assert salvaged == [None] * (len(PATHOLOGICAL) + 2)
    finally:
        dealer.close(0)
        router.close()
