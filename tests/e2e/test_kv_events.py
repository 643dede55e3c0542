"""The kv_manager publishes prefix-cache events (stored / removed blocks, with scope and
tier) on its PUB socket; a subscriber sees a request's prompt blocks enter the cache."""
import time

import msgspec
import zmq

from schemas.wire import Envelope, KvEventsMsg


def test_stored_events_for_a_finished_request(engine):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"ipc://{engine.run_dir}/kv_events.sock")
    time.sleep(0.3)                                   # let the subscription reach the PUB
    decoder = msgspec.msgpack.Decoder(Envelope[KvEventsMsg])
    prompt = "Event stream check: " + "alpha beta gamma delta " * 12
    with engine.client() as c:
        r = c.generate(prompt, max_tokens=2, temperature=0.0, tenant="acme")
    stored = []
    deadline = time.monotonic() + 5
    want = r.usage.prompt_tokens // 16              # full prompt blocks
    while time.monotonic() < deadline and len(stored) < want:
        if sub.poll(200):
            msg = decoder.decode(sub.recv()).body
            stored += [e for e in msg.events if e[0] == "stored" and e[2] == "acme"]
    sub.close()
    assert len(stored) >= want > 0
    assert all(tier == "gpu" for _, _, _, tier, _ in stored)
    hashes = [h for _, h, _, _, _ in stored]
    assert stored[0][4] is None and all(p == h for (_, _, _, _, p), h in zip(stored[1:], hashes))
