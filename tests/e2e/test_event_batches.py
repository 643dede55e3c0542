"""The streamer sends a client that asked (``Submit.batch_events``) one ``Events`` frame per
engine step for its requests, and a client that did not one frame per event; both read
the same tokens. Raw DEALER sockets on the real engine, so the frames are what is seen."""
from __future__ import annotations

import time
import uuid

import msgspec
import zmq

from schemas.client import SamplingParams, Submit
from tests.e2e.engine import wait_for

_PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _submit(sock: zmq.Socket, rid: str, prompt: str, batch: bool) -> None:
    sub = Submit(rid, prompt, params=_PARAMS, batch_events=batch)
    sock.send(msgspec.msgpack.encode([1, time.time_ns(), None, sub]))


def _read_until_finished(sock: zmq.Socket, rids: set[str], timeout_s: float = 60.0):
    """Every frame's body until each of ``rids`` has a terminal event."""
    frames, open_ = [], set(rids)

    def all_ended() -> bool:
        if open_ and sock.poll(200):
            body = msgspec.msgpack.decode(sock.recv())[3]
            frames.append(body)
            for event in body["events"] if body["type"] == "events" else [body]:
                if event["type"] in ("finished", "rejected", "cancelled", "failed"):
                    open_.discard(event["request_id"])
        return not open_

    wait_for(all_ended, timeout_s, lambda _: f"no terminal event for {open_}", interval=0)
    return frames


def _texts(frames: list[dict]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for body in frames:
        for event in body["events"] if body["type"] == "events" else [body]:
            if event["type"] == "delta":
                tokens.setdefault(event["request_id"], []).extend(event["token_ids"])
    return tokens


def test_a_batching_client_gets_a_frame_per_step_and_the_same_tokens(engine):
    ctx = zmq.Context.instance()
    batching, single = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for sock in (batching, single):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(engine.endpoint)
        tag = uuid.uuid4().hex[:8]
        a, b, c = f"a-{tag}", f"b-{tag}", f"c-{tag}"
        _submit(batching, a, "The capital of France is", True)
        _submit(batching, b, "One, two, three,", True)
        _submit(single, c, "The capital of France is", False)
        batched = _read_until_finished(batching, {a, b})
        singles = _read_until_finished(single, {c})
    finally:
        batching.close()
        single.close()

    # a step's events for a and b came together, in order (a frame never holds a request's
    # events out of order: its token ids read as one sequence, checked against c below)
    together = [f for f in batched if f["type"] == "events"
                and {e["request_id"] for e in f["events"]} == {a, b}]
    assert together, [f["type"] for f in batched]
    assert len(batched) < 8 + 8 + 4                 # fewer frames than events
    assert all(f["type"] != "events" for f in singles)
    tokens = _texts(batched)
    assert len(tokens[a]) == len(tokens[b]) == 8
    assert tokens[a] == _texts(singles)[c]         # same prompt, greedy: the same tokens
