"""Replicas found, not listed, under load: a router (in this process, so that its resolver
is the test's) in front of two real engines that it learns of only from that resolver.
While four clients keep requests running, a name is added (measured: the time from the
name resolving, the replica being ready already, and from its first heartbeat answer, to
its first routed request), a name is removed (the replica is retired through the
operator's path: what runs there finishes there, or moves as on ``weir replicas
remove``), a name flaps for one poll (nothing happens), and the removed name comes
back. No request is lost: each ends ``length`` with all its tokens, and both pools are
free after. The pure rules: tests/components/router/test_discovery.py."""
from __future__ import annotations

import time

import anyio
import pytest

from components.router.service import RouterService
from schemas.config import (
    EngineConfig,
    ReplicaSpec,
    RouterConfig,
    Topology,
    WeirConfig,
)
from tests.e2e.engine import side_by_side
from tests.e2e.router import start_replica

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
policy = "fcfs"
classes = []
max_outstanding = 40
"""
INTERVAL = 0.25                     # discovery_interval_s
MISSES = 2
TOKENS = 12
LONG = 48
WORKERS = 4


class Resolver:
    """The names the test says resolve, at the engines' addresses; counts its polls."""

    def __init__(self, engines: dict) -> None:
        self.engines = engines
        self.names: tuple[str, ...] = ()
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return {n: ReplicaSpec(n, self.engines[n].endpoint, self.engines[n].kv_events)
                for n in self.names}


@pytest.fixture(scope="module")
def engines(tmp_path_factory, model_path):
    base = tmp_path_factory.mktemp("disc")
    engs = {n: start_replica(base / n, REPLICA_TOML, wait=False) for n in ("r0", "r1")}
    with side_by_side(*engs.values()):
        yield engs


@pytest.mark.anyio
async def test_replicas_found_and_gone_under_load_lose_no_request(engines, tmp_path,
                                                                  model_path):
    from weir import AsyncClient

    resolver = Resolver(engines)
    resolver.names = ("r0",)
    svc = RouterService(WeirConfig(
        Topology(run_dir=str(tmp_path), client_endpoint=f"ipc://{tmp_path}/client.sock"),
        engine=EngineConfig(model=str(model_path), max_model_len=1024),
        router=RouterConfig(discovery="dns", discovery_name="test", policy="least_loaded",
                            discovery_interval_s=INTERVAL, discovery_misses=MISSES)))
    svc.resolver = resolver
    await svc.setup()
    members = svc.members
    results: list = []
    errors: list = []
    sent: list[float] = []                  # when each worker's request was sent
    stop = anyio.Event()

    async def until(cond, what: str, timeout: float = 30.0, every: float = 0.002) -> float:
        start = time.monotonic()
        with anyio.fail_after(timeout):
            while not cond():
                await anyio.sleep(every)
        del what
        return time.monotonic() - start

    def routed(name: str) -> int:
        r = members.get(name)
        return 0 if r is None else r.counts["routed"]

    async def worker(i: int) -> None:
        async with AsyncClient(svc.topology.client_endpoint) as c:
            n = 0
            while not stop.is_set():
                sent.append(time.monotonic())
                try:
                    done = await c.generate(f"Worker {i} asks question {n}: why is the sky "
                                            f"blue?", max_tokens=TOKENS, temperature=0.0,
                                            ignore_eos=True, timeout=60)
                    results.append(done)
                except Exception as exc:     # noqa: BLE001 - every loss is reported
                    errors.append(repr(exc))
                n += 1

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc.run)
            await until(lambda: "r0" in members.replicas and members["r0"].healthy, "r0 up")
            for i in range(WORKERS):
                tg.start_soon(worker, i)
            await until(lambda: len(results) >= 4, "load running")

            # 1. a ready replica's name starts to resolve: found, up, routed to
            found = time.monotonic()
            resolver.names = ("r0", "r1")
            await until(lambda: routed("r1") >= 1, "r1 routed")
            first = time.monotonic()
            r1 = members["r1"]
            to_first = first - found
            up_to_first = first - r1.up_at
            arrival = min((t for t in sent if t >= r1.up_at), default=first)
            print(f"\ndiscovery: name resolving -> first routed request {to_first * 1e3:.0f} ms"
                  f" (found after {(r1.found_at - found) * 1e3:.0f} ms, up after "
                  f"{(r1.up_at - found) * 1e3:.0f} ms; first heartbeat answer -> first "
                  f"routed {up_to_first * 1e3:.0f} ms, of which waiting for the next request "
                  f"{(arrival - r1.up_at) * 1e3:.0f} ms; poll every {INTERVAL * 1e3:.0f} ms)")
            assert to_first < INTERVAL + 2.0

            # 2. a name stops resolving: retired after MISSES polls; a long request open
            # there when it is retired finishes there, and only then is it let go
            long: list = []
            async with AsyncClient(svc.topology.client_endpoint) as c:
                # least_loaded may send several in a row to r1 (it was idle while r0 ran
                # the workers' load), so keep opening until one is placed on r0
                for i in range(48):
                    stream = await c.stream(f"Tell a long story, number {i}.",
                                            max_tokens=LONG, temperature=0.0, ignore_eos=True,
                                            timeout=120)
                    rid = stream.request_id
                    await until(lambda rid=rid: rid in svc.flights and svc.flights[rid].replica,
                                "long routed")
                    long.append(stream)
                    if svc.flights[rid].replica == "r0":
                        break
                on_r0 = long[-1].request_id
                assert svc.flights[on_r0].replica == "r0", \
                    f"none of {len(long)} long requests was routed to r0"
                assert on_r0 in members["r0"].open
                calls = resolver.calls
                resolver.names = ("r1",)
                await until(lambda: members["r0"].retiring, "r0 retiring")
                assert resolver.calls - calls >= MISSES
                open_at_retire = len(members["r0"].open)
                assert on_r0 in members["r0"].open
                ends = [await s.collect() for s in long]
            assert all(e.finish_reason == "length" and len(e.token_ids) == LONG for e in ends)
            await until(lambda: "r0" not in svc.links, "r0 let go")
            print(f"discovery: r0 retired with {open_at_retire} requests open (one of "
                  f"{LONG} tokens); all completed (there, or moved), then it was let go")
            done_before = len(results)
            await until(lambda: len(results) >= done_before + 4, "load on r1 alone")
            assert "r0" not in members.replicas

            # 3. the name comes back: added again
            resolver.names = ("r0", "r1")
            await until(lambda: routed("r0") >= 1, "r0 routed again")

            # 4. a name missing for fewer than MISSES polls changes nothing
            calls = resolver.calls
            resolver.names = ("r0",)
            await until(lambda: resolver.calls >= calls + MISSES - 1, "a short miss",
                        every=0.001)
            resolver.names = ("r0", "r1")
            await until(lambda: resolver.calls >= calls + MISSES + 2, "polls after")
            assert not members["r1"].retiring and not members["r0"].retiring

            done_before = len(results)
            await until(lambda: len(results) >= done_before + 4, "more load")
            stop.set()
            await until(lambda: not svc.flights, "every request ended", timeout=60)
            tg.cancel_scope.cancel()
    finally:
        svc.close()

    assert errors == []
    assert results and all(r.finish_reason == "length" and len(r.token_ids) == TOKENS
                           for r in results), [(r.finish_reason, len(r.token_ids))
                                               for r in results]
    counts = svc.counts
    print(f"discovery: {len(results)} requests completed, 0 lost; discovered "
          f"{counts['discovered']}, retired {counts['undiscovered']}, let go "
          f"{counts['replicas_let_go']}, streams moved off the retired one "
          f"{counts['migrated']}")
    assert counts["discovered"] == 3 and counts["undiscovered"] == 1
    assert counts["failed"] == 0 and counts["rejected"] == 0
    for eng in engines.values():
        eng.wait_kv_free(timeout=30)
