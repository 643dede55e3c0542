"""Fuzz the decoding boundary of every bus socket: whatever the frame, ``Codec.decode``
returns a message or fails the counted way (``msgspec.DecodeError``, ``malformed`` + 1),
and ``salvage_request_id`` returns a str or None. Never anything else.

Hypothesis draws the seeds (reproducible: ``derandomize``); each seed expands to a batch of
frames from ``FrameGen`` (tests/bus/fuzz_frames.py), so every union gets over 10k frames
in a few seconds. A second, smaller run draws every choice through Hypothesis
(``st.randoms``) so that a failure shrinks to a minimal frame.
"""
from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from bus.codec import Codec, encode, salvage_request_id
from schemas.wire import (
    AdmissionMsg,
    ClientMsg,
    ControlMsg,
    DetokenizerMsg,
    ExecutorMsg,
    KvEventsMsg,
    KvMsg,
    SchedulerMsg,
    StreamerMsg,
    SupervisorMsg,
    TokenizerMsg,
)
from tests.bus.fuzz_frames import FrameGen

UNIONS = {"client": ClientMsg, "tokenizer": TokenizerMsg, "admission": AdmissionMsg,
          "scheduler": SchedulerMsg, "kv_manager": KvMsg, "executor": ExecutorMsg,
          "detokenizer": DetokenizerMsg, "streamer": StreamerMsg, "supervisor": SupervisorMsg,
          "control": ControlMsg, "kv_events": KvEventsMsg}
EXAMPLES, BATCH = 100, 101          # 10,100 frames per union
QUIET = settings(database=None, deadline=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))


class Tally:
    def __init__(self, union) -> None:
        self.codec = Codec(union)
        self.frames = self.failed = self.decoded = self.salvaged = 0

    def feed(self, frame: bytes) -> None:
        """The real receive path: Codec.decode, then salvage on failure (as the streamer)."""
        self.frames += 1
        before = self.codec.malformed
        try:
            self.codec.decode(frame)
            self.decoded += 1
            assert self.codec.malformed == before
        except msgspec.DecodeError:
            self.failed += 1
            assert self.codec.malformed == before + 1
            rid = salvage_request_id(frame)
            assert rid is None or isinstance(rid, str)
            self.salvaged += rid is not None


@pytest.mark.parametrize("name", UNIONS)
def test_ten_thousand_hostile_frames_per_union(name):
    union = UNIONS[name]
    tally = Tally(union)

    @settings(QUIET, max_examples=EXAMPLES)
    @given(st.integers(0, 2**64 - 1))
    def batch(seed: int) -> None:
        gen = FrameGen(random.Random(seed))
        for _ in range(BATCH):
            tally.feed(gen.frame(union))

    batch()
    assert tally.frames >= 10_000
    assert tally.codec.malformed == tally.failed
    # the generator reaches both sides of the boundary
    assert tally.decoded > 1000 and tally.failed > 1000, vars(tally)


@pytest.mark.parametrize("name", UNIONS)
def test_well_typed_hostile_messages_roundtrip(name):
    """Extreme but well-typed values are not the codec's business: they decode, unchanged
    (the handlers behind the socket must cope; scripts/reliability/fuzz_bus.py checks that live)."""
    union = UNIONS[name]
    codec = Codec(union)
    gen = FrameGen(random.Random(name))
    for _ in range(300):
        msg = gen.message(union)
        got = codec.decode(encode(msg)).body
        assert type(got) is type(msg)
        assert msgspec.msgpack.encode(got) == msgspec.msgpack.encode(msg)
    assert codec.malformed == 0


@settings(QUIET, max_examples=150)
@given(st.sampled_from(sorted(UNIONS)), st.randoms(use_true_random=False))
def test_shrinkable_frames(name, rng):
    """Every choice of the generator is a Hypothesis draw here, so a failure shrinks."""
    union = UNIONS[name]
    Tally(union).feed(FrameGen(rng).frame(union))
