"""The same engine over tcp:// endpoints: spawned by `weir serve`, and as separately started
components watched by `weir supervise` (the wiring compose.yaml uses)."""
import os
import random
import signal
import socket
import subprocess
import sys

from schemas.config import COMPONENTS
from tests.e2e.engine import ROOT, Engine, wait_for


def free_base_port(span: int = 11) -> int:
    """A base port whose ``span`` ports are free now, below the kernel's ephemeral range:
    a port in that range can be taken between this probe and the engine's bind by any
    outgoing connection (seen: "Address already in use" on 57120 in a whole-suite run)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    top = ephemeral - span - 1 if ephemeral - span - 1 > 21000 else 60000
    for _ in range(50):
        base = random.randint(20000, top)
        try:
            socks = []
            for p in range(base, base + span):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def tcp_toml(base: int, client_port: int) -> str:
    return f"""
[topology]
transport = "tcp"
base_port = {base}
client_endpoint = "tcp://127.0.0.1:{client_port}"
[kv]
num_blocks = 256
[engine]
max_model_len = 1024
[gateway]
enabled = false
"""


def test_serve_over_tcp(tmp_path, model_path):
    base = free_base_port()
    eng = Engine(tmp_path, tcp_toml(base, base + 10),
                 extra_args=("--endpoint", f"tcp://127.0.0.1:{base + 10}"))
    eng.endpoint = f"tcp://127.0.0.1:{base + 10}"
    try:
        assert not list(tmp_path.glob("*.sock"))          # nothing went over ipc
        with eng.client() as c:
            r = c.generate("The sky is", max_tokens=6, temperature=0.0, ignore_eos=True)
        assert r.usage.completion_tokens == 6
        assert all(st.alive for st in eng.status().values())
    finally:
        eng.stop()


def test_separately_started_components_over_tcp(tmp_path, model_path):
    base = free_base_port()
    endpoint = f"tcp://127.0.0.1:{base + 10}"
    cfg = tmp_path / "weir.toml"
    cfg.write_text(tcp_toml(base, base + 10))
    env = dict(os.environ, PYTHONPATH=str(ROOT), WEIR_LOG_LEVEL="warning")
    cli = [sys.executable, "-m", "weir.cli"]
    procs = [subprocess.Popen(cli + ["supervise", "--config", str(cfg)], cwd=ROOT, env=env)]
    procs += [subprocess.Popen(cli + ["component", name, "--config", str(cfg)], cwd=ROOT, env=env)
              for name in COMPONENTS]
    try:
        from weir import Client

        def components() -> dict:
            with Client(endpoint) as c:
                try:
                    return {x.name: x for x in c.status(timeout=1.0).components}
                except Exception:
                    return {}

        comps = wait_for(components, 180, interval=0.5, or_last=True,    # asserted below
                         until=lambda comps: len(comps) == 7
                         and all(x.state == "ready" for x in comps.values()))
        assert {x.pid for x in comps.values()} == {p.pid for p in procs[1:]}
        with Client(endpoint) as c:
            r = c.generate("Hello there", max_tokens=5, temperature=0.0, ignore_eos=True)
        assert r.usage.completion_tokens == 5
        procs[0].send_signal(signal.SIGTERM)              # drain + stop reaches every component
        for p in procs:
            assert p.wait(30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
