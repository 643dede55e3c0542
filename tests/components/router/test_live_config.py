"""The router's live config (components/router/live_config.py): versions answered only to an
operator's key, saved line by line, and read back by a restarted router (the version in
force goes on; a changed file is a new version); a line cut short by a crash is dropped,
an unreadable file set aside, a failed write counted."""
from __future__ import annotations

from pathlib import Path

import pytest

from bus.identity import Identity, Keyring, Refusal
from components.router.live_config import RouterLiveConfig, history_path, read
from schemas.client import ConfigCommand
from schemas.config import WeirConfig, load_config


def boot(tmp_path: Path, **router) -> WeirConfig:
    return load_config(None, topology={"run_dir": str(tmp_path)}, router={
        "replicas": [{"name": "r0", "endpoint": "tcp://r0:7450"}], **router})


OPS = Identity("ops", "operator")


def apply(live: RouterLiveConfig, toml: str, now: float = 2.0):
    return live.command(ConfigCommand("q", "apply", toml, actor="alice"), OPS, now)


def test_versions_are_saved_and_a_restarted_router_goes_on_with_the_one_in_force(tmp_path):
    cfg = boot(tmp_path)
    path = history_path(cfg)
    assert path == tmp_path / "router_config_history.jsonl"
    live = RouterLiveConfig(cfg, path, 1.0)
    answer, new = apply(live, '[router]\npolicy = "round_robin"\n')
    assert answer.error is None and new is not None and new.router.policy == "round_robin"
    assert answer.current.applied_by == "operator:ops (alice)"
    apply(live, '[router]\nweights = { queue = 3.0 }\n', 3.0)
    versions, sections, started = read(path)
    assert [v.version for v in versions] == [0, 1, 2] and versions == live.history.versions
    again = RouterLiveConfig(cfg, path, 9.0)
    assert again.resumed_from == 3 and again.history.versions == live.history.versions
    assert (again.config.router.policy, again.config.router.weights.queue) == (
        "round_robin", 3.0)
    # the rollback after the restart is version 3, and it is saved too
    back, new = again.command(ConfigCommand("q", "rollback", version=0), OPS, 10.0)
    assert back.current.version == 3 and new.router == cfg.router
    assert [v.version for v in read(path)[0]] == [0, 1, 2, 3]


def test_a_router_started_with_a_changed_file_makes_it_a_version_in_force(tmp_path):
    path = tmp_path / "h.jsonl"
    live = RouterLiveConfig(boot(tmp_path), path, 1.0)
    apply(live, '[router]\npolicy = "round_robin"\n')
    changed = boot(tmp_path, kv_high=0.8)
    again = RouterLiveConfig(changed, path, 5.0)
    v = again.history.current
    assert (v.version, v.applied_by, v.changed) == (
        2, "startup", ("router.kv_high", "router.policy"))
    assert again.config.router == changed.router
    assert read(path)[0] == again.history.versions
    # started once more with that file: version 2 stays, nothing is added
    assert RouterLiveConfig(changed, path, 6.0).history.versions == again.history.versions


def test_a_line_cut_short_is_dropped_and_an_unreadable_file_set_aside(tmp_path):
    path = tmp_path / "h.jsonl"
    cfg = boot(tmp_path)
    live = RouterLiveConfig(cfg, path, 1.0)
    apply(live, '[router]\npolicy = "round_robin"\n')
    whole = path.read_bytes()
    path.write_bytes(whole + whole.splitlines(keepends=True)[-1][:40])   # a crash mid-line
    assert RouterLiveConfig(cfg, path, 2.0).history.current.version == 1
    path.write_bytes(b"not json\n" + whole)
    fresh = RouterLiveConfig(cfg, path, 3.0)
    assert fresh.history.current.version == 0 and fresh.resumed_from == 0
    assert (tmp_path / "h.jsonl.unreadable").read_bytes() == b"not json\n" + whole
    assert [v.version for v in read(path)[0]] == [0]


def test_a_failed_write_is_counted_and_the_version_kept(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    live = RouterLiveConfig(boot(tmp_path), blocker / "h.jsonl", 1.0)   # not a directory
    answer, new = apply(live, '[router]\nkv_high = 0.5\n')
    assert answer.error is None and new.router.kv_high == 0.5
    assert live.persist_errors == 2                          # the start, then version 1


def test_refusals_change_nothing_and_need_an_operator(tmp_path):
    path = tmp_path / "h.jsonl"
    live = RouterLiveConfig(boot(tmp_path), path, 1.0)
    saved = path.read_bytes()
    answer, new = apply(live, '[router]\nfleet_queue = false\n')
    assert new is None and answer.error == (
        "config not applied: router.fleet_queue needs a restart (the fleet queue is made or "
        "not at start; its bounds change live)")
    answer, new = live.command(ConfigCommand("q", "apply", '[router]\nkv_high = 0.5\n'),
                               Identity("acme", "tenant"), 2.0)
    assert (answer.error, new) == ("config commands need an operator's key", None)
    assert path.read_bytes() == saved and live.history.current.version == 0


@pytest.mark.parametrize("key, who", [
    (None, Refusal("this command needs an operator's key")),
    ("wrong", Refusal("this command needs an operator's key")),
    ("sk-ops", Identity("operator", "operator")),
    ("sk-service", Identity("default", "service")),
])
def test_an_operator_key_from_the_deployment_closes_an_open_endpoints_commands(key, who):
    keys = Keyring((), service_key="sk-service", operator_key="sk-ops")
    assert keys.open and keys.identify(None, "acme") == Identity("acme", "open")
    assert keys.operator(key) == who


def test_without_an_operator_key_an_open_endpoint_lets_anyone_operate():
    assert Keyring((), service_key="", operator_key="").operator(None) == Identity(
        "default", "open")
