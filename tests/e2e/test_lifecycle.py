"""Supervisor behaviour: restart by policy with a terminal message for every in-flight
request, drain on SIGTERM, bounded queues, and preemption that keeps outputs exact."""
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import pytest

from tests.e2e.engine import Engine, wait_for
from weir import AsyncClient, RequestFailed, RequestRejected

ROOT = Path(__file__).resolve().parents[2]

SMALL = """
[kv]
num_blocks = 64
[engine]
max_model_len = 1024
[scheduler]
max_num_batched_tokens = 128
[admission]
max_outstanding = 24
# the FCFS baseline: these tests drive the scheduler past what the pool holds (preemption)
# and the engine past its cap; the default deadline policy reserves KV and refuses first
policy = "fcfs"
"""


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory, model_path):
    eng = Engine(tmp_path_factory.mktemp("small"), SMALL)
    yield eng
    eng.stop()


async def _many(endpoint, prompts, **params):
    out = {}

    async def one(i, p, client):
        try:
            out[i] = await client.generate(p, **params)
        except Exception as exc:        # collected and asserted by the caller
            out[i] = exc

    async with AsyncClient(endpoint, max_retries=0) as client:
        async with anyio.create_task_group() as tg:
            for i, p in enumerate(prompts):
                tg.start_soon(one, i, p, client)
    return [out[i] for i in range(len(prompts))]


def test_preemption_keeps_greedy_outputs_exact(small_engine):
    # 12 sequences of ~40 prompt + 100 output tokens need ~108 blocks; the pool has 64.
    prompts = [f"Story number {i}: once upon a time in a land far away, there lived a"
               for i in range(12)]
    params = dict(max_tokens=100, temperature=0.0, ignore_eos=True)
    together = anyio.run(lambda: _many(small_engine.endpoint, prompts, **params))
    sched = small_engine.status()["scheduler"].stats
    assert sched["preemptions"] >= 1
    with small_engine.client() as c:
        alone = [c.generate(p, **params).token_ids for p in prompts[:3]]
    assert [r.token_ids for r in together[:3]] == alone
    assert all(len(r.token_ids) == 100 for r in together)
    small_engine.wait_kv_free(timeout=1.0)


def test_overload_rejected_with_retry_after(small_engine):
    """Past the engine's cap a burst is refused at the edge: the refused requests are never
    tokenized (they used to queue behind the tokenizer before admission said no)."""
    tokenized = small_engine.stats("tokenizer")["tokenized"]
    prompts = ["Tell me about rivers."] * 120
    results = anyio.run(lambda: _many(small_engine.endpoint, prompts, max_tokens=24,
                                      temperature=0.0, ignore_eos=True))
    rejected = [r for r in results if isinstance(r, RequestRejected)]
    done = [r for r in results if not isinstance(r, Exception)]
    assert rejected and done and len(rejected) + len(done) == 120
    assert all(r.reason == "overloaded" and r.retry_after_s >= 1.0 for r in rejected)
    small_engine.wait_stat("tokenizer", "tokenized", tokenized + len(done), timeout=5,
                           at_least=True)
    assert small_engine.stats("tokenizer")["tokenized"] - tokenized < len(done) + 24
    small_engine.wait_kv_free(timeout=1.0)


def test_the_sdk_retries_overload_rejections_after_retry_after(small_engine):
    """Past the cap, the SDK waits out each Retry-After and resubmits (bounded, counted):
    every request completes, and the engine counted the retries."""
    before = small_engine.stats("streamer").get("requests.retries", 0)

    async def main():
        async with AsyncClient(small_engine.endpoint, max_retries=5) as client:
            out = []

            async def one(i):
                out.append(await client.generate(f"Retry {i}: a river", max_tokens=16,
                                                  temperature=0.0, ignore_eos=True))
            async with anyio.create_task_group() as tg:
                for i in range(36):
                    tg.start_soon(one, i)
            return out, client.retries

    done, retries = anyio.run(main)
    assert len(done) == 36 and all(len(r.token_ids) == 16 for r in done)
    assert retries >= 1
    small_engine.wait_stat("streamer", "requests.retries", before + retries, timeout=5)
    small_engine.wait_kv_free(timeout=1.0)


def test_component_crash_fails_in_flight_and_restarts(small_engine):
    pid = small_engine.status()["detokenizer"].pid
    errors, streaming = [], threading.Event()

    def stream():
        with small_engine.client(timeout=30) as c:
            try:
                for _ in c.stream("Write a long essay.", max_tokens=500, temperature=0.0,
                                  ignore_eos=True):
                    streaming.set()
            except RequestFailed as exc:
                errors.append(exc)
            finally:
                streaming.set()

    t = threading.Thread(target=stream)
    t.start()
    assert streaming.wait(60)                  # mid-stream: tokens are flowing
    os.kill(pid, signal.SIGKILL)
    t.join(30)
    assert not t.is_alive()
    assert len(errors) == 1 and "detokenizer" in errors[0].reason
    st = wait_for(lambda: small_engine.status()["detokenizer"], 60, interval=0.2,
                  until=lambda st: st.alive and st.state == "ready" and st.pid != pid,
                  or_last=True)
    assert st.restarts == 1 and st.pid != pid
    small_engine.wait_kv_free(timeout=2.0)
    with small_engine.client() as c:
        assert c.generate("Hello", max_tokens=4, temperature=0.0).usage.completion_tokens >= 1


def test_sigterm_drains_active_streams_then_exits(tmp_path, model_path):
    eng = Engine(tmp_path, SMALL)
    try:
        pids = [c.pid for c in eng.status().values()]
        with eng.client() as c:
            stream = c.stream("Describe the sea.", max_tokens=60, temperature=0.0, ignore_eos=True)
            it = iter(stream)
            next(it)
            eng.proc.send_signal(signal.SIGTERM)

            def refused():            # a request that beat the signal in is served first
                try:
                    c.generate("too late", max_tokens=4)
                except RequestRejected as exc:
                    return exc
                return None

            assert wait_for(refused, what="a rejection while draining").reason == "draining"
            for _ in it:
                pass
            assert stream.result.finish_reason == "length"
            assert stream.result.usage.completion_tokens == 60
        assert eng.proc.wait(30) == 0
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        eng.stop()


def test_sigterm_the_moment_it_is_ready_still_drains_and_exits_cleanly(tmp_path, model_path):
    """The supervisor handles SIGTERM before it prints its ready line: a caller that stops
    it as soon as it reads the line gets a drain and exit status 0, not the default action
    (killed by the signal, status -15, its components taken down by PDEATHSIG)."""
    eng = Engine(tmp_path, SMALL, wait=False)
    try:
        def ready() -> bool:
            if b"weir: ready" in eng.log_path.read_bytes():
                return True
            assert eng.proc.poll() is None, eng.log_path.read_text()[-2000:]
            return False

        # polled every millisecond: the signal lands within ~1 ms of the line (a loop with
        # no pause at all took one of two cores from the startup it waits for)
        wait_for(ready, 240, lambda _: eng.log_path.read_text()[-2000:], interval=0.001)
        eng.proc.send_signal(signal.SIGTERM)
        assert eng.proc.wait(30) == 0, eng.log_path.read_text()[-2000:]
    finally:
        eng.stop()


def test_a_component_that_stays_down_gets_clear_rejections(tmp_path, model_path):
    """Given up on (max_restarts 0), the component ends the engine (issue 43, D3): a request
    meanwhile is refused at once, with the reason and a Retry-After (``overloaded`` naming
    the component, or ``draining`` once the supervisor drains), and `weir serve` exits 3."""
    eng = Engine(tmp_path, SMALL + "[supervisor]\nmax_restarts = 0\n")
    try:
        pid = eng.status()["detokenizer"].pid
        os.kill(pid, signal.SIGKILL)
        with eng.client(timeout=10, max_retries=0) as c:
            def refused_or_exited() -> RequestRejected | bool:
                """The refusal, True once `weir serve` has exited, else False."""
                if eng.proc.poll() is not None:
                    return True
                try:
                    c.generate("Hello?", max_tokens=4)
                except RequestRejected as exc:
                    return exc
                except RequestFailed:
                    pass
                return False

            # until the supervisor has given it up, a request may be let in and then fail
            # with it; from then until `weir serve` exits, each is refused at once
            got = wait_for(refused_or_exited, 30, lambda _: "never refused, never exited",
                           interval=0)
        refused = got if isinstance(got, RequestRejected) else None
        assert refused is not None, "weir serve exited before a request was refused"
        assert (refused.reason == "overloaded" and "detokenizer" in refused.message) \
            or refused.reason == "draining", refused
        assert refused.retry_after_s >= 1
        assert eng.proc.wait(timeout=60) == 3
    finally:
        eng.stop()


def test_a_component_that_cannot_start_says_why_in_one_line(tmp_path, model_path):
    """A setup the operator must fix (here a context longer than the model's) stops
    `weir serve` with exit code 1 and one line naming the component and the reason, not a
    traceback; the other components are stopped with it."""
    cfg = tmp_path / "weir.toml"
    cfg.write_text("[engine]\nmax_model_len = 20000\n[kv]\nnum_blocks = 2048\n"
                   "[gateway]\nenabled = false\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), WEIR_LOG_LEVEL="warning")
    proc = subprocess.run([sys.executable, "-m", "weir.cli", "serve", "--config", str(cfg),
                           "--run-dir", str(tmp_path / "run"),
                           "--endpoint", f"ipc://{tmp_path}/client.sock"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("weir serve: executor could not start: engine.max_model_len 20000 "
                           "exceeds the model's context"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
