"""The router in front of four real replicas (components/router): cache-aware routing beats
round robin on an agent workload, a loaded replica is passed over even when it holds the
prefix, and a replica killed under load loses no client and stops getting work.

The replicas' pools are small and have no host tier, so a replica cannot keep every
session's context: placing each session where its context is (cache-aware) is what keeps
the prefix cache useful; round robin makes every replica hold every session."""
import contextlib
import json
import os
import signal
import statistics
import threading
import time

import anyio
import pytest

from tests.e2e.engine import ROOT, await_for, side_by_side, wait_for
from tests.e2e.router import Router, start_replica
from weir.replay.live import SdkTarget, replay
from weir.replay.synth import PromptSynth, load_tokenizer
from weir.replay.types import Scaling
from weir.replay.workloads import agent_sessions

REPLICA_TOML = """
[kv]
num_blocks = 64
num_cpu_blocks = 0
[engine]
max_model_len = 1024
num_threads = 1
[scheduler]
max_num_batched_tokens = 256
[admission]
# routing alone: the replicas admit under their caps (fcfs), so where a request runs and
# how long it waits are the router's doing, not a deadline policy refusing work on a
# 64-block, one-thread replica; and no classes, so no TPOT target caps a replica's prefill
# beside its streams (stall-free chunking under the default interactive class's 300 ms):
# on a slower machine that made the router see replicas past its 2 s overload bound and
# move sessions off their prefix (CI, 2026-12-05: 21 moves, hit rate 0.46 in one run)
policy = "fcfs"
classes = []
max_outstanding = 40
tenants = [{ name = "default" }, { name = "acme" }, { name = "globex" }, { name = "initech" }]
"""
BLOCK = 16


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, model_path):
    base = tmp_path_factory.mktemp("replicas")
    engines = {name: start_replica(base / name, REPLICA_TOML, wait=False)
               for name in ("r0", "r1", "r2", "r3")}
    with side_by_side(*engines.values()):
        yield engines


def run_agents(router: Router, model_path, seed: int, salt: int) -> dict:
    """The agent workload ``seed`` through ``router``, its blocks made distinct by ``salt``
    (what one run cached is no help to the next)."""
    requests = agent_sessions(9, 6, tenants=("acme", "globex", "initech"),
                              shared_system=False, system_blocks=2, turn_blocks=(2, 4),
                              output=(2, 4), block_tokens=BLOCK, session_gap_s=0.05, seed=seed)
    requests = [r.__class__(**{**{f: getattr(r, f) for f in r.__struct_fields__},
                               "hash_ids": tuple(h + salt * 10**7 for h in r.hash_ids)})
                for r in requests]
    synth = PromptSynth.for_scaling(load_tokenizer(str(model_path)),
                                    Scaling(block_size=BLOCK, seed=salt))
    run = anyio.run(lambda: replay(requests, SdkTarget(router.endpoint),
                                   lambda r: (synth.token_ids(r), ""), closed_loop=True,
                                   progress=False))
    recs = run.records
    assert all(r.terminal == "completed" for r in recs), [r.reason for r in recs]
    return {"prompt": sum(r.prompt_tokens for r in recs),
            "cached": sum(r.cached_tokens for r in recs), "ttft": [r.ttft_s for r in recs]}


def test_cache_aware_routing_beats_round_robin(replicas, tmp_path, model_path):
    """Both policies on the same two workloads (each run's blocks distinct)."""
    results = {}
    for i, policy in enumerate(("round_robin", "cache_aware")):
        router = Router(tmp_path / policy, replicas, REPLICA_TOML, policy=policy)
        try:
            runs = [run_agents(router, model_path, seed, salt=10 * seed + i)
                    for seed in (11, 12)]
            stats = router.stats()
            print(policy, {k: v for k, v in stats.items() if "reason" in k or "moves" in k
                           or k.endswith(".routed")})
        finally:
            router.stop()
        if policy == "cache_aware":
            assert stats.get("requests.reason.sticky", 0) > 0
        results[policy] = {
            "hit_rate": sum(r["cached"] for r in runs) / sum(r["prompt"] for r in runs),
            "per_run": [round(r["cached"] / r["prompt"], 3) for r in runs],
            "ttft_p50": statistics.median(t for r in runs for t in r["ttft"])}
    print("router hit rate / TTFT p50:", results)
    rr, ca = results["round_robin"], results["cache_aware"]
    # Cache-aware gets near the workload's ceiling (a turn can reuse only the turns before
    # it: 0.73 here). Round robin spreads each session over every replica, so each 64-block
    # pool holds pieces of all nine sessions and evicts them before they are asked for
    # again. 9 sessions on 4 replicas, so that the rotation does not line a session's turns
    # up on one replica. Measured on seeds 11-13: 0.70-0.73 against 0.15-0.28 per run
    # (2.5x at the closest); with 88-block pools, where eviction barely bites, round robin
    # reached 0.42 (docs/perf-log.md, "Router: prefix hit rates"). One run alone can come
    # closer (seed 11 alone on a 2-core EPYC: 0.586 against 0.339, 1.7x), so the test sums
    # two workloads
    # (the same machine: 0.716 against 0.252 over both). On a 2-core AMX Xeon (2026-12-03)
    # round robin's share varies more with the arrival order: 0.342 (one run 0.455), 0.304,
    # 0.311 against 0.670, 0.710, 0.720 (1.96-2.36x). So: cache-aware near the ceiling, and
    # at least 1.5x round robin.
    assert ca["hit_rate"] >= 0.6, results
    assert ca["hit_rate"] >= 1.5 * rr["hit_rate"], results
    assert ca["ttft_p50"] < rr["ttft_p50"], results


@pytest.fixture
def router(replicas, tmp_path):
    r = Router(tmp_path / "router", replicas, REPLICA_TOML)
    yield r
    r.stop()


def routed(stats: dict) -> dict[str, float]:
    return {k.split(".")[1]: v for k, v in stats.items()
            if k.startswith("replica.") and k.endswith(".routed")}


def where_it_went(router: Router, before: dict[str, float]) -> str:
    """The replica whose routed count grew since ``before`` (exactly one must have)."""
    after = router.wait(lambda s: sum(routed(s).values()) > sum(before.values()),
                        "the request counted")
    grew = [n for n, v in routed(after).items() if v > before.get(n, 0)]
    assert len(grew) == 1, (before, after)
    return grew[0]


@contextlib.contextmanager
def held_open(engine, prompts: list[str], max_tokens: int):
    """``prompts`` sent straight to ``engine`` (not through the router) and held open inside
    the block; cancelled after it, and the engine's KV back to free."""
    held, release = threading.Event(), threading.Event()

    def hold():
        async def main():
            async with engine.async_client() as c:
                streams = [await c.stream(p, max_tokens=max_tokens, ignore_eos=True,
                                          tenant="globex") for p in prompts]
                held.set()
                await anyio.to_thread.run_sync(release.wait)
                for s in streams:
                    await c.cancel(s.request_id)
        anyio.run(main)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(60), "the held requests were not all sent"
        yield
    finally:
        release.set()
        t.join(60)
    engine.wait_kv_free(timeout=60)


HISTORY = ("The ledger lists every shipment that left the northern warehouse this quarter, "
           "with its weight, its carrier, the promised date and the date it arrived. ") * 12


def test_a_loaded_replica_is_passed_over_even_with_the_prefix(router, replicas):
    with router.client() as c:
        stats = router.stats()
        before, stored = routed(stats), stats
        c.generate(HISTORY + "Question one?", max_tokens=2, temperature=0.0, tenant="acme")
        warm = where_it_went(router, before)
        # unloaded, the prefix decides: the next turn goes where the history is cached
        key = f"replica.{warm}.index_stored"
        router.wait(lambda s: s.get(key, 0) >= stored.get(key, 0) + 10,
                    "the history in the router's view of its replica")
        before = routed(router.stats())
        r = c.generate(HISTORY + "Question two?", max_tokens=2, temperature=0.0, tenant="acme")
        went = where_it_went(router, before)
        assert (went, r.usage.cached_tokens >= 160) == (warm, True), (went, r.usage)

    # load the warm replica directly (not through the router) far past a 1.5 s deadline
    flood = [f"Flood {i}: " + "numbers and letters " * 150 for i in range(12)]
    with held_open(replicas[warm], flood, max_tokens=32):
        def warm_queue():
            with router.client() as c:
                return {x.name: x for x in c.status().components}.get(f"{warm}/admission")

        # the router sees the load in the replica's report
        wait_for(warm_queue, 60, lambda queue: f"{warm} never looked loaded: {queue}",
                 interval=0.1,
                 until=lambda queue: queue is not None
                 and queue.stats.get("predicted_queue_s", 0) > 3.0)
        with router.client() as c:
            before = routed(router.stats())
            r = c.generate(HISTORY + "Question three?", max_tokens=2, temperature=0.0,
                           tenant="acme", deadline_ms=1500)
            went = where_it_went(router, before)
        assert went != warm, ("a request went to the overloaded replica for its prefix",
                              router.stats())
        assert r.usage.cached_tokens == 0, r.usage     # the price: its prefix computed again


def test_a_rejection_for_load_is_routed_to_another_replica(replicas, tmp_path):
    """Admission's `route`: a replica that refuses a request for load ("overloaded": it holds
    its max_outstanding) is not the end; the router sends the request to the next one.
    Round robin ignores load, so it sends requests to the full replica for certain."""
    hot = replicas["r0"]
    router = Router(tmp_path / "rr", replicas, REPLICA_TOML, policy="round_robin")
    try:
        with held_open(hot, [f"Fill {i}" for i in range(40)], max_tokens=400):  # its cap
            hot.wait_stat("admission", "outstanding", 40, timeout=30)
            with router.client() as c:
                results = [c.generate(f"Route me {i}", max_tokens=2, temperature=0.0,
                                      tenant="acme") for i in range(len(replicas))]
            assert all(r.usage.completion_tokens == 2 for r in results)
            stats = router.wait(lambda s: s.get("requests.rerouted", 0) >= 1, "a reroute")
            assert stats.get("replica.r0.rerouted.overloaded", 0) >= 1
            assert stats.get("replica.r0.finished", 0) == 0
    finally:
        router.stop()


def test_http_gateway_in_front_of_the_router(replicas, tmp_path):
    """`weir route` runs the OpenAI-compatible gateway in front of the router: ready while a
    replica is, and a session header keeps a conversation on one replica."""
    import httpx

    from tests.e2e.conftest import free_port

    router = Router(tmp_path / "http", replicas, REPLICA_TOML, http_port=free_port())
    try:
        wait_for(lambda: httpx.get(f"{router.base_url}/ready").status_code == 200, 30,
                 lambda _: "the router's gateway never became ready", interval=0.1)
        body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": HISTORY + "Summarise."}]}
        for _ in range(3):
            r = httpx.post(f"{router.base_url}/v1/chat/completions", json=body, timeout=60,
                           headers={"X-Session-Id": "conversation-1"})
            assert r.status_code == 200, r.text
        stats = router.wait(lambda s: s.get("requests.submitted", 0) >= 3, "three requests")
        assert stats.get("requests.reason.sticky", 0) == 2 and stats["sessions"] == 1
        assert list(routed(stats).values()) == [3]          # one replica had them all
        import json
        import subprocess
        import sys
        out = subprocess.run([sys.executable, "-m", "weir.cli", "status", "--json",
                              "--endpoint", router.endpoint], capture_output=True, text=True,
                             timeout=60, cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)))
        view = json.loads(out.stdout)["router"]
        assert set(view["replicas"]) == set(replicas) and view["sessions"] == 1
        assert all(r["healthy"] == 1 for r in view["replicas"].values())
    finally:
        router.stop()


def test_bad_input_cancel_and_disconnect_through_the_router(router, replicas):
    """Through the router as at one engine: bad input gets its clear rejection (not rerouted),
    a cancelled or abandoned request frees its KV on the replica, nothing leaks."""
    import msgspec
    import zmq

    from weir import RequestRejected

    with router.client() as c:
        for kwargs, reason in (({"prompt": ""}, "invalid_request"),
                               ({"prompt": "hi", "max_tokens": -5}, "invalid_request"),
                               ({"prompt": "hi", "tenant": "nobody"}, "unknown_tenant"),
                               ({"prompt": "word " * 1100}, "prompt_too_long")):
            with pytest.raises(RequestRejected) as err:
                c.generate(**kwargs)
            assert err.value.reason == reason, (kwargs, err.value)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(router.endpoint)
    try:
        sock.send(os.urandom(64))
        assert sock.poll(5000)
        assert msgspec.msgpack.decode(sock.recv())[3]["type"] == "protocol_error"
        # a client that submits and goes silent: the router cancels it upstream
        sock.send(msgspec.msgpack.encode([1, time.time_ns(), None, {
            "type": "submit", "request_id": "abandoned", "prompt": "Count slowly: one two",
            "params": {"max_tokens": 400, "ignore_eos": True}}]))
        assert sock.poll(10000)
        assert msgspec.msgpack.decode(sock.recv())[3]["type"] == "accepted"
    finally:
        sock.close()

    async def cancel_one():
        async with router.async_client() as ac:
            stream = await ac.stream("Count to a thousand:", max_tokens=400, ignore_eos=True)
            async for _ in stream:
                await ac.cancel(stream.request_id)
                break
            return stream

    anyio.run(cancel_one)
    stats = router.wait(lambda s: s.get("active_requests", 1) == 0
                        and s.get("requests.cancelled", 0) >= 2, "both requests cancelled",
                        timeout=30)
    assert stats.get("requests.rerouted", 0) == 0
    for eng in replicas.values():
        eng.wait_kv_free(timeout=30)


def test_failover_when_a_replica_is_killed_under_load(router, replicas):
    victim_name = "r2"
    victim = replicas[victim_name]
    outcomes: list[str] = []
    stop_load = threading.Event()

    def load():
        from weir.errors import RequestFailed, WeirError

        async def one(c, i):
            try:
                r = await c.generate(f"Load {i}: tell me about rivers and deltas.",
                                     max_tokens=48, ignore_eos=True, temperature=0.0,
                                     tenant="initech", timeout=60)
                outcomes.append(f"finished:{r.usage.completion_tokens}")
            except RequestFailed as exc:
                outcomes.append(f"failed:{exc}")
            except WeirError as exc:
                outcomes.append(f"other:{type(exc).__name__}:{exc}")

        async def main():
            async with router.async_client() as c:
                i = 0
                async with anyio.create_task_group() as tg:
                    while not stop_load.is_set():
                        for _ in range(6):
                            tg.start_soon(one, c, i)
                            i += 1
                        await anyio.sleep(0.5)
        anyio.run(main)

    t = threading.Thread(target=load)
    t.start()
    try:
        router.wait(lambda s: s.get(f"replica.{victim_name}.open", 0) >= 1,
                    f"requests open on {victim_name}")
        victim.proc.kill()                       # kill -9 the replica's supervisor ...
        killed = time.monotonic()
        # ... its components die with it (PDEATHSIG); new requests must succeed on the
        # survivors within 5 s
        first_ok = None
        with router.client() as c:
            def served() -> bool:
                try:
                    c.generate("After the failure: hello", max_tokens=2, tenant="acme",
                               timeout=10)
                    return True
                except Exception:
                    return False

            if wait_for(served, 30 - (time.monotonic() - killed), or_last=True):
                first_ok = time.monotonic() - killed
        stats = router.wait(lambda s: s.get(f"replica.{victim_name}.healthy") == 0,
                            f"{victim_name} out")
        assert stats.get(f"replica.{victim_name}.lost", 0) >= 1
    finally:
        stop_load.set()
        t.join(120)
    assert not t.is_alive(), "a client request never ended"
    print(f"failover: first success {first_ok:.2f} s after the kill; outcomes "
          f"{sorted(set(o.split(':')[0] for o in outcomes))} of {len(outcomes)}")
    assert first_ok is not None and first_ok <= 5.0
    # the victim's streams continue on the survivors (components/router/migration.py)
    assert outcomes and all(o.startswith("finished:48") for o in outcomes), outcomes
    assert router.stats().get("requests.migrated.replica_lost", 0) >= 1
    # the survivors drained clean
    for name, eng in replicas.items():
        if name != victim_name:
            eng.wait_kv_free(timeout=60)


def test_replicas_are_added_and_retired_while_the_router_runs(replicas, tmp_path):
    """`weir replicas add` brings an engine into the routing without a restart; `remove`
    sends it no new request, lets its open one finish, then lets it go; bad changes change
    nothing and say why; an engine's own endpoint says it is not a router."""
    import subprocess
    import sys

    from weir import Client
    from weir.errors import WeirError

    r0, r1 = replicas["r0"], replicas["r1"]
    router = Router(tmp_path / "router", {"r0": r0}, REPLICA_TOML, policy="round_robin")
    try:
        cli = subprocess.run([sys.executable, "-m", "weir.cli", "replicas", "add",
                              f"r1={r1.endpoint},{r1.kv_events}", "--endpoint", router.endpoint],
                             cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout) == {"replicas": ["r0", "r1"], "retiring": [],
                                          "pools": {"r0": "default", "r1": "default"}}
        router.wait(lambda s: s.get("replica.r1.healthy") == 1, "r1 up")
        with router.client() as c:
            for i in range(4):                         # round robin: both get work
                c.generate(f"Count to {i}.", max_tokens=2, temperature=0.0)
            counted = routed(router.wait(lambda s: sum(routed(s).values()) == 4, "4 routed"))
            assert counted == {"r0": 2, "r1": 2}
            for bad, words in (({"add": ["r1=ipc:///x"]}, "already routed to"),
                               ({"add": ["r9=http://x"]}, "tcp:// or ipc://"),
                               ({"remove": ["r7"]}, "no replica 'r7'"),
                               ({"add": ["r8=ipc:///x", "r8=ipc:///y"]}, "twice")):
                with pytest.raises(WeirError, match=words):
                    c.change_replicas(**bad)
            with pytest.raises(ValueError, match="NAME=ENDPOINT"):
                c.change_replicas(add=["r8"])
            stream = c.stream("Write a long story about a lighthouse.", max_tokens=48,
                              ignore_eos=True, temperature=0.0)
            first = next(iter(stream))                 # it runs on one of them
            # stats ride on heartbeats: one that counts the stream's routing (the four
            # before it had ended by then) says where it is open
            now = router.wait(lambda s: sum(routed(s).values()) == 5, "the stream routed")
            busy = next(n for n in ("r0", "r1") if now.get(f"replica.{n}.open") == 1)
            other = "r1" if busy == "r0" else "r0"
            done = c.change_replicas(remove=[busy])
            assert done.replicas == (other,) and done.retiring == (busy,)
            before = routed(router.stats())
            for i in range(3):                         # nothing new goes to the retiring one
                c.generate(f"Name a colour, {i}.", max_tokens=2, temperature=0.0)
            # three more on the other (and the stream too, if the router moved it there:
            # retiring, a long stream is moved where that is cheaper than finishing it)
            after = routed(router.wait(lambda s: routed(s).get(other, 0) >= before[other] + 3,
                                       "three more routed"))
            assert after.get(busy, before[busy]) == before[busy]     # (gone once let go)
            rest = "".join(d.text for d in stream)
            assert stream.result.finish_reason == "length"      # finished, there or moved
            assert len(stream.result.token_ids) == 48 and first.text + rest
            router.wait(lambda s: f"replica.{busy}.healthy" not in s, f"{busy} let go")
        with Client(r0.endpoint) as engine:
            with pytest.raises(WeirError, match="not a router"):
                engine.change_replicas(remove=["r0"])
    finally:
        router.stop()


def test_kill_9_of_the_router_process_under_load(replicas, tmp_path):
    """The kill matrix's router row: kill -9 of the router component (not its supervisor)
    under 8 streams. Every client ends, failed, within 10 s (it sees a new router
    instance); the supervisor starts the router again and it routes; every replica frees
    what the dead router's requests held (their client went silent: reaped). Its own
    router, over the replicas still alive (the failover test kills one)."""
    live = {name: eng for name, eng in replicas.items() if eng.proc.poll() is None}
    router = Router(tmp_path / "router", live, REPLICA_TOML)
    try:
        _kill_the_router_under_load(router, live)
    finally:
        router.stop()


def _kill_the_router_under_load(router: Router, replicas: dict) -> None:
    from weir.errors import RequestFailed

    with router.client() as c:
        pid = next(x.pid for x in c.status().components if x.name == "router")
    out: dict[int, str] = {}
    started: set[int] = set()

    async def stream(i):
        async with router.async_client() as c:
            try:
                s = await c.stream(f"Story {i}: once upon a time", max_tokens=200,
                                   temperature=0.0, ignore_eos=True, tenant="acme")
                async for _ in s:
                    started.add(i)
                out[i] = "finished"
            except RequestFailed:
                out[i] = "failed"

    async def main():
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(stream, i)
            def all_started() -> bool:
                assert not out, (started, out)
                return len(started) >= 8

            await await_for(all_started, 60, lambda _: repr((started, out)))
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            await await_for(lambda: len(out) >= 8, 20, lambda _: f"clients hung: {out}")
            return time.monotonic() - killed

    ended_in = anyio.run(main)
    print(f"\nkill router: {sorted(set(out.values()))}, all ended {ended_in:.2f}s after")
    assert set(out.values()) == {"failed"} and ended_in < 10.0
    def routing_again():
        try:
            with router.client(max_retries=0) as c:
                return c.generate("Back?", max_tokens=2, tenant="acme", timeout=10).usage
        except Exception:
            return None

    # respawned, and routing again
    wait_for(routing_again, 60, lambda _: "the router did not come back", interval=0.2)
    for eng in replicas.values():
        eng.wait_kv_free(timeout=30)
