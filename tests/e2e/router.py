"""Replicas and a `weir route` in front of them, for the router's end-to-end tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.conftest import free_port
from tests.e2e.engine import ROOT, Engine, stop_process, wait_for


def start_replica(run_dir: Path, toml: str, wait: bool = True) -> Engine:
    """A whole engine (ipc inside) that publishes its KV events on a tcp port."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    eng = Engine(run_dir, toml + f'\n[topology]\nkv_events_endpoint = "tcp://127.0.0.1:{port}"\n',
                 wait=wait)
    eng.kv_events = f"tcp://127.0.0.1:{port}"
    return eng


class Router:
    def __init__(self, run_dir: Path, replicas: dict[str, Engine], toml: str = "",
                 policy: str = "cache_aware", http_port: int | None = None,
                 gateway_extra: str = "", env: dict[str, str] | None = None) -> None:
        """``gateway_extra``: more ``[gateway]`` TOML lines (``api_keys``: the router's);
        ``env``: more environment for the router (``WEIR_OPERATOR_KEY``)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.endpoint = f"ipc://{run_dir}/client.sock"
        self.log_path = run_dir / "route.log"
        cfg = run_dir / "router.toml"
        self.base_url = f"http://127.0.0.1:{http_port}" if http_port else None
        cfg.write_text(toml + (f"\n[gateway]\nport = {http_port}\n" if http_port
                               else "\n[gateway]\nenabled = false\n") + gateway_extra)
        args = [sys.executable, "-m", "weir.cli", "route", "--config", str(cfg), "--run-dir",
                str(run_dir), "--endpoint", self.endpoint, "--policy", policy]
        for name, eng in replicas.items():
            args += ["--replica", f"{name}={eng.endpoint},{eng.kv_events}"]
        self.proc = subprocess.Popen(args, cwd=ROOT,
                                     env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
                                     stdout=subprocess.DEVNULL, stderr=open(self.log_path, "wb"))
        def routing() -> bool:
            if b"weir: routing" in self.log_path.read_bytes():
                return True
            if self.proc.poll() is not None:
                raise AssertionError("weir route exited")
            return False

        try:
            wait_for(routing, 120, interval=0.1)
        except AssertionError:
            self.stop()
            raise RuntimeError(f"weir route did not start: {self.log_path.read_text()[-3000:]}") \
                from None
        self.wait(lambda s: all(s.get(f"replica.{n}.healthy") == 1 for n in replicas)
                  and all(s.get(f"replica.{n}.index_snapshots", 0) >= 1 for n in replicas),
                  "every replica up and its cache view synced")

    def client(self, **kwargs):
        from weir import Client

        return Client(self.endpoint, **kwargs)

    def async_client(self, **kwargs):
        from weir import AsyncClient

        return AsyncClient(self.endpoint, **kwargs)

    def stats(self) -> dict[str, float]:
        with self.client() as c:
            report = c.status()
        # empty until the router's supervisor has relayed its first cluster status
        return next((comp.stats for comp in report.components if comp.name == "router"), {})

    def wait(self, cond, what: str, timeout: float = 30.0) -> dict[str, float]:
        """Poll the router's stats (they ride on heartbeats) until ``cond(stats)``."""
        return wait_for(self.stats, timeout, lambda stats: f"not {what} after {timeout}s: {stats}",
                        until=cond)

    def stop(self) -> None:
        stop_process(self.proc)
