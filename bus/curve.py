"""CURVE on the bus: authenticated, encrypted ZeroMQ between Weir's processes.

With ``[security] curve = true`` every socket Weir *binds* on tcp is a CURVE server and
every socket it *connects* over tcp is a CURVE client; ``BusSocket.bind``/``connect``
apply this, so no component code knows about it. ipc:// (a local socket file, reachable
only through the run directory's permissions) and inproc:// stay plain.

Keys live in one directory (``weir keys generate DIR``, see ``generate``)::

    server.key, server.key_secret    the cluster's server keypair (processes that bind)
    client.key, client.key_secret    the cluster's client keypair (processes that connect)
    authorized/*.key                 public keys allowed to connect (client.key, and any
                                     external client's, e.g. an SDK user's)

Each process that binds a CURVE socket runs a ZAP authenticator (a thread) that admits
only the public keys in ``authorized/``; anything else fails the handshake and nothing it
sends is ever delivered. The client endpoint (the streamer's ROUTER and the SDK's DEALER)
follows ``security.client_curve``: "auto" encrypts it unless it is bound on loopback,
"on"/"off" force it. Both sides decide from the same config, so they always agree.

A process with no config (the SDK, ``weir status``) takes its keys from the environment:
``WEIR_CURVE_KEYS_DIR`` (holding at least ``server.key`` and ``client.key_secret``); it
then uses CURVE for every tcp endpoint, the client endpoint included.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

if TYPE_CHECKING:
    from schemas.config import WeirConfig

log = structlog.get_logger("curve")

ENV_KEYS_DIR = "WEIR_CURVE_KEYS_DIR"
ZAP_DOMAIN = b"weir"
CLIENT_KINDS = (zmq.ROUTER, zmq.DEALER)      # only the client endpoint uses these


class CurveError(RuntimeError):
    pass


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes | None        # None where only server.key (public) is present
    client_public: bytes
    client_secret: bytes
    authorized: Path | None            # None: this process cannot authenticate clients


def generate(keys_dir: str | os.PathLike[str]) -> Path:
    """Create a cluster's keys in ``keys_dir`` (secrets mode 0600); returns the directory.
    Existing keys are kept, so running it twice is harmless."""
    d = Path(keys_dir)
    (d / "authorized").mkdir(parents=True, exist_ok=True)
    for name in ("server", "client"):
        if not (d / f"{name}.key_secret").exists():
            _, secret = zmq.auth.create_certificates(d, name)
            os.chmod(secret, 0o600)
    shutil.copyfile(d / "client.key", d / "authorized" / "client.key")
    return d


def load(keys_dir: str | os.PathLike[str], *, server: bool = True) -> CurveKeys:
    """Read a key directory. ``server=False`` (a client only) needs just ``server.key`` and
    ``client.key_secret``."""
    d = Path(keys_dir)
    try:
        server_public, server_secret = zmq.auth.load_certificate(
            d / ("server.key_secret" if server else "server.key"))
        client_public, client_secret = zmq.auth.load_certificate(d / "client.key_secret")
    except (OSError, ValueError) as exc:
        raise CurveError(f"cannot read CURVE keys in {d} ({exc}); create them with "
                         f"`weir keys generate {d}`") from exc
    if client_secret is None or (server and server_secret is None):
        raise CurveError(f"{d}: a *.key_secret file holds no secret key")
    authorized = d / "authorized"
    if server and not any(authorized.glob("*.key")):
        raise CurveError(f"{authorized} holds no authorized client keys")
    return CurveKeys(server_public, server_secret, client_public, client_secret,
                     authorized if server else None)


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        """Back to unconfigured (the lock stays: a waiter on it must not be let through)."""
        self.configured = False             # explicitly, by configure()
        self.keys: CurveKeys | None = None
        self.client_curve = False
        self.auth: ThreadAuthenticator | None = None


_STATE = _State()


def _is_loopback(address: str) -> bool:
    if not address.startswith("tcp://"):
        return True                         # ipc, inproc: local by construction
    host = urlsplit(address).hostname or ""
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def configure(config: WeirConfig | None = None) -> None:
    """Set this process's bus security from a ``WeirConfig`` (None: no CURVE, and the
    environment is not consulted). Call before the first socket binds or connects."""
    with _STATE.lock:
        _stop_auth()
        _STATE.configured = True
        _STATE.keys = None
        _STATE.client_curve = False
        sec = config.security if config is not None else None
        if config is None or sec is None or not sec.curve:
            return
        _STATE.keys = load(sec.curve_keys_dir)
        mode = sec.client_curve
        _STATE.client_curve = mode == "on" or (
            mode == "auto" and not _is_loopback(config.topology.client_endpoint))
        log.info("curve_enabled", keys_dir=sec.curve_keys_dir,
                 client_endpoint_curve=_STATE.client_curve)


def reset() -> None:
    """Forget the configuration (tests): the next socket looks at the environment again."""
    with _STATE.lock:
        _stop_auth()
        _STATE.clear()


def active() -> CurveKeys | None:
    """This process's keys, or None when the bus is plain."""
    with _STATE.lock:
        if not _STATE.configured:
            _STATE.configured = True
            if keys_dir := os.environ.get(ENV_KEYS_DIR):
                server = (Path(keys_dir) / "server.key_secret").exists()
                _STATE.keys = load(keys_dir, server=server)
                _STATE.client_curve = True
        return _STATE.keys


def _wants(kind: int, address: str) -> CurveKeys | None:
    keys = active()
    if keys is None or not address.startswith("tcp://"):
        return None
    if kind in CLIENT_KINDS and not _STATE.client_curve:
        return None
    return keys


def prepare_bind(sock: zmq.Socket[Any], kind: int, address: str, context: zmq.Context[Any]) -> bool:
    """Make ``sock`` a CURVE server if the address calls for it (before ``bind``); starts
    this process's authenticator on first use. Returns whether CURVE is on."""
    keys = _wants(kind, address)
    if keys is None:
        return False
    if keys.server_secret is None or keys.authorized is None:
        raise CurveError(f"cannot bind {address} with CURVE: no server secret key here")
    _ensure_auth(context, keys)
    sock.zap_domain = ZAP_DOMAIN
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)     # no authenticator: refuse, never admit
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    return True


def prepare_connect(sock: zmq.Socket[Any], kind: int, address: str) -> bool:
    """Make ``sock`` a CURVE client of the cluster's server key if the address calls for
    it (before ``connect``). Returns whether CURVE is on."""
    keys = _wants(kind, address)
    if keys is None:
        return False
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public
    return True


def _ensure_auth(context: zmq.Context[Any], keys: CurveKeys) -> None:
    with _STATE.lock:
        if _STATE.auth is not None:
            return
        auth = ThreadAuthenticator(context)
        for attempt in range(50):
            try:
                auth.start()
                break
            except zmq.ZMQError as exc:
                # a stopped authenticator's ZAP endpoint is released asynchronously
                if exc.errno != zmq.EADDRINUSE or attempt == 49:
                    raise
                auth.stop()
                time.sleep(0.02)
        authorized = keys.authorized
        assert authorized is not None               # prepare_bind refuses a key set without it
        auth.configure_curve(domain=ZAP_DOMAIN.decode(), location=str(authorized))
        _STATE.auth = auth
        log.info("zap_started", authorized=len(list(authorized.glob("*.key"))))


def _stop_auth() -> None:
    if _STATE.auth is not None:
        _STATE.auth.stop()
        _STATE.auth = None


def shutdown() -> None:
    """Stop this process's authenticator (before its context is destroyed)."""
    with _STATE.lock:
        _stop_auth()
