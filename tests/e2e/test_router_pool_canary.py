"""A canary by replica pool (``[rollout] pool``) at a router (in this process) in front of
two real engines, "s0" in pool "stable" and "c0" in pool "canary", under a steady load
from two tenants, half of it doomed (a first-token deadline no prefill meets: the
deadline policy refuses it at once, fcfs serves it late).

- A bad candidate (admission policy fcfs: it admits everything) is applied to the router:
  c0 takes it (a version of its own, by the router), s0 keeps its config untouched, the
  router records a trial; its watchdog sees the canary pool miss deadlines the baseline
  does not and rolls it back within its window (c0 gets its version back).
- A good candidate holds ``promote_after_s`` and is promoted: s0 gets it too.
- c0 restarted by its supervisor mid-trial... is not covered here (a replica that comes up
  in the pool is given the candidate: ``RouterService._join_trial``); a replica added to
  the pool mid-trial is: it gets the candidate before its placements count.

Every request gets exactly one terminal, none fails, and both engines' pools are free
after. The pure rules: tests/components/router/test_pool_canary.py."""
from __future__ import annotations

import time

import anyio
import pytest

from components.router.service import RouterService
from schemas.config import load_config
from tests.e2e.engine import side_by_side
from tests.e2e.router import start_replica
from weir.errors import RequestRejected

OPS = "sk-pool-operator"
POLICY = """
[kv]
num_blocks = 256
num_cpu_blocks = 0
[engine]
max_model_len = 512
num_threads = 1
[admission]
policy = "deadline"
tenants = [{ name = "a" }, { name = "b" }]
classes = [{ name = "interactive", ttft_slo_ms = 20000, late = "drop" }]
"""
WATCH = ('[rollout]\nmode = "canary"\npool = "canary"\nwindow_s = 20.0\nmin_requests = 4\n'
         'max_miss_rate_increase = 0.25\nmax_wait_increase_s = 15.0\n')
BAD = '[admission]\npolicy = "fcfs"\n' + WATCH + 'promote_after_s = 600.0\n'
# half the load is refused on either side (the doomed half), and a window holds 10-25
# placements a side: on loaded cores the two sides' refusal rates were seen 0.22 apart
# (0.89 against 0.67) for a candidate that changes nothing they decide, so the good
# candidate's refusal bar is wider; its miss and wait bars are the bad one's
GOOD = ('[admission]\nkv_safety = 0.15\n' + WATCH + 'promote_after_s = 4.0\n'
        'max_reject_rate_increase = 0.5\n')
DOOMED_MS = 5


@pytest.fixture(scope="module")
def engines(tmp_path_factory, model_path):
    base = tmp_path_factory.mktemp("pool")
    engs = {n: start_replica(base / n, POLICY, wait=False) for n in ("s0", "c0", "c1")}
    with side_by_side(*engs.values()):
        yield engs


async def _history(eng) -> list:
    from weir import AsyncClient

    async with AsyncClient(eng.endpoint) as c:
        return list((await c.config("history")).history)


@pytest.mark.anyio
async def test_a_bad_pool_candidate_is_rolled_back_and_a_good_one_promoted(
        engines, tmp_path, model_path, monkeypatch):
    from weir import AsyncClient

    monkeypatch.setenv("WEIR_OPERATOR_KEY", OPS)
    s0, c0, c1 = engines["s0"], engines["c0"], engines["c1"]
    config = load_config(
        None, topology={"run_dir": str(tmp_path),
                        "client_endpoint": f"ipc://{tmp_path}/client.sock"},
        engine={"model": str(model_path), "max_model_len": 512},
        admission={"policy": "deadline", "tenants": [{"name": "a"}, {"name": "b"}],
                   "classes": [{"name": "interactive", "ttft_slo_ms": 20000,
                                "late": "drop"}]},
        router={"policy": "round_robin", "replicas": [
            {"name": "s0", "endpoint": s0.endpoint, "kv_events": s0.kv_events,
             "pool": "stable"},
            {"name": "c0", "endpoint": c0.endpoint, "kv_events": c0.kv_events,
             "pool": "canary"}]})
    svc = RouterService(config)
    await svc.setup()
    endpoint = svc.topology.client_endpoint
    results: dict[str, str] = {}
    submitted: list[str] = []
    stop = anyio.Event()

    async def until(cond, timeout: float = 60.0, every: float = 0.02) -> float:
        start = time.monotonic()
        while not cond():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"not after {timeout} s: the router's last versions "
                                     f"{svc.live.history.versions[-3:]}, stats "
                                     f"{ {k: v for k, v in svc.stats().items() if 'pool' in k} }")
            await anyio.sleep(every)
        return time.monotonic() - start

    async def one(client, tenant: str, doomed: bool, n: int) -> None:
        rid = f"{tenant}-{'doomed' if doomed else 'ok'}-{n}"
        submitted.append(rid)
        try:
            done = await client.generate(f"Count to ten, number {n}:", request_id=rid,
                                         tenant=tenant, max_tokens=8, temperature=0,
                                         deadline_ms=DOOMED_MS if doomed else None,
                                         timeout=120)
            outcome = f"finished:{done.finish_reason}"
        except RequestRejected as exc:
            outcome = f"rejected:{exc.reason}"
        except Exception as exc:             # noqa: BLE001 - every loss is reported
            outcome = f"lost:{exc!r}"
        assert rid not in results                    # one answer per request
        results[rid] = outcome

    async def load() -> None:
        n = 0
        async with AsyncClient(endpoint) as client:
            while not stop.is_set():
                async with anyio.create_task_group() as tg:
                    for tenant in ("a", "b"):
                        for doomed in (False, True):
                            n += 1
                            tg.start_soon(one, client, tenant, doomed, n)

    def last_router_version():
        return svc.live.history.current

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc.run)
            await until(lambda: all(r.healthy for r in svc.members))
            tg.start_soon(load)
            await until(lambda: len(results) >= 16)
            s0_before = await _history(s0)
            c0_before = await _history(c0)

            # 1. the bad candidate: on c0 only, rolled back by the watchdog
            async with AsyncClient(endpoint, api_key=OPS) as ops:
                trial = (await ops.config("apply", BAD, actor="test")).current
                with pytest.raises(Exception, match="a canary by pool runs on pool 'canary'"):
                    await ops.config("apply", GOOD, actor="test")
            assert trial.rollout == "canary" and "admission.policy" in trial.changed
            assert svc.trial is not None and set(svc.trial.applied) == {"c0"}
            c0_trial = (await _history(c0))[-1]
            assert c0_trial.applied_by.endswith(f"(router canary v{trial.version})")
            assert len(await _history(s0)) == len(s0_before)          # untouched

            # a replica added to the canary pool mid-trial gets the candidate first
            async with AsyncClient(endpoint, api_key=OPS) as ops:
                await ops.change_replicas(add=[f"c1={c1.endpoint},{c1.kv_events},canary"])
            await until(lambda: svc.trial is None or "c1" in svc.trial.applied)
            joined = svc.trial is not None
            if joined:
                assert (await _history(c1))[-1].applied_by.endswith(
                    f"(router canary v{trial.version})")

            await until(lambda: last_router_version().applied_by == "watchdog", timeout=60)
            back = last_router_version()
            took = svc.pool_rollbacks[-1]
            assert (back.rollback_of, back.rollout) == (trial.version - 1, "off")
            assert back.reason.startswith("deadline-miss rate of class interactive"), \
                back.reason
            assert took < 20.0                                         # within the window
            c0_now = await _history(c0)
            assert c0_now[-1].rollback_of == c0_before[-1].version
            assert len(await _history(s0)) == len(s0_before)          # untouched still
            stats = svc.stats()
            assert stats["pool_canary.rolled_back"] == 1 and stats["pool_canary.trial"] == 0
            assert stats["pool_canary.observed.canary"] >= 4
            lost_at_rollback = [r for r in results.values() if r.startswith("lost")]
            print(f"\npool canary: bad candidate rolled back {took:.2f} s after it began "
                  f"({back.reason}); {len(results)} requests ended so far, "
                  f"{len(lost_at_rollback)} lost; c1 joined mid-trial: {joined}")

            # 2. the good candidate: held promote_after_s, then on every pool
            mark = len(results)
            async with AsyncClient(endpoint, api_key=OPS) as ops:
                good = (await ops.config("apply", GOOD, actor="test")).current
            assert good.rollout == "canary" and set(svc.trial.applied) == {"c0", "c1"}
            await until(lambda: last_router_version().promotion_of == good.version,
                        timeout=60)
            promoted = last_router_version()
            assert promoted.applied_by == "watchdog" and promoted.reason.startswith("held ")
            s0_now = await _history(s0)
            assert s0_now[-1].applied_by.endswith(f"(router promotion v{good.version})")
            await until(lambda: len(results) >= mark + 8)
            stop.set()
            # every request the load sent has its answer (the router's flights alone can
            # be empty while a submit is still on its way to it)
            await until(lambda: len(results) == len(submitted) and not svc.flights,
                        timeout=60)
            tg.cancel_scope.cancel()
    finally:
        svc.close()

    assert sorted(results) == sorted(submitted)
    lost = {k: v for k, v in results.items() if not v.startswith(("finished", "rejected"))}
    assert lost == {}
    assert all(v.startswith("finished") for k, v in results.items() if "-ok-" in k)
    assert svc.counts["failed"] == 0
    print(f"pool canary: {len(results)} requests, each ended once, 0 lost; good candidate "
          f"promoted to every pool")
    for eng in engines.values():
        eng.wait_kv_free(timeout=30)
