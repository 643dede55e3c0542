"""The supervisor: starts each component as its own OS process, watches heartbeats,
restarts by policy, relays cluster status to the streamer, and drains on SIGTERM.

Liveness is the pulse thread's, not the event loop's (bus/pulse.py): a process whose loop
is stalled but computing is left alone; one that is silent, or whose loop waits on nothing
while it idles, is killed and restarted. A component given up on (dead past
``max_restarts``, or by a restart policy that does not restart it) ends the whole engine:
the supervisor drains what can still finish and exits with ``EXIT_GIVEN_UP`` (3), so a
process manager (Kubernetes, systemd, compose's restart policy) starts it afresh, where a
living shell around a dead streamer answered ``/health`` 200 for ever.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog
import zmq
from anyio.abc import TaskStatus

from bus.component import setup_failure_path
from bus.identity import SERVICE_KEY_ENV, SERVICE_KEY_FILE_ENV
from bus.pulse import PulseTrack, verdict
from bus.socket import BusSocket
from schemas.config import COMPONENTS, WeirConfig
from schemas.wire import (
    ClusterStatus,
    ComponentHeartbeat,
    ComponentPulse,
    ComponentStatus,
    Drain,
    PeerRestarted,
    Stop,
    SupervisorMsg,
)

log = structlog.get_logger("supervisor")
ROOT = Path(__file__).resolve().parent.parent
EXIT_GIVEN_UP = 3           # `weir serve` exits with it when a component was given up on


class StartupError(RuntimeError):
    pass


@dataclass
class Child:
    """A supervised component: a process we spawned, or (``external``) one started by
    someone else (e.g. compose), known only through its heartbeats."""

    name: str
    external: bool = False
    timeout_s: float = 10.0
    proc: subprocess.Popen[bytes] | None = None
    pid: int = 0
    state: str = "starting"
    last_beat: float = 0.0
    restarts: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    tenants: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    pulse: PulseTrack = field(default_factory=PulseTrack)
    stalled: bool = False               # its loop is stalled while it works (logged once)

    @property
    def alive(self) -> bool:
        if self.external:
            heard = max(self.last_beat, self.pulse.at)
            return heard > 0 and time.monotonic() - heard < self.timeout_s
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(self, config: WeirConfig, components: tuple[str, ...] = COMPONENTS,
                 spawn: bool = True) -> None:
        self.config = config
        self.spawn = spawn
        timeout = config.supervisor.heartbeat_timeout_s
        if config.gateway.enabled and "gateway" not in components:
            components = (*components, "gateway")
        self.children = {name: Child(name, external=not spawn, timeout_s=timeout)
                         for name in components}
        self.draining = False
        self.stopping = False
        self.given_up: list[str] = []     # components left dead: the engine exits
        self._changed = True              # since the status last went to the streamer
        # the gateway's credential towards the streamer (bus/identity.py):
        # inherited by the children this supervisor spawns; compose sets it for every service
        # (a deployment that shares one, in a file, keeps it: replicas and a router agree)
        if not os.environ.get(SERVICE_KEY_ENV) and not os.environ.get(SERVICE_KEY_FILE_ENV):
            os.environ[SERVICE_KEY_ENV] = secrets.token_urlsafe(32)
        run_dir = Path(config.topology.run_dir or f"/tmp/weir-{os.getpid()}")
        run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = run_dir / "config.json"
        self.config_path.write_bytes(msgspec.json.encode(config))

    # -- processes
    def _spawn(self, child: Child) -> None:
        setup_failure_path(self.config_path.parent, child.name).unlink(missing_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        child.proc = subprocess.Popen(
            [sys.executable, "-m", "weir.launch", child.name, str(self.config_path)],
            env=env, cwd=str(ROOT), start_new_session=False)
        child.pid = child.proc.pid
        child.state = "starting"
        child.last_beat = time.monotonic()
        child.pulse, child.stalled = PulseTrack(), False
        log.info("spawned", child=child.name, child_pid=child.proc.pid)

    def status(self) -> ClusterStatus:
        now = time.monotonic()
        return ClusterStatus(tuple(
            ComponentStatus(c.name, c.pid, c.alive, c.state, c.restarts,
                            round(now - c.last_beat, 3),
                            {**c.stats, "loop_stalled_s": round(c.pulse.stalled_s(now), 3)}
                            if c.stalled else c.stats, c.tenants, c.info)
            for c in self.children.values()), self.draining)

    # -- loops
    async def _heartbeats(self, sock: BusSocket[Any]) -> None:
        while True:
            match (await sock.recv()).body:
                case ComponentHeartbeat(name=name, pid=pid, state=state, stats=stats,
                                        tenants=tenants, info=info):
                    child = self.children.get(name)
                    if child and (child.external or child.pid == pid):
                        if child.external and child.pid not in (0, pid):
                            child.restarts += 1
                        if child.state == "starting" and state != "starting":
                            # pulses sent during setup carry its age as the loop's: judge
                            # the loop from its first pulse after it (a setup that waited
                            # on the kernel plan's lock must not read as a hung loop)
                            child.pulse = PulseTrack()
                        news = (pid, state, stats, tenants, info)
                        if news != (child.pid, child.state, child.stats, child.tenants,
                                    child.info):
                            self._changed = True
                        child.pid, child.state, child.stats = pid, state, stats
                        child.tenants = tenants
                        child.info = info
                        child.last_beat = time.monotonic()
                case ComponentPulse(name=name, pid=pid, loop_age_s=age, cpu_s=cpu):
                    child = self.children.get(name)
                    if child and (child.external or child.pid == pid):
                        child.pulse.heard(time.monotonic(), age, cpu,
                                          3 * self.config.supervisor.heartbeat_interval_s)

    async def _watch(self, control: BusSocket[Any], to_streamer: BusSocket[Any]) -> None:
        cfg = self.config.supervisor
        sent_at = time.monotonic()
        while not self.stopping:
            await anyio.sleep(cfg.heartbeat_interval_s)
            now = time.monotonic()
            for child in self.children.values():
                if child.external or child.state == "dead":
                    continue
                judged = "ok" if child.state == "starting" else \
                    verdict(child.pulse, child.last_beat, now, cfg.heartbeat_timeout_s)
                if (judged == "stalled") != child.stalled:
                    child.stalled, self._changed = judged == "stalled", True
                    if child.stalled:
                        log.warning("component_stalled", child=child.name,
                                    loop_stalled_s=round(child.pulse.stalled_s(now), 1))
                dead = not child.alive
                silent = judged in ("silent", "hung")
                if not (dead or silent) or self.stopping:
                    continue
                code = child.proc.poll() if child.proc else None
                log.error("component_down", child=child.name, exit_code=code, silent=silent,
                          verdict=judged)
                if silent and child.alive and child.proc is not None:
                    child.proc.kill()
                    child.proc.wait()
                restart = cfg.restart == "always" or (cfg.restart == "on-failure" and code != 0)
                if restart and child.restarts < cfg.max_restarts and not self.draining:
                    child.restarts += 1
                    self._spawn(child)
                    await control.send(PeerRestarted(child.name))
                else:
                    child.state = "dead"
                    if not self.draining:
                        log.error("component_given_up", child=child.name,
                                  restarts=child.restarts, exit_code=code)
                        self.given_up.append(child.name)
                        self._stop.set()
                        # what it held is lost: the streamer fails those requests now,
                        # instead of at the drain's deadline
                        await control.send(PeerRestarted(child.name))
                self._changed = True
            # the streamer's copy of the status: at once when it changed, else as a keepalive
            if self._changed or now - sent_at >= cfg.heartbeat_keepalive_s:
                self._changed, sent_at = False, now
                await to_streamer.send(self.status())

    async def wait_ready(self, to_streamer: BusSocket[Any] | None = None) -> None:
        """Until every component is ready; meanwhile the streamer hears each one's state,
        so status shows components as ``starting`` and requests are refused, not held."""
        deadline = time.monotonic() + self.config.supervisor.startup_timeout_s
        tick = 0
        while any(c.state != "ready" for c in self.children.values()):
            tick += 1
            if to_streamer is not None and tick % 4 == 0:
                await to_streamer.send(self.status())
            for c in self.children.values():
                if not c.external and not c.alive:
                    reason = setup_failure_path(self.config_path.parent, c.name)
                    if reason.is_file():       # it said why (bus.component.SetupFailed)
                        raise StartupError(f"{c.name} could not start: "
                                           f"{reason.read_text().strip()}")
                    raise StartupError(f"component {c.name} exited during startup "
                                       f"(code {c.proc.poll() if c.proc else None})")
            if time.monotonic() > deadline:
                slow = [c.name for c in self.children.values() if c.state != "ready"]
                if not self.spawn:            # watch-only: keep watching, report them down
                    log.error("components_not_ready", components=slow)
                    return
                raise StartupError(f"components not ready in time: {slow}")
            await anyio.sleep(0.05)

    async def drain_and_stop(self, control: BusSocket[Any]) -> None:
        """No new work, let active streams finish (bounded), then stop every process."""
        self.draining = True
        log.info("draining")
        await control.send(Drain())
        deadline = time.monotonic() + self.config.streamer.drain_timeout_s
        # the client-facing process: a streamer, or a router in front of engines
        streamer = self.children.get("streamer") or self.children.get("router")
        heard_by = time.monotonic() + 1.0
        while streamer and streamer.alive and time.monotonic() < deadline:
            # its count is current once its heartbeat says it heard the Drain (or, from one
            # that says nothing, after a second)
            heard = streamer.state != "ready" or time.monotonic() > heard_by
            if heard and streamer.stats.get("active_requests", 0) == 0:
                break
            await anyio.sleep(0.02)
        self.stopping = True
        await control.send(Stop())
        end = time.monotonic() + 5
        while any(c.alive for c in self.children.values()) and time.monotonic() < end:
            await anyio.sleep(0.05)
        for c in self.children.values():
            if c.proc is not None and c.alive:
                c.proc.kill()
                c.proc.wait()
        log.info("stopped")

    async def _signals(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Wait for SIGTERM/SIGINT. The handler is in place before the ready line: a
        SIGTERM sent the moment a caller reads it drains and stops, where the default
        action killed us (and by PDEATHSIG every component) on the spot."""
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                log.info("signal", signal=signal.Signals(signum).name)
                break
        self._stop.set()

    async def serve(self, on_ready: Callable[[Supervisor], object] | None = None) -> int:
        """Run until SIGTERM/SIGINT, or until a component is given up on; then drain and
        stop. Returns the exit status: 0, or ``EXIT_GIVEN_UP``."""
        self._stop = anyio.Event()
        topo = self.config.topology
        beats: BusSocket[Any] = BusSocket(zmq.PULL, "supervisor.heartbeats", SupervisorMsg,
                          max_msg_size=self.config.bus.max_message_bytes).bind(
            topo.heartbeats(bind=True))
        control: BusSocket[Any] = BusSocket(zmq.PUB, "supervisor.control").bind(
            topo.control(bind=True))
        to_streamer: BusSocket[Any] = BusSocket(zmq.PUSH, "supervisor.to_streamer").connect(
            topo.inbox("streamer"))
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeats, beats)
                for child in self.children.values():
                    if self.spawn:
                        self._spawn(child)
                try:
                    await self.wait_ready(to_streamer)
                except StartupError:
                    self.stopping = True
                    await self.drain_and_stop(control)
                    raise
                await to_streamer.send(self.status())     # status is never empty once ready
                await anyio.sleep(0.05)
                tg.start_soon(self._watch, control, to_streamer)
                await tg.start(self._signals)
                if on_ready is not None:
                    on_ready(self)
                await self._stop.wait()              # a signal, or a component given up on
                await self.drain_and_stop(control)
                tg.cancel_scope.cancel()
        finally:
            for sock in (beats, control, to_streamer):
                sock.close()
        if self.given_up:
            log.error("exiting", given_up=self.given_up, exit_code=EXIT_GIVEN_UP)
            return EXIT_GIVEN_UP
        return 0
