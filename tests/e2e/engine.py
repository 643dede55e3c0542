"""Start a real `weir serve` (seven processes) for end-to-end tests."""
from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _timed_out(what, got, timeout: float) -> AssertionError:
    return AssertionError(what(got) if callable(what) else f"{what} did not hold within {timeout}s")


def wait_for(probe, timeout: float = 10.0, what="the condition", interval: float = 0.05, *,
             until=bool, or_last: bool = False):
    """Poll ``probe()`` until ``until`` holds for what it returns (by default: until it is
    truthy) and return that. The one polling loop of the end-to-end tests: they wait for a
    condition, never a fixed time.

    ``probe`` is called at once, then every ``interval`` seconds (0: again at once, for a
    probe that blocks by itself, as a socket poll does). After ``timeout`` seconds it raises
    AssertionError: ``what`` names the condition (``"<what> did not hold within <timeout>s"``)
    or, if callable, makes the whole message from the last value read. With ``or_last`` it
    returns that last value instead, for the caller to assert on."""
    deadline = time.monotonic() + timeout
    while not until(got := probe()):
        if time.monotonic() > deadline:
            if or_last:
                return got
            raise _timed_out(what, got, timeout)
        time.sleep(interval)
    return got


async def await_for(probe, timeout: float = 10.0, what="the condition", interval: float = 0.05,
                    *, until=bool, or_last: bool = False):
    """``wait_for`` inside an event loop: the same, sleeping with ``anyio.sleep``; ``probe``
    may be a coroutine function."""
    import inspect

    import anyio

    async def read():
        got = probe()
        return await got if inspect.isawaitable(got) else got

    deadline = time.monotonic() + timeout
    while not until(got := await read()):
        if time.monotonic() > deadline:
            if or_last:
                return got
            raise _timed_out(what, got, timeout)
        await anyio.sleep(interval)
    return got


async def gaps_of(stream, gaps: list[float]) -> None:
    """Read ``stream`` to its end, appending to ``gaps`` the seconds between its events
    (a neighbour's stream, whose largest gap says whether a flood elsewhere froze it)."""
    last = None
    async for _ in stream:
        now = time.monotonic()
        if last is not None:
            gaps.append(now - last)
        last = now


class Engine:
    def __init__(self, run_dir: Path, config_toml: str = "", extra_args: tuple[str, ...] = (),
                 http_port: int | None = None, gateway_extra: str = "",
                 log_level: str = "warning", full_config: bool = False, preexec_fn=None,
                 wait: bool = True):
        """``full_config``: ``config_toml`` is the whole config (no ``[gateway]`` section
        added). ``preexec_fn`` runs in the child before ``weir serve`` (e.g. rlimits).
        ``wait`` False: return once spawned, and call :meth:`wait_ready` (engines a test
        uses together start side by side: their imports overlap)."""
        self.run_dir = run_dir
        self.endpoint = f"ipc://{run_dir}/client.sock"
        self.log_path = run_dir / "serve.log"
        self.http_port = http_port
        self.base_url = f"http://127.0.0.1:{http_port}" if http_port else None
        cfg = run_dir / "weir.toml"
        gateway = (f"\n[gateway]\nport = {http_port}\n{gateway_extra}" if http_port
                   else "\n[gateway]\nenabled = false\n")
        cfg.write_text(config_toml if full_config or "[gateway]" in config_toml
                       else config_toml + gateway)
        # the engine's service credential (the gateway's): test clients act with it, so they
        # may name any tenant even where API keys are configured
        self.service_key = secrets.token_urlsafe(16)
        env = dict(os.environ, PYTHONPATH=str(ROOT), WEIR_LOG_LEVEL=log_level,
                   WEIR_SERVICE_KEY=self.service_key)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weir.cli", "serve", "--config", str(cfg),
             "--run-dir", str(run_dir), "--endpoint", self.endpoint, *extra_args],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "wb"),
            preexec_fn=preexec_fn)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 240.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weir serve exited: {self.log_path.read_text()[-3000:]}")
            return b"weir: ready" in self.log_path.read_bytes()

        try:
            wait_for(ready, timeout, "weir serve ready", interval=0.2)
        except AssertionError:
            self.stop()
            raise RuntimeError("weir serve did not become ready") from None

    def client(self, **kwargs):
        from weir import Client

        kwargs.setdefault("api_key", self.service_key)
        return Client(self.endpoint, **kwargs)

    def status(self) -> dict:
        with self.client() as c:
            report = c.status()
        return {comp.name: comp for comp in report.components}

    def async_client(self, **kwargs):
        from weir import AsyncClient

        kwargs.setdefault("api_key", self.service_key)
        return AsyncClient(self.endpoint, **kwargs)

    def stats(self, component: str) -> dict[str, float]:
        return self.status()[component].stats

    def wait_stat(self, component: str, key: str, value: float, timeout: float = 1.0,
                  at_least: bool = False) -> None:
        """Stats ride on heartbeats (every 0.1 s), so each component's view is a little
        behind: wait until ``key`` reads ``value`` (or more, with ``at_least``)."""
        wait_for(lambda: self.stats(component).get(key), timeout,
                 lambda got: f"{component}.{key} is {got}, not {value}, after {timeout}s",
                 interval=0.02, until=lambda got: got == value
                 or (at_least and got is not None and got >= value))

    def settled_stats(self, component: str, timeout: float = 5.0) -> dict[str, float]:
        """``component``'s stats once two heartbeats agree: what earlier tests sent has
        landed (a read right after a request can still show the count before it)."""
        reads = [self.stats(component)]

        def again() -> tuple[dict[str, float], dict[str, float]]:
            reads.append(self.stats(component))
            return reads[-2], reads[-1]

        time.sleep(0.15)                           # reads more than one heartbeat apart
        return wait_for(again, max(timeout - 0.15, 0.0), interval=0.15, or_last=True,
                        until=lambda pair: pair[0] == pair[1])[1]

    def kv(self) -> dict[str, float]:
        return self.stats("kv_manager")

    def wait_kv_free(self, timeout: float = 1.0) -> float:
        """Seconds until free == total (raises AssertionError after ``timeout``)."""
        start = time.monotonic()
        wait_for(self.kv, timeout, lambda kv: f"KV not free after {timeout}s: {kv}",
                 interval=0.02, until=lambda kv: kv["free_blocks"] == kv["total_blocks"]
                 and kv["leased_seqs"] == 0 and kv["cpu_free_blocks"] == kv["cpu_total_blocks"])
        return time.monotonic() - start

    def stop(self) -> None:
        stop_process(self.proc)


@contextlib.contextmanager
def side_by_side(*engines: Engine):
    """Engines spawned with ``wait=False``, once all are ready; all stopped after (or if
    one fails to start)."""
    try:
        for eng in engines:
            eng.wait_ready()
        yield engines
    finally:
        for eng in engines:
            eng.stop()


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM (a drain), then SIGKILL if it has not exited within 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
