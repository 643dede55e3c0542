"""The streamer's config history on disk: a restarted streamer (a new ``LiveConfig`` on the
same run directory) goes on from the version in force; a file that is not this engine's
is set aside."""
from __future__ import annotations

from pathlib import Path

from bus.identity import Identity
from components.streamer.live_config import HISTORY_FILE, LiveConfig
from schemas.client import ConfigCommand
from schemas.config import load_config

BOOT = load_config(None, topology={"run_dir": "/tmp/weir-test"}, kv={"num_blocks": 64},
                   engine={"max_model_len": 512})
OPS = Identity("ops", "operator")


def _apply(live: LiveConfig, toml: str, now: float):
    return live.command(ConfigCommand("q", "apply", toml, actor="t"), OPS, now)


def test_history_survives_a_restart_and_rollback_goes_on_from_it(tmp_path: Path) -> None:
    path = tmp_path / HISTORY_FILE
    first = LiveConfig(BOOT, 100.0, path)
    assert not first.restored and not path.exists()       # nothing written until a version
    _apply(first, '[admission]\npolicy = "fcfs"\n', 101.0)
    answer, change = _apply(first, '[rollout]\nmax_goodput_drop = 0.05\n', 102.0)
    assert change is not None and change.version == 2 and path.exists()
    assert path.stat().st_mode & 0o777 == 0o600

    again = LiveConfig(BOOT, 500.0, path)                  # the restarted streamer
    assert again.restored
    assert again.history.versions == first.history.versions
    assert again.history.config == first.history.config
    assert again.history.config.rollout.max_goodput_drop == 0.05
    assert again.change() == first.change()                # what it sends on start
    answer, _ = again.command(ConfigCommand("h", "history"), OPS, 501.0)
    assert [v.version for v in answer.history] == [0, 1, 2]
    assert answer.history[0].applied_at == 100.0         # the engine's start, not 500
    answer, change = again.command(ConfigCommand("r", "rollback", version=0), OPS, 502.0)
    assert (answer.current.version, answer.current.rollback_of) == (3, 0)
    assert again.history.config.admission.policy == BOOT.admission.policy
    assert [v.version for v in LiveConfig(BOOT, 600.0, path).history.versions] == [0, 1, 2, 3]


def test_a_refused_change_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / HISTORY_FILE
    live = LiveConfig(BOOT, 100.0, path)
    answer, change = _apply(live, "[kv]\nnum_blocks = 32\n", 101.0)
    assert change is None and answer.error and not path.exists()


def test_an_engine_started_with_a_changed_toml_makes_it_a_new_version(tmp_path: Path) -> None:
    path = tmp_path / HISTORY_FILE
    other = load_config(None, topology={"run_dir": "/tmp/weir-test"}, kv={"num_blocks": 64},
                        engine={"max_model_len": 512}, admission={"policy": "fcfs"})
    _apply(LiveConfig(other, 100.0, path), '[admission]\nttft_headroom = 0.3\n', 101.0)
    live = LiveConfig(BOOT, 200.0, path)                   # started with another TOML
    assert [(v.version, v.applied_by) for v in live.history.versions] == [
        (0, "startup"), (1, "operator:ops (t)"), (2, "startup")]
    assert live.history.config.admission == BOOT.admission  # the TOML restarted with wins


def test_a_damaged_file_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / HISTORY_FILE
    path.write_bytes(b'{"versions": [')
    live = LiveConfig(BOOT, 200.0, path)
    assert not live.restored and live.history.current.version == 0
    assert (tmp_path / (HISTORY_FILE + ".unreadable")).read_bytes() == b'{"versions": ['


def test_no_run_dir_keeps_it_in_memory() -> None:
    live = LiveConfig(BOOT, 100.0, None)
    _, change = _apply(live, '[admission]\npolicy = "fcfs"\n', 101.0)
    assert change is not None and change.version == 1 and not live.restored
