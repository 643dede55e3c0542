"""Liveness apart from the event loop: how the supervisor tells a component whose loop is
stalled but working from one that is dead or hung.

A component's heartbeats (``Component._heartbeats``) run on its event loop, so a loop
that does not yield for a while (a long step, a flood of client frames, a slow tokenize)
used to read as death: after ``heartbeat_timeout_s`` the supervisor killed a process that
was alive and busy, and with it every request it held. Each component now also runs a
*pulse* thread that sends a ``ComponentPulse`` every ``heartbeat_keepalive_s``, whatever
its loop is doing: the age of the loop's last tick, and the CPU seconds the process has
used. The thread needs only the GIL, which a busy loop hands over every few milliseconds
and native code (torch, OpenMP, zmq) releases.

The supervisor's verdict (:func:`verdict`), per component:

- ``silent``: no pulse for ``heartbeat_timeout_s``. Not even a thread of the process can
  run (it is stopped, deadlocked holding the GIL, or gone): killed and restarted.
- ``hung``: pulses come, but the loop has not ticked for ``heartbeat_timeout_s`` and the
  process used less than ``BUSY_CPU_FRACTION`` of a core meanwhile: the loop waits on
  something that will not come (a blocking call, a lock). Killed and restarted.
- ``stalled``: the loop has not ticked for ``heartbeat_timeout_s``, but the process is
  computing: alive and working. Logged (``component_stalled``) and shown in status, never
  killed. A loop that never yields is still a bug to fix where it is; the supervisor's part
  is not to turn it into an outage.
- ``ok``: otherwise.

A component that sends no pulses (an older build) is judged by its heartbeats alone.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import zmq

from bus import curve
from bus.codec import encode
from schemas.wire import ComponentPulse

BUSY_CPU_FRACTION = 0.1     # of one core, over the stall: below it the loop is not working


@dataclass
class PulseTrack:
    """What the supervisor keeps of one component's pulses."""

    at: float = 0.0            # when the last pulse came (monotonic; 0: none yet)
    loop_age_s: float = 0.0    # its loop's age then
    cpu_s: float = 0.0         # the process's CPU seconds then
    fresh_at: float = 0.0      # the last pulse whose loop was current (time, CPU seconds)
    fresh_cpu_s: float = 0.0

    def heard(self, now: float, loop_age_s: float, cpu_s: float, tick_s: float) -> None:
        self.at, self.loop_age_s, self.cpu_s = now, loop_age_s, cpu_s
        if loop_age_s <= tick_s or self.fresh_at == 0.0:
            self.fresh_at, self.fresh_cpu_s = now - loop_age_s, cpu_s

    def stalled_s(self, now: float) -> float:
        """How long the loop has not ticked, as of now (0 with no pulses)."""
        return self.loop_age_s + (now - self.at) if self.at else 0.0


def verdict(track: PulseTrack, last_beat: float, now: float, timeout_s: float) -> str:
    """``ok``, ``stalled``, ``hung`` or ``silent``, as the module docstring says."""
    if not track.at:                                   # no pulses: heartbeats alone
        return "silent" if now - last_beat > timeout_s else "ok"
    if now - track.at > timeout_s:
        return "silent"
    if track.stalled_s(now) <= timeout_s:
        return "ok"
    span = max(track.at - track.fresh_at, 1e-9)
    busy = (track.cpu_s - track.fresh_cpu_s) / span >= BUSY_CPU_FRACTION
    return "stalled" if busy else "hung"


class Pulse:
    """The thread: a PUSH socket of its own (ZeroMQ sockets belong to one thread) to the
    supervisor's heartbeat address, a ``ComponentPulse`` every ``interval_s``."""

    def __init__(self, name: str, address: str, interval_s: float) -> None:
        self.name, self.address, self.interval_s = name, address, interval_s
        self.loop_tick = time.monotonic()      # the loop's last tick (set from the loop)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-pulse", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def tick(self) -> None:
        self.loop_tick = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)       # a pulse is only news while it is fresh
        curve.prepare_connect(sock, zmq.PUSH, self.address)
        sock.connect(self.address)
        pid = os.getpid()
        try:
            while not self._stop.wait(self.interval_s):
                beat = ComponentPulse(self.name, pid, time.monotonic() - self.loop_tick,
                                      time.process_time())
                try:
                    sock.send(encode(beat), zmq.NOBLOCK)
                except zmq.Again:            # the supervisor is not reading: drop it
                    pass
        finally:
            sock.close(0)
            ctx.term()
