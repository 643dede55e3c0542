"""Deploys that migrate streams (components/router/migration.py), on whole engines behind
`weir route`: greedy streams of four kinds (free text, a stop string, presence and
frequency penalties, a regex) under load while one replica of three drains (SIGTERM),
while two are scaled to one (``weir replicas remove``: the router retires one and moves
its long streams), while one of three is killed (kill -9) and while one of two is. Every
stream completes with exactly its solo output (token for token, in text, and its finish
reason and usage), each token once, and the survivors' pools are whole again
(``free == total``). Prints the counts: streams migrated, completed, mismatched, the
handover's added latency (the router's, from the move to the next token, and the
client's longest gap in a moved stream against its median gap).

One module of replicas serves the four in turn: each test has its own router in front of
the replicas still up. Four start together (their imports overlap: a replica started
alone costs 10-20 s), the fourth a spare that the kill of one of three takes the place of
the replica the drain took away."""
from __future__ import annotations

import signal
import statistics
import time

import anyio
import pytest

from tests.e2e.engine import side_by_side, wait_for
from tests.e2e.router import Router, start_replica

REPLICA_TOML = """
[kv]
num_blocks = 96
num_cpu_blocks = 0
[engine]
max_model_len = 512
num_threads = 1
[admission]
policy = "fcfs"
classes = []
max_outstanding = 40
[streamer]
drain_timeout_s = 20.0
"""
ROUTER_TOML = """
[router]
heartbeat_timeout_s = 1.0
"""
PROMPTS = [f"Stream {i}: tell me a long story about rivers, deltas and the sea number {i}."
           for i in range(3)]
PLAIN = dict(max_tokens=48, ignore_eos=True, temperature=0.0)
KINDS = {"plain": PLAIN,
         "stop": PLAIN,                  # + a stop string from the plain output (``solo``)
         "penalty": dict(PLAIN, presence_penalty=0.6, frequency_penalty=0.4),
         "regex": dict(max_tokens=48, temperature=0.0,
                       structured={"regex": r"[A-Z][a-z]{1,8}( [a-z]{1,8}){6,9}\."})}
# each kind's three streams submitted one after another: under round robin they land on
# three replicas (or both of two), so the replica that goes holds one of every kind
STREAMS = [(kind, i) for kind in KINDS for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, model_path):
    base = tmp_path_factory.mktemp("replicas")
    t0 = time.monotonic()
    engines = {name: start_replica(base / name, REPLICA_TOML, wait=False)
               for name in ("m0", "m1", "m2", "m3")}
    with side_by_side(*engines.values()):
        print(f"\nfour replicas up in {time.monotonic() - t0:.1f} s")
        yield engines


def stop_string(deltas: list[tuple[int, str]], text: str) -> str:
    """A stop string that first occurs across the boundary of two tokens from the 20th on
    (``deltas``: each delta's token count and text)."""
    at, seen = 0, 0
    for n, t in deltas:
        at, seen = at + len(t), seen + n
        s = text[at - 2:at + 2]
        if seen >= 20 and len(s) == 4 and s.strip() == s and text.find(s) == at - 2:
            return s
    raise AssertionError(f"no stop string found in {text!r}")


@pytest.fixture(scope="module")
def solo(replicas):
    """Each stream's params and output run alone, on one replica."""
    params: dict[tuple[str, int], dict] = {}
    out: dict[tuple[str, int], tuple] = {}
    with replicas["m0"].client() as c:
        for kind, i in STREAMS:
            p = dict(KINDS[kind])
            if kind == "stop":
                s = c.stream(PROMPTS[i], **PLAIN, timeout=120)
                deltas = [(len(d.token_ids), d.text) for d in s]
                p["stop"] = stop_string(deltas, "".join(t for _, t in deltas))
            r = c.generate(PROMPTS[i], **p, timeout=120)
            params[kind, i] = p
            out[kind, i] = (r.token_ids, r.text, r.finish_reason, r.usage.completion_tokens)
    assert {out["stop", i][2] for i in range(3)} == {"stop"}
    assert all(len(out["stop", i][0]) < 48 for i in range(3))
    assert {out["regex", i][2] for i in range(3)} == {"stop"}        # ended by its EOS
    assert all(out["penalty", i][0] != out["plain", i][0] for i in range(3))
    return params, out


def load_through(router: Router, params: dict, act, victim: str) -> dict:
    """The streams at once through ``router``; ``act()`` once ``victim`` holds some of
    them and each has a few tokens. Returns per stream its tokens, text, token times,
    finish reason and completion tokens."""
    out: dict[tuple[str, int], dict] = {}

    async def one(c, key, submitted):
        rec = out[key] = {"ids": [], "text": "", "times": [], "error": None, "end": None}
        try:
            stream = await c.stream(PROMPTS[key[1]], **params[key], timeout=120)
            submitted.set()
            async for d in stream:
                rec["ids"] += list(d.token_ids)
                rec["text"] += d.text
                rec["times"].append(time.monotonic())
            rec["end"] = (stream.result.finish_reason, stream.result.usage.completion_tokens)
        except Exception as exc:  # noqa: BLE001 (recorded and asserted on)
            rec["error"] = f"{type(exc).__name__}: {exc}"
            submitted.set()

    async def main():
        async with router.async_client() as c:
            async with anyio.create_task_group() as tg:
                for key in STREAMS:              # in order: round robin spreads each kind
                    submitted = anyio.Event()
                    tg.start_soon(one, c, key, submitted)
                    await submitted.wait()
                await anyio.to_thread.run_sync(lambda: router.wait(
                    lambda s: s.get(f"replica.{victim}.open", 0) >= 1, f"streams on {victim}",
                    timeout=60))
                with anyio.fail_after(60):
                    while not all(len(out[k]["ids"]) >= 4 or out[k]["end"] for k in STREAMS):
                        await anyio.sleep(0.02)
                await anyio.to_thread.run_sync(act)
    anyio.run(main)
    return out


def check(router: Router, out: dict, solo: dict, survivors: list, what: str) -> None:
    stats = router.stats()
    mismatched = {k: out[k]["error"] or "output" for k in STREAMS
                  if out[k]["error"] or out[k]["ids"] != solo[k][0]
                  or out[k]["text"] != solo[k][1] or out[k]["end"] != solo[k][2:]}
    completed = sum(1 for k in STREAMS if not out[k]["error"])
    migrated = int(stats.get("requests.migrated", 0))
    gaps = []
    for k in STREAMS:
        t = out[k]["times"]
        d = [b - a for a, b in zip(t, t[1:])]
        if d:
            gaps.append(max(d) - statistics.median(d))
    print(f"\n{what}: streams {len(STREAMS)}, migrated {migrated}, completed {completed}, "
          f"mismatched {len(mismatched)}; router handover p50 "
          f"{stats.get('migration.handover_ms.p50')} ms p99 "
          f"{stats.get('migration.handover_ms.p99')} ms; client's added gap p50 "
          f"{statistics.median(gaps) * 1e3:.0f} ms max {max(gaps) * 1e3:.0f} ms; "
          f"reasons { {k: v for k, v in stats.items() if k.startswith('requests.migrated')} }")
    assert not mismatched, mismatched
    assert migrated >= 1
    for eng in survivors:
        eng.wait_kv_free(timeout=60)


def test_drain_one_of_three_moves_its_long_streams(replicas, solo, tmp_path):
    live = {n: replicas[n] for n in ("m0", "m1", "m2")}
    router = Router(tmp_path / "router", live, ROUTER_TOML, policy="round_robin")
    try:
        victim = replicas["m2"]
        out = load_through(router, solo[0], lambda: victim.proc.send_signal(signal.SIGTERM),
                           "m2")
        check(router, out, solo[1], [replicas["m0"], replicas["m1"]], "drain 1 of 3")
        assert wait_for(lambda: victim.proc.poll() is not None, 30, or_last=True)
    finally:
        router.stop()


def test_scale_two_to_one_moves_the_retired_replica_s_streams(replicas, solo, tmp_path):
    """``weir replicas remove`` (the router's ChangeReplicas): the retired replica gets
    nothing new, its long streams move, and it is let go once it holds none."""
    live = {n: replicas[n] for n in ("m0", "m1")}
    router = Router(tmp_path / "router", live, ROUTER_TOML, policy="round_robin")
    try:
        def remove() -> None:
            with router.client() as c:
                done = c.change_replicas(remove=["m1"])
            assert done.replicas == ("m0",) and done.retiring == ("m1",)
        out = load_through(router, solo[0], remove, "m1")
        check(router, out, solo[1], [replicas["m0"], replicas["m1"]], "scale 2 to 1")
        router.wait(lambda s: "replica.m1.healthy" not in s, "m1 let go")
    finally:
        router.stop()


def test_kill_one_of_three_continues_its_streams(replicas, solo, tmp_path):
    live = {n: replicas[n] for n in ("m0", "m1", "m3")}
    router = Router(tmp_path / "router", live, ROUTER_TOML, policy="round_robin")
    try:
        out = load_through(router, solo[0], lambda: live["m3"].proc.kill(), "m3")
        check(router, out, solo[1], [live["m0"], live["m1"]], "kill 1 of 3")
    finally:
        router.stop()


def test_kill_one_of_two_continues_its_streams(replicas, solo, tmp_path):
    live = {n: replicas[n] for n in ("m0", "m1")}
    router = Router(tmp_path / "router", live, ROUTER_TOML, policy="round_robin")
    try:
        out = load_through(router, solo[0], lambda: live["m1"].proc.kill(), "m1")
        check(router, out, solo[1], [live["m0"]], "kill 1 of 2")
    finally:
        router.stop()
