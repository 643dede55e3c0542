"""The kv_manager publishes prefix-cache events (stored / removed blocks, with scope and
tier) on its PUB socket; a subscriber sees a request's prompt blocks enter the cache."""
import msgspec
import zmq

from schemas.wire import Envelope, KvEventsMsg
from tests.e2e.engine import wait_for


def test_stored_events_for_a_finished_request(engine):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"ipc://{engine.run_dir}/kv_events.sock")
    decoder = msgspec.msgpack.Decoder(Envelope[KvEventsMsg])
    # the subscription has reached the kv_manager when its snapshot (the cache so far,
    # earlier tests' blocks included) arrives; what follows is this request's events
    wait_for(lambda: sub.poll(200) and decoder.decode(sub.recv()).body.snapshot, 10,
             lambda _: "no snapshot for the subscription", interval=0)
    prompt = "Event stream check: " + "alpha beta gamma delta " * 12
    with engine.client() as c:
        r = c.generate(prompt, max_tokens=2, temperature=0.0, tenant="acme")
    stored = []
    want = r.usage.prompt_tokens // 16              # full prompt blocks

    def all_stored() -> bool:
        if sub.poll(200):
            msg = decoder.decode(sub.recv()).body
            stored.extend(e for e in msg.events if e[0] == "stored" and e[2] == "acme")
        return len(stored) >= want

    wait_for(all_stored, 5, interval=0, or_last=True)     # asserted below, with what came
    sub.close()
    assert len(stored) >= want > 0
    assert all(tier == "gpu" for _, _, _, tier, _ in stored)
    hashes = [h for _, h, _, _, _ in stored]
    assert stored[0][4] is None and all(p == h for (_, _, _, _, p), h in zip(stored[1:], hashes))


def test_a_subscription_gets_a_snapshot_of_the_cache(engine):
    """A router that starts late (or resubscribes after a gap) learns the whole cache: the
    kv_manager answers each subscription with a snapshot (KvEvents.snapshot)."""
    prompt = "Snapshot check: " + "one two three four five six " * 10
    with engine.client() as c:
        r = c.generate(prompt, max_tokens=2, temperature=0.0, tenant="globex")
    want = r.usage.prompt_tokens // 16
    decoder = msgspec.msgpack.Decoder(Envelope[KvEventsMsg])
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{engine.run_dir}/kv_events.sock")
    try:
        def snapshot():
            return sub.poll(200) and (msg := decoder.decode(sub.recv()).body).snapshot and msg

        snapshots = [wait_for(snapshot, 10, lambda _: "no snapshot after subscribing",
                              interval=0)]
        globex = [e for e in snapshots[0].events if e[2] == "globex"]
        assert len(globex) >= want > 0 and all(e[0] == "stored" for e in globex)
        # subscribing again (what a router does on a gap) brings another one
        sub.setsockopt(zmq.UNSUBSCRIBE, b"")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        wait_for(snapshot, 10, lambda _: "no snapshot after resubscribing", interval=0)
    finally:
        sub.close()
