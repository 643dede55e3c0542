"""Live config changes on a running engine (``weir config``): a change every second under
load loses no request and gives none two terminals, and the ledgers are exact after the
drain; restart-only fields and tenant keys are refused; history and rollback over the
CLI; the history across a streamer restart, and the request log of the load."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys

import anyio
import pytest

from tests.e2e.engine import ROOT, Engine, wait_for
from weir.errors import RequestRejected, WeirError
from weir.replay.traces import load_trace, request_log_block_size

OPERATOR_KEY, TENANT_KEY = "sk-live-operator", "sk-live-tenant"
CONFIG = """
[kv]
num_blocks = 256
[engine]
max_model_len = 512
[admission]
policy = "deadline"
tenants = [{ name = "default" }, { name = "a" }, { name = "b" }]
"""
# what the load runs under, one a second, in turn: every live section changes
CHANGES = [
    '[admission]\npolicy = "fcfs"\n[scheduler]\nfairness = "fcfs"\n',
    '[admission]\npolicy = "deadline"\nttft_headroom = 0.3\n[scheduler]\nchunking = "fixed"\n',
    '[admission]\ntenants = [{ name = "default" }, { name = "a", weight = 4.0 }, '
    '{ name = "b", token_rate = 2000.0, kv_blocks = 64 }]\n[speculative]\nmax_k = 1\n',
    '[scheduler]\nfairness = "vtc"\nchunking = "slack"\nurgency_preemption = false\n',
    '[admission]\nmax_outstanding = 6\nmax_queued = 4\n[speculative]\nmax_k = 2\n',
    '[admission]\nmax_outstanding = 512\ntenants = [{ name = "default" }, { name = "a" }, '
    '{ name = "b" }]\n',
]


def _key(key: str, tenant: str, role: str) -> str:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f'{{ sha256 = "{digest}", tenant = "{tenant}", role = "{role}" }}'


@pytest.fixture(scope="module")
def eng(tmp_path_factory, model_path):
    e = Engine(tmp_path_factory.mktemp("live_config"), CONFIG + (
        f"[gateway]\nenabled = false\napi_keys = [{_key(OPERATOR_KEY, 'ops', 'operator')}, "
        f"{_key(TENANT_KEY, 'a', 'tenant')}]\n"))
    yield e
    e.stop()


def _cli(eng: Engine, *args: str, key: str = OPERATOR_KEY) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), WEIR_API_KEY=key)
    return subprocess.run([sys.executable, "-m", "weir.cli", "config", *args, "--endpoint",
                           eng.endpoint, "--actor", "test"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_changes_every_second_under_load_lose_nothing(eng):
    n_requests, results = 48, {}
    applied: list[int] = []

    async def one(client, i: int) -> None:
        rid = f"live-{i}"
        try:
            done = await client.generate(f"Count to ten, number {i}:", request_id=rid,
                                         tenant="ab"[i % 2], max_tokens=24, temperature=0,
                                         timeout=120)
            outcome = f"finished:{done.finish_reason}"
        except RequestRejected as exc:
            outcome = f"rejected:{exc}"
        assert rid not in results                      # one answer per request
        results[rid] = outcome

    async def load(client) -> None:
        async with anyio.create_task_group() as tg:
            for i in range(n_requests):
                tg.start_soon(one, client, i)
                await anyio.sleep(0.12)                # arrivals spread over the changes

    async def churn(client) -> None:
        async with eng.async_client(api_key=OPERATOR_KEY) as ops:
            for toml in CHANGES:
                answer = await ops.config("apply", toml, actor="churn")
                assert answer.current is not None
                applied.append(answer.current.version)
                await anyio.sleep(1.0)                 # the change rate under test

    async def main() -> None:
        async with eng.async_client() as client, anyio.create_task_group() as tg:
            tg.start_soon(load, client)
            tg.start_soon(churn, client)

    anyio.run(main)
    assert applied == list(range(1, len(CHANGES) + 1))
    assert len(results) == n_requests
    assert sum(o.startswith("finished") for o in results.values()) > n_requests // 2, results
    # every request ended exactly once, and nothing is held anywhere after the drain
    eng.wait_stat("admission", "outstanding", 0, timeout=10.0)
    eng.wait_kv_free(timeout=10.0)
    adm, streamer = eng.settled_stats("admission"), eng.settled_stats("streamer")
    assert (adm["reserved_kv_blocks"], adm["queued"]) == (0, 0)
    assert streamer["active_requests"] == 0 and streamer["requests.late_events"] == 0
    ended = sum(streamer.get(f"requests.{k}", 0) for k in
                ("finished", "rejected", "cancelled", "failed"))
    assert streamer.get("requests.failed", 0) == 0 and streamer.get("requests.cancelled", 0) == 0
    # each submission (a client's retry of a rejection is one more) ended exactly once
    assert streamer["requests.submitted"] == ended == n_requests + streamer["requests.retries"]
    assert streamer["requests.finished"] == sum(o.startswith("finished")
                                                for o in results.values())
    assert adm["config_version"] == eng.stats("scheduler")["config_version"] == len(CHANGES)


def test_restart_only_fields_and_tenant_keys_are_refused(eng):
    with eng.client(api_key=OPERATOR_KEY) as ops:
        before = ops.config("history").current
        with pytest.raises(WeirError) as refused:
            ops.config("apply", '[kv]\nnum_blocks = 1024\n[engine]\ndtype = "bfloat16"\n'
                                '[admission]\npolicy = "fcfs"\n')
        assert str(refused.value) == (
            "config not applied: engine.dtype needs a restart (the model, dtype and device "
            "are loaded at start); kv.num_blocks needs a restart (the KV pool is sized and "
            "allocated at start)")
        assert ops.config("history").current == before             # nothing applied
    with eng.client(api_key=TENANT_KEY) as tenant, pytest.raises(WeirError) as denied:
        tenant.config("apply", '[admission]\npolicy = "fcfs"\n')
    assert str(denied.value) == "config commands need an operator's key"


def test_history_and_rollback_over_the_cli(eng, tmp_path):
    toml = tmp_path / "candidate.toml"
    toml.write_text('[admission]\nkv_safety = 0.25\n')
    apply = _cli(eng, "apply", str(toml))
    assert apply.returncode == 0, apply.stderr
    applied = int(apply.stdout.split()[1])
    assert "by operator:ops (test): admission.kv_safety" in apply.stdout
    back = _cli(eng, "rollback", "--json")
    assert back.returncode == 0, back.stderr
    v = json.loads(back.stdout)
    assert (v["version"], v["rollback_of"], v["changed"]) == (
        applied + 1, applied - 1, ["admission.kv_safety"])
    history = _cli(eng, "history", "--json")
    rows = [json.loads(line) for line in history.stdout.splitlines()]
    assert [r["version"] for r in rows] == list(range(applied + 2))
    assert rows[0]["applied_by"] == "startup" and rows[-1]["sha256"] == rows[-3]["sha256"]
    eng.wait_stat("admission", "config_version", applied + 1, timeout=5.0)
    assert _cli(eng, "history", key=TENANT_KEY).returncode == 1


def test_history_survives_a_streamer_restart_and_the_request_log_records_the_load(eng):
    """Last in the module: it kills the streamer. The history comes back from the run
    directory; the load above is in admission's request log, lengths and ids only."""
    with eng.client(api_key=OPERATOR_KEY) as ops:
        before = ops.config("history")
    assert before.current.version >= len(CHANGES)
    pid = eng.status()["streamer"].pid
    os.kill(pid, signal.SIGKILL)

    def back():
        try:
            comps = eng.status()
            if comps["streamer"].pid == pid or not all(
                    c.alive and c.state == "ready" for c in comps.values()):
                return None
            with eng.client(api_key=OPERATOR_KEY, max_retries=0) as ops:
                return ops.config("history")
        except Exception:                              # not back yet: polled until it is
            return None

    after = wait_for(back, 120, "the restarted streamer's history")
    assert after.history == before.history and after.current == before.current
    eng.wait_stat("admission", "config_version", before.current.version, timeout=5.0)
    with eng.client(api_key=OPERATOR_KEY) as ops:     # and it goes on from there
        made = ops.config("apply", '[admission]\nkv_safety = 0.15\n', actor="after")
    assert made.current.version == before.current.version + 1

    log_path = eng.run_dir / "requests.jsonl"
    assert request_log_block_size(log_path) == 16
    rows = load_trace(log_path)
    live = [r for r in rows if r.tenant in ("a", "b")]
    assert len(live) >= 48                             # the churn's load, each once
    assert all(r.prompt is None and r.input_tokens and r.output_tokens for r in live)
    assert b"Count to ten" not in log_path.read_bytes()
