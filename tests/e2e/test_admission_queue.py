"""Admission's queue on the live engine (policy "deadline"): a request that does not fit the
KV reservation waits in admission and starts when capacity frees; a cancelled queued request
leaves no trace in the engine; one that waits past its class's max_queue_ms ends
deadline_expired; a kill -9 of admission under streams leaves its ledger exact. The pool is
small (48 blocks of 16) so one request fills most of it."""
from __future__ import annotations

import os
import random
import signal
import time

import anyio
import pytest

from tests.e2e.engine import Engine, wait_for
from weir.errors import RequestCancelled, RequestRejected

CONFIG = """
[engine]
max_model_len = 768
[kv]
num_blocks = 48
num_cpu_blocks = 0
[admission]
policy = "deadline"
kv_safety = 0.0
classes = [
  { name = "batch", priority = 10, max_queue_ms = 60000 },
  { name = "short", priority = 10, max_queue_ms = 400 },
]
tenants = [{ name = "default", classes = ["batch", "short"] },
           { name = "capped", classes = ["batch"], kv_blocks = 40, max_running = 5 }]
"""


@pytest.fixture(scope="module")
def engine(tmp_path_factory, model_path):
    e = Engine(tmp_path_factory.mktemp("admq"), CONFIG)
    yield e
    e.stop()


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def stat_is(engine, component, key, value, timeout=10.0):
    """Until ``component``'s stat ``key`` (0 if absent) is ``value``."""
    wait_for(lambda: engine.stats(component).get(key, 0), timeout,
             lambda got: repr((component, key, got)), until=lambda got: got == value)


async def big(c, seed):
    """600 prompt + 40 output tokens: 40 of the pool's 48 blocks reserved."""
    return await c.generate(prompt_token_ids=ids(600, seed), max_tokens=40, ignore_eos=True,
                            temperature=0.0)


def test_queued_request_starts_when_capacity_frees(engine):
    async def main():
        async with engine.async_client() as c:
            async with anyio.create_task_group() as tg:
                results = {}

                async def run(name, coro):
                    results[name] = await coro

                tg.start_soon(run, "first", big(c, 1))
                await anyio.to_thread.run_sync(stat_is, engine, "scheduler", "running", 1)
                tg.start_soon(run, "second", big(c, 2))
                await anyio.to_thread.run_sync(stat_is, engine, "admission", "queued", 1)
            return results

    results = anyio.run(main)
    assert results["first"].finish_reason == "length"
    assert results["second"].finish_reason == "length"
    assert results["second"].ttft_ms > results["first"].e2e_ms * 0.5   # it waited its turn
    stat_is(engine, "admission", "queued", 0)
    engine.wait_kv_free(timeout=2.0)


def test_cancelled_queued_request_never_reaches_the_engine(engine):
    before = engine.stats("scheduler").get("steps", 0)

    async def main():
        async with engine.async_client() as c:
            async with anyio.create_task_group() as tg:
                tg.start_soon(big, c, 3)
                await anyio.to_thread.run_sync(stat_is, engine, "scheduler", "running", 1)
                stream = await c.stream(prompt_token_ids=ids(600, 4), max_tokens=40,
                                        ignore_eos=True, request_id="queued-then-cancelled")
                await anyio.to_thread.run_sync(stat_is, engine, "admission", "queued", 1)
                await stream.cancel()
                result = await stream.collect()
                assert result.finish_reason == "cancelled" and result.token_ids == []
                await anyio.to_thread.run_sync(stat_is, engine, "admission", "queued", 0)

    anyio.run(main)
    assert engine.stats("scheduler").get("steps", 0) > before
    stat_is(engine, "scheduler", "running", 0)
    engine.wait_kv_free(timeout=2.0)
    stat_is(engine, "admission", "outstanding", 0)     # its stats ride the next heartbeat


def test_request_past_max_queue_ms_ends_deadline_expired(engine):
    async def main():
        async with engine.async_client() as c:
            async with anyio.create_task_group() as tg:
                tg.start_soon(big, c, 5)
                await anyio.to_thread.run_sync(stat_is, engine, "scheduler", "running", 1)
                started = time.monotonic()
                with pytest.raises(RequestRejected) as err:
                    await c.generate(prompt_token_ids=ids(600, 6), max_tokens=40,
                                     ignore_eos=True, service_class="short")
                waited = time.monotonic() - started
            return err.value, waited

    err, waited = anyio.run(main)
    assert err.reason == "deadline_expired"
    assert 0.4 <= waited < 2.0
    stat_is(engine, "admission", "queued", 0)
    engine.wait_kv_free(timeout=2.0)


def ledger(stats: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in stats.items()
            if k.startswith("ledger.") or k in ("outstanding", "reserved_kv_blocks")}


def test_a_restarted_admission_resumes_its_ledger_exactly(engine):
    """kill -9 of admission under three streams of a tenant at its KV budget and running
    cap: the scheduler's Holding gives the new admission each request's entry, so it
    reports the ledger the old one had, holds the tenant's next request to its caps as the
    old one would have (counting n = 2, not 1), and is back to zero when they end (cancelled
    once checked: 150 tokens outlast the restart on a busy host, and need not run out)."""
    held = {"ledger.outstanding.capped": 3, "ledger.kv_blocks.capped": 40,
            "ledger.seqs.capped": 4, "ledger.class_outstanding.batch": 3,
            "ledger.class_kv_blocks.batch": 40, "outstanding": 3, "reserved_kv_blocks": 40}

    async def main():
        first, results = {}, {}
        async with engine.async_client(tenant="capped") as c:
            async def run(name, n, max_tokens, seed):
                stream = await c.stream(prompt_token_ids=ids(10, seed), n=n,
                                        max_tokens=max_tokens, ignore_eos=True,
                                        temperature=0.0, request_id=name)
                try:
                    async for _ in stream:
                        first.setdefault(name, time.monotonic())
                    results[name] = stream.result.finish_reason
                except RequestCancelled:
                    results[name] = "cancelled"

            async with anyio.create_task_group() as tg:
                # (10 + 2 x 150) / 16 and (10 + 144) / 16 blocks: 20 + 10 + 10, the tenant's
                # 40 (a token more of prompt changes none); 4 of its 5 seqs
                for name, n, max_tokens, seed in (("pair", 2, 150, 11), ("one", 1, 144, 12),
                                                  ("two", 1, 144, 13)):
                    tg.start_soon(run, name, n, max_tokens, seed)
                assert await anyio.to_thread.run_sync(
                    polled, lambda: len(first), lambda k: k == 3, 120) == 3
                before = await anyio.to_thread.run_sync(
                    polled, lambda: ledger(engine.stats("admission")), held.__eq__)
                assert before == held
                pid = engine.status()["admission"].pid
                os.kill(pid, signal.SIGKILL)

                def admission():
                    a = engine.status()["admission"]
                    return a.pid != pid and a.state == "ready", ledger(a.stats)
                back, after = await anyio.to_thread.run_sync(
                    polled, admission, lambda got: got == (True, held))
                assert not results, f"{sorted(results)} ended before admission was back"
                assert back and after == before
                # n = 2 more seqs than the 5 it may run: queued, as before the kill
                tg.start_soon(run, "next", 2, 4, 14)
                await anyio.to_thread.run_sync(stat_is, engine, "admission", "queued", 1)
                assert not results, f"{sorted(results)} ended while next was decided"
                for name in ("next", "pair", "one", "two"):    # each Released subtracts
                    await c.cancel(name)
        return results

    results = anyio.run(main)
    assert results == dict.fromkeys(("pair", "one", "two", "next"), "cancelled")
    stat_is(engine, "admission", "outstanding", 0)
    final = engine.settled_stats("admission")
    assert ledger(final) == {"outstanding": 0, "reserved_kv_blocks": 0}   # none left over
    assert final["queued"] == 0
    engine.wait_kv_free(timeout=2.0)


def polled(read, done, timeout=30.0):
    """``read()`` until ``done`` holds for what it returns, or ``timeout``: the last value
    read, for the test to assert on (a read that raises, as while admission is down, is
    read again)."""
    def attempt():
        try:
            return read()
        except Exception:
            return None

    return wait_for(attempt, timeout, until=lambda got: got is not None and done(got),
                    or_last=True)
