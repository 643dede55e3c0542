"""Bad input gets a clear terminal error; nothing crashes, hangs or leaks, and the engine
keeps serving."""
import os
import time
import uuid

import msgspec
import pytest
import zmq

from schemas.config import COMPONENTS
from tests.e2e.engine import wait_for
from weir import RequestRejected


@pytest.mark.parametrize("kwargs, reason, words", [
    ({"prompt": ""}, "invalid_request", "empty"),
    ({"prompt": "word " * 1100}, "prompt_too_long", "context window"),
    ({"prompt": "hi", "max_tokens": 0}, "invalid_request", "max_tokens"),
    ({"prompt": "hi", "max_tokens": -5}, "invalid_request", "max_tokens"),
    ({"prompt": "hi", "top_p": 1.5}, "invalid_request", "top_p"),
    ({"prompt": "hi", "temperature": -1.0}, "invalid_request", "temperature"),
    ({"prompt": "hi there", "max_tokens": 1023}, "invalid_request", "context window"),
    ({"prompt": "hi", "tenant": "nobody"}, "unknown_tenant", "nobody"),
    ({"messages": []}, "invalid_request", "messages"),
])
def test_rejections_are_clear(engine, kwargs, reason, words):
    with engine.client() as c:
        with pytest.raises(RequestRejected) as err:
            c.generate(**kwargs)
    assert err.value.reason == reason
    assert words in err.value.message


def _raw_roundtrip(endpoint: str, payload: bytes, timeout_ms: int = 5000):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(payload)
        assert sock.poll(timeout_ms), "no reply"
        return msgspec.msgpack.decode(sock.recv())
    finally:
        sock.close()


def test_unknown_fields_rejected(engine):
    env = [1, time.time_ns(), None, {"type": "submit", "request_id": "r-unknown", "prompt": "hi",
                                     "temperature_typo": 0.5}]
    reply = _raw_roundtrip(engine.endpoint, msgspec.msgpack.encode(env))
    body = reply[3]
    assert body["type"] == "rejected" and body["request_id"] == "r-unknown"
    assert body["reason"] == "invalid_request" and "temperature_typo" in body["message"]


def test_garbage_from_a_client_gets_protocol_error(engine):
    reply = _raw_roundtrip(engine.endpoint, os.urandom(64))
    assert reply[3]["type"] == "protocol_error"


def test_random_bytes_to_every_bus_socket(engine):
    before = engine.status()
    ctx = zmq.Context.instance()
    targets = [engine.run_dir / f"{name}.sock" for name in COMPONENTS] + [
        engine.run_dir / "supervisor.sock"]
    for path in targets:
        assert path.exists(), path
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(f"ipc://{path}")
        for n in (1, 7, 64, 4096):
            sock.send(os.urandom(n))
        sock.send_multipart([b"two", b"frames"])
        sock.send(msgspec.msgpack.encode([1, 2, None, {"type": "no_such_message"}]))
        sock.close()
    # every frame counted (stats ride on heartbeats), then nothing else may have changed
    def counted():
        st = engine.status()
        return st if all(st[name].stats.get("malformed", 0)
                         >= before[name].stats.get("malformed", 0) + 6
                         for name in COMPONENTS) else None

    after = wait_for(counted, what="every component counting the junk")
    for name in COMPONENTS:
        assert after[name].alive and after[name].pid == before[name].pid, name
        assert after[name].restarts == 0
        assert after[name].stats["malformed"] >= before[name].stats.get("malformed", 0) + 6, name
    with engine.client() as c:
        done = c.generate("The sky is", max_tokens=8, temperature=0.0)
    assert done.finish_reason in ("stop", "length") and done.usage.completion_tokens >= 1
    engine.wait_kv_free(timeout=1.0)


def test_duplicate_request_id_rejected_without_disturbing_the_first(engine):
    rid = uuid.uuid4().hex
    with engine.client() as a, engine.client() as b:
        first = a.stream("Write a poem.", request_id=rid, max_tokens=40, temperature=0.0,
                         ignore_eos=True)
        with pytest.raises(RequestRejected, match="already in use"):
            b.generate("again", request_id=rid)
        done = first.collect()
    assert done.finish_reason == "length" and done.usage.completion_tokens == 40
    engine.wait_kv_free(timeout=1.0)
