"""The streamer's config versions with a canary watched (``live_config.py``): the change
carries the trial beside the settled config, the watchdog's verdict becomes a version by
``watchdog``, and requests from before the trial are not counted."""
from __future__ import annotations

from bus.identity import Identity
from components.streamer.live_config import LiveConfig
from components.tenancy.watchdog import Ended
from schemas.client import ConfigCommand
from schemas.config import load_config

OPS = Identity("ops", "operator")
BOOT = load_config(None, topology={"run_dir": "/x"},
                   admission={"tenants": [{"name": "a"}, {"name": "b"}]})
CANARY = ('[admission]\npolicy = "fcfs"\n[rollout]\nmode = "canary"\nshare = 0.5\n'
          'window_s = 10.0\nmin_requests = 2\npromote_after_s = 30.0\n')


def _canary(mono: float = 100.0) -> LiveConfig:
    lc = LiveConfig(BOOT, 1000.0)
    answer, change = lc.command(ConfigCommand("q", "apply", CANARY, actor="t"), OPS, 1001.0,
                                mono)
    assert answer.error is None and change is not None
    assert (change.version, change.trial.version) == (0, 1)
    assert change.sections.admission.policy == "deadline"
    assert change.trial.sections.admission.policy == "fcfs"
    assert lc.watchdog is not None and lc.watchdog.started == mono
    return lc


def test_a_bad_canary_is_rolled_back_by_the_watchdog():
    lc = _canary()
    assert (lc.canary("b"), lc.canary("a")) == (True, False)
    for _ in range(2):
        lc.ended(Ended(101.0, True, "interactive", missed=True), started=100.5)
        lc.ended(Ended(101.0, False, "interactive", good_tokens=4, computed_tokens=8),
                 started=100.5)
    assert lc.stats()["rollout.canary_share"] == 0.5
    verdict, v, change = lc.watch(1002.0, 101.5, {})
    assert verdict.action == "rollback"
    assert (v.version, v.applied_by, v.rollback_of, v.rollout) == (2, "watchdog", 0, "off")
    assert v.reason == verdict.reason and v.reason.startswith("deadline-miss rate of class")
    assert change.trial is None and change.version == 2
    assert change.sections.admission.policy == "deadline"
    assert lc.watchdog is None and lc.watch(1003.0, 102.0, {}) is None
    stats = lc.stats()
    assert (stats["rollout.canaries"], stats["rollout.rolled_back"], stats["rollout.promoted"],
            stats["rollout.canary_share"], stats["rollout.trial_version"]) == (1, 1, 0, 0.0, 0)


def test_requests_from_before_the_trial_are_not_counted_and_a_good_canary_is_promoted():
    lc = _canary()
    for _ in range(3):                                      # arrived before the trial
        lc.ended(Ended(101.0, True, "interactive", missed=True), started=99.0)
        lc.decided(101.0, 99.0, "b", "interactive", False)
    assert not lc.watchdog.ends and not lc.watchdog.decisions
    assert lc.watch(1002.0, 101.5, {}) is None
    for _ in range(2):
        lc.ended(Ended(120.0, True, "interactive", good_tokens=4, computed_tokens=8), 110.0)
    assert lc.watch(1020.0, 129.9, {}) is None              # 29.9 s
    verdict, v, change = lc.watch(1021.0, 130.0, {})
    assert verdict.action == "promote"
    assert (v.version, v.applied_by, v.promotion_of, v.rollout) == (2, "watchdog", 1, "off")
    assert change.trial is None and change.sections.admission.policy == "fcfs"
    assert lc.history.config.admission.policy == "fcfs"
    answer, _ = lc.command(ConfigCommand("h", "history"), OPS, 1022.0)
    assert [(h.version, h.rollout, h.applied_by) for h in answer.history] == [
        (0, "off", "startup"), (1, "canary", "operator:ops (t)"), (2, "off", "watchdog")]


def test_another_apply_ends_the_watch():
    lc = _canary()
    _, change = lc.command(ConfigCommand("q", "apply", '[admission]\nkv_safety = 0.2\n'),
                           OPS, 1002.0, 101.0)
    assert change.trial is None and lc.watchdog is None and lc.canary("b") is None
