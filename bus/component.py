"""The component runtime: lifecycle (start → ready → draining → stopped), heartbeats
to the supervisor, and control messages (Drain, Stop, PeerRestarted) from it.

A component subclasses ``Component`` and implements ``setup`` (bind sockets, load
state), ``run`` (its main loop) and optionally ``stats``, ``drain`` and
``peer_restarted``. Compute code never touches sockets directly except here.
"""
from __future__ import annotations

import abc
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import anyio
import structlog
import zmq

from bus import curve
from bus.pulse import Pulse
from bus.socket import BusSocket, context
from schemas.config import WeirConfig
from schemas.wire import ComponentHeartbeat, ControlMsg, Drain, PeerRestarted, Stop, TenantUsage

E = TypeVar("E", bound=BaseException)
log = structlog.get_logger("component")


class NewsGate:
    """Whether a periodic report is worth sending: when it differs from the last one
    sent, or when ``keepalive_s`` has passed since (the receiver's proof of life)."""

    def __init__(self, keepalive_s: float) -> None:
        self.keepalive_s = keepalive_s
        self.last: object = None
        self.sent_at = -math.inf

    def due(self, report: object, now: float) -> bool:
        if report == self.last and now - self.sent_at < self.keepalive_s:
            return False
        self.last, self.sent_at = report, now
        return True


class Component(abc.ABC):
    name: ClassVar[str]

    def __init__(self, config: WeirConfig) -> None:
        self.config = config
        self.topology = config.topology
        self.state = "starting"
        self._sockets: list[BusSocket[Any]] = []

    # -- for subclasses
    def socket(self, kind: int, name: str, accepts: Any = None,
               max_msg_size: int | None = None) -> BusSocket[Any]:
        """A socket of this process. Frames it receives are bounded by ``max_msg_size``
        bytes, by default the bus's bound for internal messages (``[bus]
        max_message_mib``); a client endpoint passes what a legal request can be."""
        sock: BusSocket[Any] = BusSocket(kind, f"{self.name}.{name}", accepts,
                         max_msg_size=max_msg_size or self.config.bus.max_message_bytes)
        self._sockets.append(sock)
        return sock

    def push_to(self, component: str) -> BusSocket[Any]:
        return self.socket(zmq.PUSH, f"to_{component}").connect(self.topology.inbox(component))

    def inbox(self, accepts: Any) -> BusSocket[Any]:
        return self.socket(zmq.PULL, "inbox", accepts).bind(
            self.topology.inbox(self.name, bind=True))

    async def setup(self) -> None:  # noqa: B027 - an optional hook, empty by default
        """Bind and connect sockets, load what the component needs. Runs before ready."""

    @abc.abstractmethod
    async def run(self) -> None:
        """The component's main loop; returning ends the process."""

    def stats(self) -> dict[str, float]:
        return {}

    def tenant_usage(self) -> dict[str, TenantUsage]:
        """Per-tenant usage, typed (only the scheduler has any)."""
        return {}

    def info(self) -> dict[str, str]:
        """Fixed facts for ``weir status`` (the executor's kernel plan), not counters."""
        return {}

    async def drain(self) -> None:  # noqa: B027 - an optional hook, empty by default
        """Stop taking new work (default: nothing to do)."""

    async def peer_restarted(self, name: str) -> None:  # noqa: B027 - an optional hook
        """A peer lost its state; drop whatever depended on it."""

    # -- runtime
    def _malformed(self) -> float:
        return float(sum(s.malformed for s in self._sockets))

    async def _heartbeats(self) -> None:
        """Every ``heartbeat_interval_s``, a heartbeat if anything in it changed; an
        unchanged one only every ``heartbeat_keepalive_s`` (the supervisor's liveness)."""
        sock = self.socket(zmq.PUSH, "heartbeat").connect(self.topology.heartbeats())
        cfg = self.config.supervisor
        gate = NewsGate(cfg.heartbeat_keepalive_s)
        while True:
            self._pulse.tick()               # the loop ran: what the pulse thread reports
            stats = {"malformed": self._malformed(), **self.stats()}
            beat = ComponentHeartbeat(self.name, os.getpid(), self.state, stats,
                                      self.tenant_usage(), self.info())
            if gate.due(beat, time.monotonic()):
                await sock.send(beat)
            await anyio.sleep(cfg.heartbeat_interval_s)

    async def _control(self, scope: anyio.CancelScope) -> None:
        sock = self.socket(zmq.SUB, "control", ControlMsg).connect(self.topology.control())
        while True:
            match (await sock.recv()).body:
                case Stop():
                    log.info("stop")
                    self.state = "stopped"
                    scope.cancel()
                    return
                case Drain():
                    self.state = "draining"
                    await self.drain()
                case PeerRestarted(name=name) if name != self.name:
                    await self.peer_restarted(name)

    async def serve(self) -> None:
        self._pulse = Pulse(self.name, self.topology.heartbeats(),
                            self.config.supervisor.heartbeat_keepalive_s)
        self._pulse.start()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._control, tg.cancel_scope)
            try:
                await self.setup()
            except ValueError as exc:      # the operator's to fix: a clear line, no traceback
                raise SetupFailed(str(exc)) from exc
            self.state = "ready"
            self._pulse.tick()             # the loop is its own again (setup held it)
            log.info("ready")
            tg.start_soon(self._heartbeats)
            await self.run()
            tg.cancel_scope.cancel()

    def close(self) -> None:
        if hasattr(self, "_pulse"):
            self._pulse.stop()
        for sock in self._sockets:
            sock.close()


def _loop_options() -> dict[str, bool]:
    """uvloop where it is installed (a dependency on Linux; WEIR_UVLOOP=0 turns it off):
    every message, heartbeat and HTTP chunk goes through the event loop, and uvloop's costs
    about half of asyncio's per callback."""
    if os.environ.get("WEIR_UVLOOP", "1") == "0":
        return {}
    try:
        import uvloop  # noqa: F401 - imported only to see whether it is installed
    except ImportError:
        return {}
    return {"use_uvloop": True}


class SetupFailed(Exception):
    """A component could not start for a reason its operator can fix: a ValueError from its
    setup (the model, the configuration, a forced kernel this machine cannot run)."""


def setup_failure_path(run_dir: Path, name: str) -> Path:
    """Where a component that could not start leaves its reason for the supervisor (beside
    the config the supervisor wrote for it)."""
    return run_dir / f"{name}.setup_failed"


def find_in_group(exc: BaseException, cls: type[E]) -> E | None:
    """``exc`` if it is a ``cls``, else the first ``cls`` in the exception groups around it
    (anyio's task groups wrap what their tasks raise), else None."""
    if isinstance(exc, cls):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        if (found := find_in_group(inner, cls)) is not None:
            return found
    return None


def run(component_cls: type[Component], config: WeirConfig, run_dir: Path | None = None) -> None:
    """Process entry point: the supervisor handles Ctrl-C for the whole group. A setup that
    fails with a reason the operator can fix (:class:`SetupFailed`) logs that reason as one
    line, leaves it for the supervisor in ``run_dir`` (:func:`setup_failure_path`) and exits
    with code 2."""
    from bus import tracing
    from bus.log import configure

    configure(component_cls.name, config.log_level)
    tracing.setup(component_cls.name, config.telemetry)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if (nice := config.supervisor.nice.get(component_cls.name, 0)) > 0:
        os.nice(nice)       # yield the cores to the executor's OpenMP threads (see config)
    curve.configure(config)          # CURVE on tcp sockets if [security] says so
    comp = component_cls(config)
    failed = None
    try:
        anyio.run(comp.serve, backend_options=_loop_options())
    except BaseException as exc:
        if (failed := find_in_group(exc, SetupFailed)) is None:
            raise
        log.error("setup_failed", reason=str(failed))
        if run_dir is not None:
            try:
                setup_failure_path(run_dir, component_cls.name).write_text(str(failed))
            except OSError:
                pass
    finally:
        comp.close()
        curve.shutdown()
        context().destroy(linger=0)
        tracing.shutdown()
    if failed is not None:
        sys.exit(2)
