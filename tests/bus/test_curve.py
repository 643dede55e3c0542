"""CURVE on the bus: with [security] curve, tcp sockets are CURVE servers (bind) and
clients (connect); a peer without an authorized key never gets a message through."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.auth

from bus import curve
from bus.codec import encode
from bus.socket import BusSocket
from schemas.config import ConfigError, WeirConfig, load_config
from schemas.wire import Cancel, ClientMsg, ComponentHeartbeat, SupervisorMsg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def plain_afterwards(monkeypatch):
    monkeypatch.delenv(curve.ENV_KEYS_DIR, raising=False)
    curve.reset()
    yield
    curve.reset()


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory):
    return curve.generate(tmp_path_factory.mktemp("keys"))


def config(keys_dir, tmp_path, client_endpoint="tcp://127.0.0.1:7450", client_curve="auto",
           on=True) -> WeirConfig:
    return load_config(topology={"run_dir": str(tmp_path), "client_endpoint": client_endpoint},
                       security={"curve": on, "curve_keys_dir": str(keys_dir),
                                 "client_curve": client_curve})


class Raw:
    """A peer outside Weir: its own context, plain or with whatever keys it has."""

    def __init__(self, kind: int, address: str, server_key: bytes | None = None,
                 keypair: tuple[bytes, bytes] | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(kind)
        self.sock.linger = 0
        if server_key is not None:
            public, secret = keypair or zmq.curve_keypair()
            self.sock.curve_serverkey = server_key
            self.sock.curve_publickey = public
            self.sock.curve_secretkey = secret
        self.sock.connect(address)

    def send(self, data: bytes) -> bool:
        """Without a completed handshake there is no pipe and a send would block: try for
        a moment, then give up. Returns whether the frame was queued."""
        if not self.sock.poll(1000, zmq.POLLOUT):
            return False
        try:            # the pipe can go between the poll and the send, as a refused
            self.sock.send(data, zmq.NOBLOCK)     # handshake drops it (seen in a full run)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


async def received(sock: BusSocket, timeout: float):
    with anyio.move_on_after(timeout):
        return (await sock.recv()).body
    return None


def test_generate_writes_private_secrets_and_authorizes_the_cluster_client(keys_dir):
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE(os.stat(keys_dir / name).st_mode) == 0o600
    assert (keys_dir / "authorized" / "client.key").exists()
    keys = curve.load(keys_dir)
    assert keys.server_secret and keys.client_secret and keys.server_public != keys.client_public
    before = (keys_dir / "server.key_secret").read_bytes()
    curve.generate(keys_dir)                                    # idempotent: keys are kept
    assert (keys_dir / "server.key_secret").read_bytes() == before


def test_config_needs_an_absolute_keys_dir(tmp_path):
    with pytest.raises(ConfigError, match="curve_keys_dir"):
        load_config(topology={"run_dir": str(tmp_path)}, security={"curve": True})
    with pytest.raises(ConfigError, match="curve_keys_dir"):
        load_config(topology={"run_dir": str(tmp_path)},
                    security={"curve": True, "curve_keys_dir": "keys"})
    assert load_config(topology={"run_dir": str(tmp_path)}).security.curve is False


def test_missing_keys_fail_clearly(tmp_path):
    with pytest.raises(curve.CurveError, match="weir keys generate"):
        curve.configure(config(tmp_path / "nope", tmp_path))


@pytest.mark.anyio
async def test_only_authorized_keys_get_through(keys_dir, tmp_path):
    curve.configure(config(keys_dir, tmp_path))
    address = f"tcp://127.0.0.1:{free_port()}"
    inbox = BusSocket(zmq.PULL, "test.inbox", SupervisorMsg).bind(address)
    member = BusSocket(zmq.PUSH, "test.member").connect(address)
    keys = curve.load(keys_dir)
    intruders = [
        Raw(zmq.PUSH, address),                                           # plain tcp
        Raw(zmq.PUSH, address, keys.server_public),                       # unknown client key
        Raw(zmq.PUSH, address, keys.client_public),                       # wrong server key
    ]
    try:
        assert inbox.curve and member.curve
        for raw in intruders:
            raw.send(b"\x91" * 100_000 + b"\xc0")
        assert await received(inbox, 1.5) is None                         # nothing arrives
        assert inbox.malformed == 0                                       # not even as junk
        beat = ComponentHeartbeat("executor", 1, "ready")
        await member.send(beat)
        assert await received(inbox, 10) == beat
        # a peer holding an authorized client keypair (an SDK user's) is let in
        friend = Raw(zmq.PUSH, address, keys.server_public, (keys.client_public,
                                                            keys.client_secret))
        assert friend.send(encode(beat))
        assert await received(inbox, 10) == beat
        friend.close()
    finally:
        for raw in intruders:
            raw.close()
        member.close()
        inbox.close()


@pytest.mark.anyio
async def test_without_curve_a_plain_peer_does_get_through(tmp_path):
    """The control experiment: the same intruder reaches a plain socket."""
    curve.configure(None)
    address = f"tcp://127.0.0.1:{free_port()}"
    inbox = BusSocket(zmq.PULL, "test.inbox", SupervisorMsg).bind(address)
    raw = Raw(zmq.PUSH, address)
    try:
        assert raw.send(encode(ComponentHeartbeat("executor", 1, "ready")))
        assert await received(inbox, 10) == ComponentHeartbeat("executor", 1, "ready")
        assert not inbox.curve
    finally:
        raw.close()
        inbox.close()


@pytest.mark.anyio
async def test_ipc_stays_plain_and_private(keys_dir, tmp_path):
    curve.configure(config(keys_dir, tmp_path))
    path = tmp_path / "inbox.sock"
    inbox = BusSocket(zmq.PULL, "test.inbox", SupervisorMsg).bind(f"ipc://{path}")
    raw = Raw(zmq.PUSH, f"ipc://{path}")
    try:
        assert not inbox.curve
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert raw.send(encode(ComponentHeartbeat("executor", 1, "ready")))
        assert await received(inbox, 10) is not None
    finally:
        raw.close()
        inbox.close()


@pytest.mark.parametrize("endpoint, mode, expected", [
    ("tcp://127.0.0.1:7450", "auto", False),
    ("tcp://localhost:7450", "auto", False),
    ("tcp://0.0.0.0:7450", "auto", True),
    ("tcp://10.1.2.3:7450", "auto", True),
    ("tcp://127.0.0.1:7450", "on", True),
    ("tcp://0.0.0.0:7450", "off", False),
])
def test_client_endpoint_policy(keys_dir, tmp_path, endpoint, mode, expected):
    curve.configure(config(keys_dir, tmp_path, endpoint, mode))
    for kind in (zmq.ROUTER, zmq.DEALER):
        assert (curve._wants(kind, "tcp://streamer:7450") is not None) is expected
    assert curve._wants(zmq.PULL, "tcp://127.0.0.1:7460") is not None     # internal: always
    assert curve._wants(zmq.ROUTER, "ipc:///tmp/x.sock") is None


SDK = """
import sys
import anyio, zmq
from bus.socket import BusSocket
from schemas.wire import Cancel

async def main():
    dealer = BusSocket(zmq.DEALER, "sdk").connect("tcp://127.0.0.1:%d")
    assert dealer.curve
    await dealer.send(Cancel("r1"))
    await anyio.to_thread.run_sync(sys.stdin.readline)     # held open until it was heard
    dealer.close()

anyio.run(main)
"""
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.anyio
async def test_client_endpoint_with_curve_and_an_sdk_keyed_by_environment(keys_dir, tmp_path):
    """The streamer's ROUTER off loopback is a CURVE server; an SDK process with no config
    joins with WEIR_CURVE_KEYS_DIR holding just server.key and its client.key_secret; a
    DEALER without keys is not heard."""
    port = free_port()
    curve.configure(config(keys_dir, tmp_path, f"tcp://0.0.0.0:{port}"))
    router = BusSocket(zmq.ROUTER, "test.clients", ClientMsg).bind(f"tcp://0.0.0.0:{port}")
    sdk_dir = tmp_path / "sdk"
    sdk_dir.mkdir()
    for name in ("server.key", "client.key", "client.key_secret"):
        (sdk_dir / name).write_bytes((keys_dir / name).read_bytes())
    plain = Raw(zmq.DEALER, f"tcp://127.0.0.1:{port}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{curve.ENV_KEYS_DIR: str(sdk_dir)})
    sdk = subprocess.Popen([sys.executable, "-c", SDK % port], cwd=ROOT, env=env,
                           stdin=subprocess.PIPE)
    try:
        assert router.curve
        plain.send(encode(Cancel("intruder")))
        got = await received(router, 20)
        assert got == Cancel("r1")
        assert await received(router, 1.0) is None
        sdk.stdin.close()                                  # the SDK may go now
        assert sdk.wait(20) == 0
    finally:
        if sdk.poll() is None:
            sdk.kill()
        plain.close()
        router.close()


@pytest.mark.anyio
async def test_fails_closed_without_the_authenticator(keys_dir, tmp_path):
    """ZAP is enforced: if the authenticator is gone, even a keyed peer is refused."""
    curve.configure(config(keys_dir, tmp_path))
    address = f"tcp://127.0.0.1:{free_port()}"
    inbox = BusSocket(zmq.PULL, "test.inbox", SupervisorMsg).bind(address)
    curve.shutdown()
    keys = curve.load(keys_dir)
    friend = Raw(zmq.PUSH, address, keys.server_public, (keys.client_public, keys.client_secret))
    try:
        friend.send(encode(ComponentHeartbeat("executor", 1, "ready")))
        assert await received(inbox, 1.5) is None
    finally:
        friend.close()
        inbox.close()


def test_compose_runs_the_bus_over_curve():
    """deploy/compose.toml turns CURVE on; compose.yaml creates the keys once and mounts
    them (read-only) into every Weir service, whose health checks find them by env."""
    import yaml

    cfg = load_config(ROOT / "deploy" / "compose.toml")
    assert cfg.security.curve and cfg.security.curve_keys_dir == "/etc/weir/keys"
    assert cfg.topology.transport == "tcp" and "0.0.0.0" in cfg.topology.client_endpoint
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    assert services["keys"]["command"][:3] == ["weir", "keys", "generate"]
    for name in ("supervisor", "tokenizer", "admission", "scheduler", "kv_manager",
                 "executor", "detokenizer", "streamer", "gateway"):
        svc = services[name]
        assert "./deploy/keys:/etc/weir/keys:ro" in svc["volumes"], name
        assert svc["environment"][curve.ENV_KEYS_DIR] == "/etc/weir/keys", name
        assert svc["depends_on"]["keys"]["condition"] == "service_completed_successfully"
    assert (ROOT / "deploy" / "keys" / ".gitignore").exists()
