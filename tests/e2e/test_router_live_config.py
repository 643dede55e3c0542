"""A router's live config (``weir config --endpoint ROUTER``) in front of two real replicas:
a change every second under load loses no request and gives none two terminals, and each
change is seen to take effect (a fleet cap of 2 refuses with its own words, round robin
decides); a rollback over the CLI puts an earlier version back in force; the router
process killed and restarted goes on with its history and the version in force; only the
deployment's operator key may change it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import anyio
import pytest

from tests.e2e.engine import ROOT, side_by_side, wait_for
from tests.e2e.router import Router, start_replica
from weir.errors import RequestRejected, WeirError

OPS_KEY = "sk-router-operator"
REPLICA_TOML = """
[kv]
num_blocks = 256
num_cpu_blocks = 0
[engine]
max_model_len = 1024
num_threads = 1
[scheduler]
max_num_batched_tokens = 256
[admission]
policy = "deadline"
classes = []
tenants = [{ name = "default" }, { name = "acme" }, { name = "beta" }]
"""
ROUTER_TOML = REPLICA_TOML + """
[router]
tenants = [{ name = "acme", max_outstanding = 64 }, { name = "beta" }]
"""
CAP_2 = ('[router]\npolicy = "round_robin"\n'
         'tenants = [{ name = "acme", max_outstanding = 2 }, { name = "beta" }]\n')
# one a second under load, in turn: every live router field changes at least once
CHANGES = [
    CAP_2,
    '[router]\npolicy = "least_loaded"\nweights = { queue = 3.0, tenant = 0.5 }\n',
    '[router]\ntenants = [{ name = "acme", max_outstanding = 64, weight = 4.0 }, '
    '{ name = "beta", token_rate = 5000.0 }]\nfleet_queue_max = 8\n',
    '[router]\npolicy = "cache_aware"\nkv_high = 0.9\nreroute_attempts = 1\n'
    'default_prefill_tokens_per_s = 1000.0\n',
    '[admission]\nttft_headroom = 0.3\n[router]\noverload_ttft_s = 3.0\n'
    'fleet_queue_max_wait_s = 10.0\n',
    '[router]\ntenants = [{ name = "acme", max_outstanding = 64 }, { name = "beta" }]\n'
    'fleet_queue_max = 1024\nweights = { queue = 1.0, tenant = 0.1 }\n',
]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, model_path):
    base = tmp_path_factory.mktemp("replicas")
    engines = {name: start_replica(base / name, REPLICA_TOML, wait=False)
               for name in ("r0", "r1")}
    with side_by_side(*engines.values()):
        yield engines


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    r = Router(tmp_path_factory.mktemp("router"), replicas, ROUTER_TOML,
               env={"WEIR_OPERATOR_KEY": OPS_KEY})
    yield r
    r.stop()


def _cli(router: Router, *args: str, key: str = OPS_KEY,
         stdin: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), WEIR_API_KEY=key)
    return subprocess.run([sys.executable, "-m", "weir.cli", *args, "--endpoint",
                           router.endpoint], input=stdin, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_changes_every_second_under_load_lose_nothing(router, replicas):
    results: dict[str, str] = {}
    applied: list[int] = []
    cap_refusals: list[str] = []
    churning = True

    async def client(i: int) -> None:
        tenant, n = ("acme", "beta")[i % 2], 0
        async with router.async_client(max_retries=0) as c:
            while churning:
                rid = f"churn-{i}-{n}"
                n += 1
                try:
                    done = await c.generate(f"Story {i}-{n}: once", request_id=rid,
                                            tenant=tenant, max_tokens=6, ignore_eos=True,
                                            temperature=0.0, timeout=120)
                    outcome = f"finished:{done.finish_reason}"
                except RequestRejected as e:
                    outcome = f"rejected:{e.reason}"
                    if "its cap is 2" in str(e):
                        cap_refusals.append(rid)
                    await anyio.sleep(0.05)
                assert rid not in results                      # one answer per request
                results[rid] = outcome

    async def churn() -> None:
        nonlocal churning
        async with router.async_client(api_key=OPS_KEY) as ops:
            await anyio.sleep(1.0)
            for toml in CHANGES:
                answer = await ops.config("apply", toml, actor="churn")
                applied.append(answer.current.version)
                await anyio.sleep(1.0)                         # the change rate under test
        churning = False

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(client, i)
            tg.start_soon(churn)

    anyio.run(main)
    assert applied == list(range(1, len(CHANGES) + 1))
    finished = sum(o.startswith("finished") for o in results.values())
    print(f"\nrouter churn: {len(CHANGES)} changes, {len(results)} requests, {finished} "
          f"finished, {len(cap_refusals)} refused by the cap of 2; outcomes "
          f"{sorted(set(results.values()))}")
    # each ended once, none lost (a failure or a timeout raises in its client)
    assert all(o == "finished:length" or o.startswith("rejected:")
               for o in results.values()), results
    assert finished > len(results) // 2, results
    assert cap_refusals, "the cap of 2 (version 1) refused nothing"
    stats = router.wait(lambda s: s.get("active_requests") == 0
                        and s.get("config_version") == len(CHANGES), "drained")
    assert stats.get("requests.reason.round_robin", 0) > 0          # version 1 decided
    assert sum(v for k, v in stats.items() if k.endswith(".late_events")) == 0
    assert stats.get("requests.failed", 0) == 0
    for eng in replicas.values():                 # every submission ended exactly once
        eng.wait_stat("admission", "outstanding", 0, timeout=10.0)
        eng.wait_kv_free(timeout=10.0)
        s = eng.settled_stats("streamer")
        ended = sum(s.get(f"requests.{k}", 0) for k in
                    ("finished", "rejected", "cancelled", "failed"))
        assert s["active_requests"] == 0 and s["requests.late_events"] == 0
        assert s.get("requests.failed", 0) == 0 and s["requests.submitted"] == ended


def _cap_refusals(router: Router, n: int = 6) -> int:
    """``n`` acme requests at once: how many the fleet cap refuses."""
    refused = 0

    async def one(c, i: int) -> None:
        nonlocal refused
        try:
            await c.generate(f"Cap {i}: once", tenant="acme", max_tokens=24,
                             ignore_eos=True, temperature=0.0, timeout=120)
        except RequestRejected as e:
            assert e.reason == "tenant_over_budget", e
            refused += 1

    async def main() -> None:
        async with router.async_client(max_retries=0) as c, anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, c, i)

    anyio.run(main)
    return refused


def test_rollback_status_history_and_a_restart(router):
    first = json.loads(_cli(router, "config", "history", "--json").stdout.splitlines()[0])
    assert first["version"] == 0 and first["applied_by"] == "startup"
    back = _cli(router, "config", "rollback", "1", "--json", "--actor", "test")
    assert back.returncode == 0, back.stderr
    v = json.loads(back.stdout)
    assert v["rollback_of"] == 1 and v["applied_by"] == "operator:operator (test)"
    status = json.loads(_cli(router, "status", "--json").stdout)["router"]["config"]
    assert (status["version"], status["policy"]) == (v["version"], "round_robin")
    assert status["sha256"] == v["sha256"]
    assert _cap_refusals(router) >= 4                  # the cap of 2 is back in force

    with router.client() as c:
        pid = next(x.pid for x in c.status().components if x.name == "router")
    os.kill(pid, signal.SIGKILL)

    def back_up() -> dict | None:
        try:
            with router.client() as c:
                comp = next(x for x in c.status(timeout=2).components if x.name == "router")
        except (WeirError, StopIteration):
            return None
        return comp.stats if comp.pid != pid and comp.state == "ready" else None

    wait_for(back_up, 60, lambda _: "the router did not come back", interval=0.2)
    history = _cli(router, "config", "history", "--json")
    rows = [json.loads(line) for line in history.stdout.splitlines()]
    assert [r["version"] for r in rows] == list(range(v["version"] + 1)), history.stderr
    router.wait(lambda s: all(s.get(f"replica.{n}.healthy") == 1 for n in ("r0", "r1"))
                and s.get("config_version") == v["version"], "the restarted router ready")
    assert _cap_refusals(router) >= 4                  # still in force after the restart

    zero = _cli(router, "config", "rollback", "0", "--json")
    assert json.loads(zero.stdout)["rollback_of"] == 0
    assert _cap_refusals(router) == 0                  # the TOML's cap of 64


def test_only_the_operator_key_changes_it_and_restart_fields_are_refused(router):
    candidate = '[router]\npolicy = "least_loaded"\n'
    tenant = _cli(router, "config", "apply", "-", key="", stdin=candidate)
    assert tenant.returncode == 1
    assert "config commands need an operator's key" in tenant.stderr
    refused = _cli(router, "config", "apply", "-", stdin=candidate +
                   'heartbeat_timeout_s = 9.0\n[kv]\nblock_size = 32\n')
    assert refused.returncode == 1
    assert ("config not applied: kv.block_size needs a restart (the router hashes prompts "
            "in blocks of the size set at start); router.heartbeat_timeout_s needs a "
            "restart (the replicas' heartbeat and load-report timing is set at start)"
            in refused.stderr), refused.stderr
