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


def wait_for(probe, timeout: float = 10.0, what: str = "the condition", interval: float = 0.05):
    """Poll ``probe()`` until it returns something truthy and return that; AssertionError
    naming ``what`` after ``timeout`` seconds. (Tests wait for a condition, never a fixed
    time.)"""
    deadline = time.monotonic() + timeout
    while not (got := probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout}s")
        time.sleep(interval)
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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weir serve exited: {self.log_path.read_text()[-3000:]}")
            if b"weir: ready" in self.log_path.read_bytes():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("weir serve did not become ready")

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
        deadline = time.monotonic() + timeout
        while not ((got := self.stats(component).get(key)) == value
                   or (at_least and got is not None and got >= value)):
            if time.monotonic() > deadline:
                raise AssertionError(f"{component}.{key} is {got}, not {value}, after {timeout}s")
            time.sleep(0.02)

    def settled_stats(self, component: str, timeout: float = 5.0) -> dict[str, float]:
        """``component``'s stats once two heartbeats agree: what earlier tests sent has
        landed (a read right after a request can still show the count before it)."""
        deadline = time.monotonic() + timeout
        prev = self.stats(component)
        while True:
            time.sleep(0.15)                       # more than one heartbeat apart
            cur = self.stats(component)
            if cur == prev or time.monotonic() > deadline:
                return cur
            prev = cur

    def kv(self) -> dict[str, float]:
        return self.stats("kv_manager")

    def wait_kv_free(self, timeout: float = 1.0) -> float:
        """Seconds until free == total (raises AssertionError after ``timeout``)."""
        start = time.monotonic()
        while True:
            kv = self.kv()
            if (kv["free_blocks"] == kv["total_blocks"] and kv["leased_seqs"] == 0
                    and kv["cpu_free_blocks"] == kv["cpu_total_blocks"]):
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise AssertionError(f"KV not free after {timeout}s: {kv}")
            time.sleep(0.02)

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
