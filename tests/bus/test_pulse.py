"""Liveness apart from the event loop (bus/pulse.py): the verdict on each kind of silence,
exactly; and a real process whose loop stalls while it computes, or blocks while it idles,
told apart by its pulse thread alone."""
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import zmq

from bus.pulse import PulseTrack, verdict
from schemas.wire import ComponentPulse, Envelope

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 10.0
TICK = 0.3


def _track(*pulses):
    t = PulseTrack()
    for at, age, cpu in pulses:
        t.heard(at, age, cpu, TICK)
    return t


def test_with_no_pulses_the_heartbeat_alone_decides():
    assert verdict(PulseTrack(), last_beat=0.0, now=9.0, timeout_s=TIMEOUT) == "ok"
    assert verdict(PulseTrack(), last_beat=0.0, now=10.5, timeout_s=TIMEOUT) == "silent"


def test_no_pulse_for_the_timeout_is_silent_whatever_the_heartbeats_say():
    t = _track((1.0, 0.1, 0.0))
    assert verdict(t, last_beat=11.0, now=11.2, timeout_s=TIMEOUT) == "silent"


def test_a_loop_stalled_while_the_process_computes_is_stalled_not_dead():
    # the loop last ticked at 1.0; pulses keep coming; 9 CPU-seconds in 11 s
    t = _track((1.1, 0.1, 5.0), (12.0, 11.0, 14.0))
    assert t.stalled_s(12.5) == 11.5
    assert verdict(t, last_beat=1.0, now=12.5, timeout_s=TIMEOUT) == "stalled"


def test_a_loop_stalled_while_the_process_idles_is_hung():
    t = _track((1.1, 0.1, 5.0), (12.0, 11.0, 5.2))        # 0.2 CPU-seconds in 11 s
    assert verdict(t, last_beat=1.0, now=12.5, timeout_s=TIMEOUT) == "hung"


def test_a_stall_shorter_than_the_timeout_is_ok():
    t = _track((1.1, 0.1, 5.0), (9.0, 8.0, 5.0))
    assert verdict(t, last_beat=1.0, now=9.5, timeout_s=TIMEOUT) == "ok"


def test_the_cpu_baseline_is_the_last_pulse_whose_loop_was_current():
    # busy for a long time with a current loop, then blocked: the CPU before the stall
    # must not count as work during it
    t = _track((1.0, 0.1, 0.0), (20.0, 0.1, 19.0), (31.0, 11.0, 19.1))
    assert verdict(t, last_beat=20.0, now=31.0, timeout_s=TIMEOUT) == "hung"


CHILD = """
import sys, time, anyio
from bus.pulse import Pulse
mode, address = sys.argv[1], sys.argv[2]

async def main():
    pulse = Pulse("probe", address, 0.1)
    pulse.start()
    for _ in range(5):                       # a healthy loop first
        pulse.tick()
        await anyio.sleep(0.1)
    end = time.monotonic() + 2.0
    if mode == "busy":                       # the loop never yields, but computes
        while time.monotonic() < end:
            sum(range(1000))
    else:                                    # the loop waits on something, idle
        time.sleep(2.0)
    pulse.tick()
    await anyio.sleep(0.3)

anyio.run(main)
"""


def _probe(mode: str, tmp_path: Path) -> str:
    """The verdict a supervisor with a 1 s timeout reaches on a real process whose loop
    stalls for 2 s in ``mode``; the worst one seen while it runs."""
    address = f"ipc://{tmp_path}/beats.sock"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(address)
    decode = msgspec.msgpack.Decoder(Envelope[ComponentPulse])
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode, address], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    track, seen = PulseTrack(), set()
    try:
        deadline = time.monotonic() + 30
        while proc.poll() is None:
            assert time.monotonic() < deadline
            if pull.poll(100):
                beat = decode.decode(pull.recv()).body
                track.heard(time.monotonic(), beat.loop_age_s, beat.cpu_s, 0.15)
            if track.at:
                seen.add(verdict(track, 0.0, time.monotonic(), timeout_s=1.0))
    finally:
        proc.kill()
        proc.wait()
        pull.close(0)
        ctx.term()
    assert "silent" not in seen                       # the thread pulsed throughout
    return "hung" if "hung" in seen else "stalled" if "stalled" in seen else "ok"


def test_a_real_busy_loop_reads_as_stalled_and_a_real_blocked_one_as_hung(tmp_path):
    assert _probe("busy", tmp_path) == "stalled"
    assert _probe("blocked", tmp_path) == "hung"
