"""Heartbeats carry news at once and say nothing new only every keepalive."""
import pytest

from bus.component import NewsGate
from schemas.config import ConfigError, SupervisorConfig
from schemas.wire import ComponentHeartbeat


def beat(steps: float, state: str = "ready") -> ComponentHeartbeat:
    return ComponentHeartbeat("executor", 42, state, {"steps": steps}, {}, {})


def test_unchanged_reports_wait_for_the_keepalive():
    gate = NewsGate(1.0)
    assert gate.due(beat(0), 0.0)                       # the first one always goes
    assert [gate.due(beat(0), t / 10) for t in range(1, 10)] == [False] * 9
    assert gate.due(beat(0), 1.0)                       # proof of life
    assert not gate.due(beat(0), 1.5)


def test_any_change_goes_at_once_and_restarts_the_keepalive():
    gate = NewsGate(1.0)
    assert gate.due(beat(0), 0.0)
    assert gate.due(beat(1), 0.1)                       # a stat moved
    assert gate.due(beat(1, "draining"), 0.2)           # the state moved
    assert not gate.due(beat(1, "draining"), 1.1)       # 0.9 s since the last one sent
    assert gate.due(beat(1, "draining"), 1.2)
    assert gate.due(beat(0, "draining"), 1.25)          # back to an older value is news too


def test_keepalive_must_fit_the_timeout():
    SupervisorConfig(heartbeat_interval_s=0.1, heartbeat_keepalive_s=1.0,
                     heartbeat_timeout_s=3.0)
    with pytest.raises(ConfigError, match="3x heartbeat_keepalive_s"):
        SupervisorConfig(heartbeat_keepalive_s=1.0, heartbeat_timeout_s=2.0)
    with pytest.raises(ConfigError, match="heartbeat_keepalive_s must be >="):
        SupervisorConfig(heartbeat_interval_s=0.5, heartbeat_keepalive_s=0.2)
