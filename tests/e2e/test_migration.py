"""Deploys that migrate streams (components/router/migration.py), on whole engines behind
`weir route`: greedy streams under load while one of three replicas drains (SIGTERM) and
then one of the two left is killed (kill -9): every stream completes with exactly its solo
output, token for token and in text, each token once, and the survivors' pools are whole
again (``free == total``). Prints the counts: streams migrated, completed, mismatched, and
the handover's added latency (the router's, from the move to the next token, and the
client's longest gap in a moved stream against its median gap)."""
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
           for i in range(6)]
PARAMS = dict(max_tokens=48, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, model_path):
    base = tmp_path_factory.mktemp("replicas")
    engines = {name: start_replica(base / name, REPLICA_TOML, wait=False)
               for name in ("m0", "m1", "m2")}
    with side_by_side(*engines.values()):
        yield engines


@pytest.fixture(scope="module")
def solo(replicas):
    """Each prompt's output run alone, on one replica."""
    with replicas["m0"].client() as c:
        return {p: (r.token_ids, r.text) for p in PROMPTS
                for r in [c.generate(p, **PARAMS, timeout=120)]}


def load_through(router: Router, act, victim: str) -> dict:
    """The streams at once through ``router``; ``act()`` once ``victim`` holds some of
    them and each has a few tokens. Returns per prompt its tokens, text, token times."""
    out: dict[str, dict] = {}

    async def one(c, p):
        rec = out[p] = {"ids": [], "text": "", "times": [], "error": None}
        try:
            stream = await c.stream(p, **PARAMS, timeout=120)
            async for d in stream:
                rec["ids"] += list(d.token_ids)
                rec["text"] += d.text
                rec["times"].append(time.monotonic())
        except Exception as exc:  # noqa: BLE001 (recorded and asserted on)
            rec["error"] = f"{type(exc).__name__}: {exc}"

    async def main():
        async with router.async_client() as c:
            async with anyio.create_task_group() as tg:
                for p in PROMPTS:
                    tg.start_soon(one, c, p)
                await anyio.to_thread.run_sync(lambda: router.wait(
                    lambda s: s.get(f"replica.{victim}.open", 0) >= 1, f"streams on {victim}",
                    timeout=60))
                with anyio.fail_after(60):
                    while not all(len(out.get(p, {}).get("ids", ())) >= 4 for p in PROMPTS):
                        await anyio.sleep(0.02)
                act()
    anyio.run(main)
    return out


def check(router: Router, out: dict, solo: dict, survivors: list, what: str) -> None:
    stats = router.stats()
    mismatched = [p for p in PROMPTS if out[p]["error"] or out[p]["ids"] != solo[p][0]
                  or out[p]["text"] != solo[p][1]]
    completed = sum(1 for p in PROMPTS if not out[p]["error"])
    migrated = int(stats.get("requests.migrated", 0))
    gaps = []
    for p in PROMPTS:
        t = out[p]["times"]
        d = [b - a for a, b in zip(t, t[1:])]
        if d:
            gaps.append(max(d) - statistics.median(d))
    print(f"\n{what}: streams {len(PROMPTS)}, migrated {migrated}, completed {completed}, "
          f"mismatched {len(mismatched)}; router handover p50 "
          f"{stats.get('migration.handover_ms.p50')} ms p99 "
          f"{stats.get('migration.handover_ms.p99')} ms; client's added gap p50 "
          f"{statistics.median(gaps) * 1e3:.0f} ms max {max(gaps) * 1e3:.0f} ms; "
          f"reasons { {k: v for k, v in stats.items() if k.startswith('requests.migrated')} }")
    assert not mismatched, {p: out[p]["error"] for p in mismatched}
    assert migrated >= 1
    for eng in survivors:
        eng.wait_kv_free(timeout=60)


def test_drain_one_of_three_moves_its_long_streams(replicas, solo, tmp_path):
    router = Router(tmp_path / "router", replicas, ROUTER_TOML, policy="round_robin")
    try:
        victim = replicas["m2"]
        out = load_through(router, lambda: victim.proc.send_signal(signal.SIGTERM), "m2")
        check(router, out, solo, [replicas["m0"], replicas["m1"]], "drain 1 of 3")
        assert wait_for(lambda: victim.proc.poll() is not None, 30, or_last=True)
    finally:
        router.stop()


def test_kill_one_of_two_continues_its_streams(replicas, solo, tmp_path):
    live = {n: e for n, e in replicas.items() if n != "m2"}
    router = Router(tmp_path / "router", live, ROUTER_TOML, policy="round_robin")
    try:
        out = load_through(router, lambda: live["m1"].proc.kill(), "m1")
        check(router, out, solo, [live["m0"]], "kill 1 of 2")
    finally:
        router.stop()
