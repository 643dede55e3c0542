"""kill -9 of each process under 16 concurrent streams (8 SDK, 8 HTTP): no client hangs,
every request ends as the restart policy says, the engine serves again, and every KV
block comes back.

The policy (docs/ARCHITECTURE.md, "Restart policy"):

| killed | SDK streams | HTTP streams |
|---|---|---|
| tokenizer, admission | finish (nothing past them died) | finish |
| scheduler, kv_manager, executor, detokenizer | fail (their state died) | error event |
| streamer | fail (the client sees a new instance) | error event |
| gateway | finish (the gateway is only a client) | connection lost |
"""
import os
import signal
import time

import anyio
import httpx
import pytest

from tests.e2e.conftest import free_port
from tests.e2e.engine import Engine, await_for, wait_for
from weir import RequestFailed

# Restart policy alone: admission runs fcfs with no classes, so that every one of the 16
# streams is admitted whatever the machine's speed. Under the default deadline policy a
# slow or contended machine refuses some of them at once for their TPOT target (HTTP 503,
# the SDK retrying after Retry-After), correctly, and the kill would not land on 16 running
# streams (CI, 2026-12-05: the streamer's and the gateway's rounds).
CONFIG = """
[admission]
policy = "fcfs"
classes = []
[kv]
num_blocks = 1024
[engine]
max_model_len = 1024
[scheduler]
max_num_batched_tokens = 512
[supervisor]
max_restarts = 10
"""
STREAMS = 8                  # of each kind
MAX_TOKENS = 48              # long enough to be running when the kill lands
HUNG_AFTER_S = 20.0          # a stream with no event for this long, and no end, hangs
FAIL_WITHIN_S = 10.0         # where the policy fails streams, they all end this fast
POLICY = {
    "tokenizer": ("finished", "finished"), "admission": ("finished", "finished"),
    "scheduler": ("failed", "failed"), "kv_manager": ("failed", "failed"),
    "executor": ("failed", "failed"), "detokenizer": ("failed", "failed"),
    "streamer": ("failed", "failed"), "gateway": ("finished", "disconnected"),
}


@pytest.fixture(scope="module")
def eng(tmp_path_factory, model_path):
    e = Engine(tmp_path_factory.mktemp("kill"), CONFIG, http_port=free_port())
    yield e
    e.stop()


async def _sdk_stream(eng, i, started, out):
    async with eng.async_client() as c:
        try:
            stream = await c.stream(f"Story {i}: once upon a time", max_tokens=MAX_TOKENS,
                                    temperature=0.0, ignore_eos=True)
            async for _ in stream:
                started[("sdk", i)] = time.monotonic()
            out[("sdk", i)] = "finished"
        except RequestFailed as exc:
            out[("sdk", i)] = "failed"
            out[("sdk_reason", i)] = exc.reason
        except Exception as exc:            # classified, and asserted by the test
            out[("sdk", i)] = f"error:{type(exc).__name__}:{exc}"


async def _http_stream(http, i, started, out):
    body = {"prompt": f"Story {i}: once upon a time", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                out[("http", i)] = f"http_{r.status_code}"
                out[("http_body", i)] = (await r.aread())[:300]
                return
            state = "eof"
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    state = "failed"
                elif line == "data: [DONE]":
                    state = "finished"
                elif line.startswith("data: "):
                    started[("http", i)] = time.monotonic()
            out[("http", i)] = state
    except (httpx.TransportError, httpx.StreamError):
        out[("http", i)] = "disconnected"


async def _kill_under_load(eng, component):
    started, out = {}, {}            # stream -> time of its last event; stream -> its end
    pid = eng.status()[component].pid
    limits = httpx.Limits(max_connections=2 * STREAMS)
    async with httpx.AsyncClient(base_url=eng.base_url, timeout=60, limits=limits) as http, \
            anyio.create_task_group() as tg:
        for i in range(STREAMS):
            tg.start_soon(_sdk_stream, eng, i, started, out)
            tg.start_soon(_http_stream, http, i, started, out)
        def all_streaming() -> bool:                   # every stream is producing tokens
            assert not out, (sorted(started), out)
            return len(started) >= 2 * STREAMS

        await await_for(all_streaming, 120, lambda _: repr((sorted(started), out)))
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while sum(k[0] in ("sdk", "http") for k in out) < 2 * STREAMS:
            last = max([killed] + [t for k, t in started.items() if k not in out])
            if time.monotonic() - last > HUNG_AFTER_S:
                break                                  # the open ones are hung
            await anyio.sleep(0.05)
        ended_in = time.monotonic() - killed
        tg.cancel_scope.cancel()
    return pid, out, ended_in


def _wait_serving(eng, component, old_pid, timeout=120.0):
    """Seconds until the killed component is back and a request completes end to end."""
    start = time.monotonic()

    def serving() -> bool:
        try:
            comps = eng.status()
            if (comps[component].pid != old_pid
                    and all(c.alive and c.state == "ready" for c in comps.values())):
                with eng.client(timeout=30, max_retries=0) as c:
                    return bool(c.generate("Hello", max_tokens=2, temperature=0.0)
                                .usage.completion_tokens)
        except Exception:                      # not back yet: polled until the timeout
            pass
        return False

    wait_for(serving, timeout, lambda _: f"{component} did not come back", interval=0.2)
    return time.monotonic() - start


@pytest.mark.timeout(600)
@pytest.mark.parametrize("component", list(POLICY))
def test_kill_9_under_load(eng, component):
    pid, out, ended_in = anyio.run(_kill_under_load, eng, component)
    sdk = [out.get(("sdk", i), "hung") for i in range(STREAMS)]
    http = [out.get(("http", i), "hung") for i in range(STREAMS)]
    print(f"\nkill {component}: sdk={sorted(set(sdk))} http={sorted(set(http))} "
          f"all ended {ended_in:.2f}s after the kill")
    assert "hung" not in sdk + http
    want_sdk, want_http = POLICY[component]
    assert sdk == [want_sdk] * STREAMS, sdk
    assert http == [want_http] * STREAMS, http
    if want_sdk == "failed":
        assert ended_in < FAIL_WITHIN_S
    back = _wait_serving(eng, component, pid)
    print(f"kill {component}: serving again {back:.2f}s later")
    eng.wait_kv_free(timeout=10.0)
    # admission's ledger is back to empty too: nothing it counted against a dead component
    eng.wait_stat("admission", "outstanding", 0.0, timeout=10.0)
    eng.wait_stat("admission", "reserved_kv_blocks", 0.0, timeout=10.0)


def test_a_component_left_dead_past_max_restarts_ends_weir_serve_with_status_3(tmp_path):
    """D3 (issue 43): with max_restarts spent, the supervisor gives the component up: the
    requests it held fail at once, /health stops answering 200, and `weir serve` drains
    and exits 3 so that its process manager (a pod's restart policy) starts it again."""
    eng = Engine(tmp_path, CONFIG.replace("max_restarts = 10", "max_restarts = 0"),
                 http_port=free_port())
    try:
        pid = eng.status()["detokenizer"].pid
        health: list[int] = []

        async def main():
            async with eng.async_client() as c, \
                    httpx.AsyncClient(base_url=eng.base_url, timeout=2) as http:
                stream = await c.stream("Story: once upon a time", max_tokens=400,
                                        temperature=0.0, ignore_eos=True)
                async for _ in stream:
                    break                                  # it runs
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                with pytest.raises(RequestFailed):
                    async for _ in stream:
                        pass
                failed_in = time.monotonic() - killed
                while eng.proc.poll() is None:
                    assert time.monotonic() - killed < 60, "weir serve did not exit"
                    try:
                        health.append((await http.get("/health")).status_code)
                    except httpx.TransportError:
                        health.append(0)                   # the gateway is gone
                    await anyio.sleep(0.05)
                return failed_in

        failed_in = anyio.run(main)
        assert eng.proc.wait(timeout=10) == 3
        assert failed_in < FAIL_WITHIN_S
        assert 200 not in health[-1:], health            # never healthy at the end
        assert set(health) <= {200, 503, 0}
        assert b"component_given_up" in eng.log_path.read_bytes()
    finally:
        eng.stop()
