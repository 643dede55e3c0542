"""Admission's queue on the live engine (policy "deadline"): a request that does not fit the
KV reservation waits in admission and starts when capacity frees; a cancelled queued request
leaves no trace in the engine; one that waits past its class's max_queue_ms ends
deadline_expired. The pool is small (48 blocks of 16) so one request fills most of it."""
from __future__ import annotations

import random
import time

import anyio
import pytest

from tests.e2e.engine import Engine
from weir.errors import RequestRejected

pytestmark = pytest.mark.slow

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
tenants = [{ name = "default", classes = ["batch", "short"] }]
"""


@pytest.fixture(scope="module")
def engine(tmp_path_factory, model_path):
    e = Engine(tmp_path_factory.mktemp("admq"), CONFIG)
    yield e
    e.stop()


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def wait_for(engine, component, key, value, timeout=10.0):
    deadline = time.monotonic() + timeout
    while engine.stats(component).get(key, 0) != value:
        assert time.monotonic() < deadline, (component, key, engine.stats(component).get(key))
        time.sleep(0.05)


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
                await anyio.to_thread.run_sync(wait_for, engine, "scheduler", "running", 1)
                tg.start_soon(run, "second", big(c, 2))
                await anyio.to_thread.run_sync(wait_for, engine, "admission", "queued", 1)
            return results

    results = anyio.run(main)
    assert results["first"].finish_reason == "length"
    assert results["second"].finish_reason == "length"
    assert results["second"].ttft_ms > results["first"].e2e_ms * 0.5   # it waited its turn
    wait_for(engine, "admission", "queued", 0)
    engine.wait_kv_free(timeout=2.0)


def test_cancelled_queued_request_never_reaches_the_engine(engine):
    before = engine.stats("scheduler").get("steps", 0)

    async def main():
        async with engine.async_client() as c:
            async with anyio.create_task_group() as tg:
                tg.start_soon(big, c, 3)
                await anyio.to_thread.run_sync(wait_for, engine, "scheduler", "running", 1)
                stream = await c.stream(prompt_token_ids=ids(600, 4), max_tokens=40,
                                        ignore_eos=True, request_id="queued-then-cancelled")
                await anyio.to_thread.run_sync(wait_for, engine, "admission", "queued", 1)
                await stream.cancel()
                result = await stream.collect()
                assert result.finish_reason == "cancelled" and result.token_ids == []
                await anyio.to_thread.run_sync(wait_for, engine, "admission", "queued", 0)

    anyio.run(main)
    assert engine.stats("scheduler").get("steps", 0) > before
    wait_for(engine, "scheduler", "running", 0)
    engine.wait_kv_free(timeout=2.0)
    wait_for(engine, "admission", "outstanding", 0)     # its stats ride the next heartbeat


def test_request_past_max_queue_ms_ends_deadline_expired(engine):
    async def main():
        async with engine.async_client() as c:
            async with anyio.create_task_group() as tg:
                tg.start_soon(big, c, 5)
                await anyio.to_thread.run_sync(wait_for, engine, "scheduler", "running", 1)
                started = time.monotonic()
                with pytest.raises(RequestRejected) as err:
                    await c.generate(prompt_token_ids=ids(600, 6), max_tokens=40,
                                     ignore_eos=True, service_class="short")
                waited = time.monotonic() - started
            return err.value, waited

    err, waited = anyio.run(main)
    assert err.reason == "deadline_expired"
    assert 0.4 <= waited < 2.0
    wait_for(engine, "admission", "queued", 0)
    engine.wait_kv_free(timeout=2.0)
