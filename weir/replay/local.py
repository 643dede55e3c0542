"""A local engine for ``weir calibrate`` and ``weir replay --local``: ``weir serve`` in a
child process on a private ipc endpoint, stopped (SIGINT, then SIGKILL) on exit."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class LocalEngine:
    def __init__(self, config: str | None = None, *, extra_args: tuple[str, ...] = (),
                 run_dir: str | None = None, startup_timeout_s: float = 300.0) -> None:
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="weir-local-"))
        self.endpoint = f"ipc://{self.run_dir}/client.sock"
        self.service_key = secrets.token_urlsafe(16)    # acts for any tenant, as the gateway
        self.log_path = self.run_dir / "serve.log"
        args = [sys.executable, "-m", "weir.cli", "serve", "--run-dir", str(self.run_dir),
                "--endpoint", self.endpoint, *extra_args]
        if config:
            args += ["--config", config]
        env = dict(os.environ, WEIR_SERVICE_KEY=self.service_key,
                   WEIR_LOG_LEVEL=os.environ.get("WEIR_LOG_LEVEL", "warning"))
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(self.log_path, "wb"))
        deadline = time.monotonic() + startup_timeout_s
        while b"weir: ready" not in self.log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the local engine did not start:\n{tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
