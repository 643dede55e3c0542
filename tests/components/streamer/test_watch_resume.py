"""A canary's watch across a restart of the streamer: the pure rule that rebuilds it
(``watchdog.resumed``: the trial's start kept, samples moved onto the new monotonic clock,
promotion only on what the window sees now), and the journal a restarted ``LiveConfig``
rebuilds it from (``live_config.py``)."""
from __future__ import annotations

from pathlib import Path

from bus.identity import Identity
from components.streamer.live_config import (
    HISTORY_FILE,
    WATCH_FILE,
    LiveConfig,
    WatchHead,
    WatchJournal,
)
from components.tenancy.watchdog import Decided, Ended, Verdict, resumed
from schemas.client import ConfigCommand
from schemas.config import RolloutConfig, load_config
from schemas.config_change import ENGINE, ConfigHistory

CFG = RolloutConfig(mode="canary", share=0.5, window_s=10.0, min_requests=2,
                    max_miss_rate_increase=0.25, promote_after_s=30.0)
OPS = Identity("ops", "operator")
BOOT = load_config(None, topology={"run_dir": "/x"},
                   admission={"tenants": [{"name": "a"}, {"name": "b"}]})
CANARY = ('[admission]\npolicy = "fcfs"\n[rollout]\nmode = "canary"\nshare = 0.5\n'
          'window_s = 10.0\nmin_requests = 2\npromote_after_s = 30.0\n')


def ok(at: float, canary: bool) -> Ended:
    return Ended(at, canary, "interactive", computed_tokens=8, good_tokens=4, wait_s=0.1)


# -- the rule ------------------------------------------------------------------------

def test_the_start_is_the_trials_and_samples_move_onto_the_new_clock():
    # the trial began at wall 1000.0; the streamer restarted at wall 1012.5, whose
    # monotonic clock reads 40.0 then: every wall time moves by 972.5
    w = resumed(CFG, 1000.0, [ok(1004.0, True), ok(1004.0, False), ok(999.999, True)],
                ended_before=3, now=1012.5, mono=40.0)
    assert w.started == 27.5 and w.resumed
    assert [e.at for e in w.ends] == [31.5, 31.5]          # the one before the trial: gone
    assert w.canary_ended == 4                             # 3 before the journal + 1
    assert w.cfg is CFG


def test_promotion_counts_from_the_trials_start_but_needs_the_window_now():
    w = resumed(CFG, 1000.0, [ok(1025.0, True), ok(1025.0, True), ok(1025.0, False)],
                ended_before=0, now=1026.0, mono=0.0)      # shift 1026: started -26.0
    assert w.verdict(3.999) is None                         # 29.999 s into the trial
    assert w.verdict(4.0) == Verdict("promote", "held 30.0 s over 2 canary requests")
    # the same counts, all older than the window when the clock reaches 30 s: a resumed
    # watch does not promote on them alone
    w = resumed(CFG, 1000.0, [ok(1015.0, True), ok(1015.0, True)], ended_before=5,
                now=1026.0, mono=0.0)
    assert w.verdict(4.0) is None and w.canary_ended == 7
    w.ended(ok(4.5, True))
    assert w.verdict(5.0) is None                           # one in the window
    w.ended(ok(5.0, True))
    assert w.verdict(5.0) == Verdict("promote", "held 31.0 s over 9 canary requests")


def test_a_resumed_window_rolls_back_as_before_the_restart():
    samples = [Ended(1001.0, True, "interactive", missed=True, wait_s=0.1),
               Ended(1001.5, True, "interactive", missed=True, wait_s=0.1),
               ok(1001.0, False), ok(1001.0, False),
               Decided(1001.0, True, "b", "interactive", True)]
    w = resumed(CFG, 1000.0, samples, 0, now=1002.0, mono=50.0)
    assert [d.at for d in w.decisions] == [49.0]
    v = w.verdict(50.0)
    assert v is not None and v.action == "rollback"
    assert v.reason.startswith("deadline-miss rate of class interactive 1.00")
    # the window forgets by the new clock: 10 s after the last sample, nothing is left
    assert w.verdict(59.500001) is None and not w.ends


def test_a_sample_stamped_after_now_counts_as_now():
    w = resumed(CFG, 1000.0, [ok(1010.0, True)], 0, now=1005.0, mono=5.0)
    assert [e.at for e in w.ends] == [5.0]


# -- the history and the journal -------------------------------------------------------

def _canary(path: Path, now: float = 1001.0, mono: float = 101.0) -> LiveConfig:
    lc = LiveConfig(BOOT, 1000.0, path, 100.0)
    answer, change = lc.command(ConfigCommand("q", "apply", CANARY, actor="t"), OPS, now,
                                mono)
    assert answer.error is None and change is not None and change.trial is not None
    return lc


def test_the_history_keeps_a_trial_with_the_same_file_and_ends_it_with_another():
    h = ConfigHistory(BOOT, 1.0)
    v = h.apply(CANARY, "ops", 2.0)
    again = ConfigHistory.resumed(BOOT, h.versions, h.sections,
                                  ENGINE.sections.of(h.boot).digest(), 9.0, ENGINE)
    assert (again.settled, again.trial) == (0, v.version)
    assert again.rollback(None, "watchdog", 10.0).rollback_of == 0     # ends it as before
    other = load_config(None, topology={"run_dir": "/x"}, admission={
        "tenants": [{"name": "a"}, {"name": "b"}], "kv_safety": 0.2})
    changed = ConfigHistory.resumed(other, h.versions, h.sections,
                                    ENGINE.sections.of(h.boot).digest(), 9.0, ENGINE)
    assert (changed.settled, changed.trial, changed.current.applied_by) == (2, None,
                                                                           "startup")


def test_a_restarted_streamer_resumes_the_watch_and_rolls_back(tmp_path: Path):
    path = tmp_path / HISTORY_FILE
    lc = _canary(path)
    journal = tmp_path / WATCH_FILE
    assert WatchJournal.read(journal) == (WatchHead(1, lc.history.versions[1].sha256), [])
    lc.ended(Ended(102.0, True, "interactive", missed=True, wait_s=0.1), started=101.5)
    lc.ended(ok(102.0, False), started=101.5)
    lc.decided(102.0, 101.5, "b", "interactive", True)
    assert lc.watch(1002.5, 102.5, {}) is None             # the tick writes them (shift 900)
    lc.ended(Ended(102.6, True, "interactive", missed=True), started=101.5)  # not written

    # killed; restarted at wall 1010.0, monotonic 7.0 (another clock: shift 1003)
    again = LiveConfig(BOOT, 1010.0, path, 7.0)
    assert again.history.trial == 1 and again.change().trial is not None
    w = again.watchdog
    assert w is not None and w.resumed and w.started == -2.0          # 1001 - 1003
    assert [(e.at, e.canary, e.missed) for e in w.ends] == [(-1.0, True, True),
                                                            (-1.0, False, False)]
    assert [d.at for d in w.decisions] == [-1.0] and w.canary_ended == 1
    assert again.stats()["rollout.resumed"] == 1 and again.canary("b") is True
    again.ended(Ended(7.5, True, "interactive", missed=True), started=7.2)
    again.ended(ok(7.5, False), started=7.2)
    verdict, v, change = again.watch(1010.75, 7.75, {})
    assert verdict.action == "rollback" and (v.version, v.rollback_of) == (2, 0)
    assert change.trial is None and again.watchdog is None and not journal.exists()
    assert LiveConfig(BOOT, 1020.0, path, 20.0).watchdog is None       # over for good


def test_a_missing_or_foreign_journal_keeps_the_start_with_empty_windows(tmp_path: Path):
    path = tmp_path / HISTORY_FILE
    _canary(path)
    journal = tmp_path / WATCH_FILE
    journal.write_bytes(b'{"trial": 7, "sha256": "x"}\n["e",1002.0,true,"interactive",'
                        b'true,false,0.1,0,0]\n')
    w = LiveConfig(BOOT, 1010.0, path, 10.0).watchdog
    assert w is not None and w.started == 1.0 and not w.ends and w.canary_ended == 0
    journal.unlink()
    w = LiveConfig(BOOT, 1010.0, path, 10.0).watchdog
    assert w is not None and w.started == 1.0 and not w.ends


def test_a_torn_last_line_is_skipped(tmp_path: Path):
    path = tmp_path / HISTORY_FILE
    lc = _canary(path)
    for _ in range(2):
        lc.ended(ok(102.0, True), started=101.5)
    lc.watch(1002.5, 102.5, {})
    with open(tmp_path / WATCH_FILE, "ab") as f:
        f.write(b'["e",1002.7,tr')
    w = LiveConfig(BOOT, 1010.0, path, 10.0).watchdog
    assert w is not None and len(w.ends) == 2 and w.canary_ended == 2


def test_the_journal_is_compacted_to_the_window(tmp_path: Path, monkeypatch):
    from components.streamer import live_config
    monkeypatch.setattr(live_config, "_JOURNAL_COMPACT_BYTES", 2000)
    path = tmp_path / HISTORY_FILE
    lc = _canary(path)
    for i in range(50):                                     # 50 canary ends, 0.5 s apart
        lc.ended(ok(102.0 + i / 2, True), started=101.5)
        assert lc.watch(1002.0 + i / 2, 102.0 + i / 2, {}) is None
    head, samples = WatchJournal.read(tmp_path / WATCH_FILE)
    assert (tmp_path / WATCH_FILE).stat().st_size < 4000    # rewritten, not grown
    assert head.canary_ended_before > 0 and len(samples) < 50  # the oldest dropped
    assert head.canary_ended_before + len(samples) == 50    # and no count lost
    w = LiveConfig(BOOT, 1150.0, path, 250.0).watchdog
    assert w is not None and w.canary_ended == 50


def test_a_new_version_ends_the_journal(tmp_path: Path):
    path = tmp_path / HISTORY_FILE
    lc = _canary(path)
    lc.command(ConfigCommand("q", "apply", '[admission]\nkv_safety = 0.2\n'), OPS, 1002.0,
               102.0)
    assert not (tmp_path / WATCH_FILE).exists()
    assert LiveConfig(BOOT, 1010.0, path, 10.0).watchdog is None
