"""The engine's config versions, kept by the streamer (where operators' commands arrive):
an operator's ``ConfigCommand`` checked and answered, and the ``PolicyChange`` admission
and the scheduler are sent when a version is made (``schemas/config_change.py`` decides).

A candidate on trial (``[rollout] mode``) travels in the change beside the settled
config. A canary's is watched (``watchdog.py``): the streamer feeds the watchdog each
request's decision and end, labelled canary or baseline by its tenant
(``components/tenancy/canary.py``, as admission decides them), and ``watch`` turns its
verdict into a new version by the actor ``watchdog``: the candidate promoted, or the
settled config restored. Requests that arrived before the trial began are not counted.

The history is written to ``config_history.json`` in the engine's run directory (which
the supervisor keeps across a restart of the streamer) each time a version is made,
before admission and the scheduler are sent it. A restarted streamer reads it back
(``ConfigHistory.resumed``: the engine's TOML is the same, so the version in force goes
on) and sends that version again, so one its predecessor recorded but died before sending
reaches them. A file that cannot be read is set aside (``.unreadable``) and the history
starts again at version 0; a write that fails keeps the version in memory. A new engine
(a new run directory) starts from its TOML. A restarted admission or scheduler starts from
the TOML: the streamer sends it the version in force again (``resend``).

A trial running when the streamer restarted goes on, and a canary's watch with it
(``watchdog.resumed``): while a canary is watched, what the watchdog is fed is appended to
``canary_watch.jsonl`` beside the history (a header naming the trial, then one line per
decision and end, lengths and outcomes only, wall-clock times), written at each watch tick
(every 0.25 s) and rewritten with only the window when it has grown past
``_JOURNAL_COMPACT_BYTES`` and twice its last size. A restarted streamer rebuilds the watch
from the trial's version (start, thresholds) and that journal. Lost: what was fed in the
last tick before the crash, and the requests open at the crash (they end as failed, which
the watchdog does not count, and their waits with them); nothing ends while the streamer
is down (every terminal goes through it). A journal that is missing, names another trial
or cannot be read leaves the watch with empty windows (the trial's start kept); a line
that cannot be read is skipped.
"""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import msgspec
import structlog

from bus.identity import Identity, Refusal, acting_operator
from components.tenancy.canary import in_canary
from components.tenancy.watchdog import Decided, Ended, Verdict, Watchdog, resumed
from schemas.client import ConfigAnswer, ConfigCommand
from schemas.config import AdmissionConfig, WeirConfig
from schemas.config_change import ENGINE, ConfigHistory, ConfigVersion, PolicySections
from schemas.wire import PolicyChange, PolicyTrial

WATCHDOG = "watchdog"
log = structlog.get_logger("streamer")
HISTORY_FILE = "config_history.json"
WATCH_FILE = "canary_watch.jsonl"
_JOURNAL_COMPACT_BYTES = 8 * 2**20


def history_path(config: WeirConfig) -> Path | None:
    """Where the engine's history is kept: in ``topology.run_dir`` (None: no run
    directory, so in memory only)."""
    run_dir = config.topology.run_dir
    return Path(run_dir) / HISTORY_FILE if run_dir else None


class SavedHistory(msgspec.Struct, frozen=True):
    """The history on disk: the digest of the config the engine started with, every
    version and the sections it put in force."""

    boot: str
    versions: tuple[ConfigVersion, ...]
    sections: tuple[PolicySections, ...]


class WatchHead(msgspec.Struct, frozen=True):
    """The canary journal's first line: the trial it watches (its version and hash), and
    the canary requests of the trial that ended before its first sample (a compacted
    journal dropped them)."""

    trial: int
    sha256: str
    canary_ended_before: int = 0


_sample = msgspec.json.Decoder(Ended | Decided)


class WatchJournal:
    """What the canary's watchdog was fed, on disk (the module's docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pending: list[Ended | Decided] = []      # ``at`` monotonic, not yet written
        self.size = 0                                 # bytes in the file
        self.compacted = 0                            # its size after the last rewrite

    def begin(self, head: WatchHead, samples: Sequence[Ended | Decided] = (),
              shift: float = 0.0) -> None:
        """Write a new journal: ``head`` and ``samples`` (their ``at`` + ``shift``: wall)."""
        self.pending.clear()
        lines = [msgspec.json.encode(head)] + [
            msgspec.json.encode(msgspec.structs.replace(s, at=s.at + shift)) for s in samples]
        data = b"\n".join(lines) + b"\n"
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
            self.size = self.compacted = len(data)
        except OSError as exc:        # the watch goes on; a restart would start it empty
            log.warning("canary_watch_not_saved", path=str(self.path), error=str(exc))

    def flush(self, shift: float) -> bool:
        """Append what is pending (``at`` + ``shift``: wall seconds). True when the file
        is due to be compacted."""
        if self.pending:
            data = b"".join(msgspec.json.encode(msgspec.structs.replace(s, at=s.at + shift))
                            + b"\n" for s in self.pending)
            self.pending.clear()
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
                self.size += len(data)
            except OSError as exc:
                log.warning("canary_watch_not_saved", path=str(self.path), error=str(exc))
        return self.size > max(_JOURNAL_COMPACT_BYTES, 2 * self.compacted)

    def end(self) -> None:
        self.pending.clear()
        self.path.unlink(missing_ok=True)

    @staticmethod
    def read(path: Path) -> tuple[WatchHead, list[Ended | Decided]] | None:
        """The journal's head and samples (None: none, or its head is unreadable)."""
        try:
            lines = path.read_bytes().split(b"\n")
            head = msgspec.json.decode(lines[0], type=WatchHead)
        except (OSError, msgspec.DecodeError, ValueError):
            return None
        samples, bad = [], 0
        for line in lines[1:]:
            if not line:
                continue
            try:
                samples.append(_sample.decode(line))
            except (msgspec.DecodeError, ValueError):
                bad += 1                           # a line torn by the crash, at the end
        if bad:
            log.warning("canary_watch_lines_skipped", path=str(path), lines=bad)
        return head, samples


class LiveConfig:
    """``path``: where the history is kept (None: in memory only); the canary's journal
    beside it. ``now``, ``mono``: the wall and monotonic clocks at start."""

    def __init__(self, boot: WeirConfig, now: float, path: Path | None = None,
                 mono: float = 0.0) -> None:
        self.path = path
        self.restored = False              # the history was read back from ``path``
        self.history = ConfigHistory(boot, now)
        self.watchdog: Watchdog | None = None
        self.journal = WatchJournal(path.with_name(WATCH_FILE)) if path is not None else None
        self.counts: Counter[str] = Counter({"applied": 0, "shadowing": 0, "canaries": 0,
                                             "promoted": 0, "rolled_back": 0,
                                             "resumed": 0})
        if path is None or not path.exists():
            return
        try:
            saved = msgspec.json.decode(path.read_bytes(), type=SavedHistory)
        except (OSError, msgspec.DecodeError, ValueError) as exc:
            log.warning("config_history_unreadable", path=str(path), error=str(exc)[:200])
            try:
                path.replace(path.with_name(path.name + ".unreadable"))
            except OSError:
                pass
            return
        self.history = ConfigHistory.resumed(boot, list(saved.versions), list(saved.sections),
                                             saved.boot, now, ENGINE)
        self.restored = len(saved.versions) > 0
        log.info("config_history_resumed", version=self.history.current.version)
        self._resume_watch(now, mono)

    def _resume_watch(self, now: float, mono: float) -> None:
        """The canary's watch, rebuilt from the trial's version and the journal."""
        h, journal = self.history, self.journal
        if journal is None:
            return
        if h.trial is None or self.history.versions[h.trial].rollout != "canary":
            journal.end()
            return
        trial, rollout = h.versions[h.trial], h.sections[h.trial].rollout
        got = WatchJournal.read(journal.path)
        head = WatchHead(trial.version, trial.sha256)
        samples: list[Ended | Decided] = []
        ours = got is not None and (got[0].trial, got[0].sha256) == (trial.version,
                                                                     trial.sha256)
        if ours and got is not None:
            head, samples = got
        self.watchdog = resumed(rollout, trial.applied_at, samples,
                                head.canary_ended_before, now, mono)
        self.counts["resumed"] += 1
        self._compact(now - mono)
        log.info("canary_watch_resumed", version=trial.version, share=rollout.share,
                 running_s=round(now - trial.applied_at, 3), journal=ours,
                 samples=len(samples), canary_ended=self.watchdog.canary_ended)

    def _compact(self, shift: float) -> None:
        """Rewrite the journal with the watch's window (the samples it still holds)."""
        w, h = self.watchdog, self.history
        if self.journal is None or w is None or h.trial is None:
            return
        trial = h.versions[h.trial]
        held: list[Ended | Decided] = [*w.ends, *w.decisions]
        held.sort(key=lambda s: s.at)
        before = w.canary_ended - sum(e.canary for e in w.ends)
        self.journal.begin(WatchHead(trial.version, trial.sha256, before), held, shift)

    def _save(self) -> None:
        if self.path is None:
            return
        h = self.history
        saved = SavedHistory(ENGINE.sections.of(h.boot).digest(), tuple(h.versions),
                             tuple(h.sections))
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(msgspec.json.encode(saved))
            os.replace(tmp, self.path)
        except OSError as exc:       # applied all the same; a restart would not know it
            log.warning("config_history_not_saved", path=str(self.path), error=str(exc))

    def change(self) -> PolicyChange:
        """The version in force (and the trial beside it), as admission and the scheduler
        are sent it."""
        h = self.history
        settled = h.versions[h.settled]
        trial = None
        if h.trial is not None:
            t = h.versions[h.trial]
            trial = PolicyTrial(t.version, t.sha256, h.sections[h.trial])
        return PolicyChange(settled.version, settled.sha256, h.sections[h.settled], trial)

    def command(self, cmd: ConfigCommand, who: Identity | Refusal, now: float,
                mono: float = 0.0) -> tuple[ConfigAnswer, PolicyChange | None]:
        """The answer to ``cmd`` (from the key ``who``), and the change to send when it
        made a version. ``now``: wall seconds (the history's); ``mono``: monotonic (the
        watchdog's)."""
        by = acting_operator(who, cmd.actor)
        if by is None:
            return ConfigAnswer(cmd.query_id, "config commands need an operator's key"), None
        h = self.history
        if cmd.action == "history":
            return ConfigAnswer(cmd.query_id, None, h.current, tuple(h.versions)), None
        made = (h.apply(cmd.toml, by, now) if cmd.action == "apply"
                else h.rollback(cmd.version, by, now))
        if not isinstance(made, ConfigVersion):
            return ConfigAnswer(cmd.query_id, made.message, h.current), None
        self._made(made, now, mono)
        return ConfigAnswer(cmd.query_id, None, made), self.change()

    def _made(self, v: ConfigVersion, now: float, mono: float) -> None:
        self._save()
        self.counts["applied"] += 1
        self.counts[{"off": "settled", "shadow": "shadowing", "canary": "canaries"}[
            v.rollout]] += 1
        trial = self.history.trial
        self.watchdog = None if v.rollout != "canary" or trial is None else Watchdog(
            self.history.sections[trial].rollout, mono)
        if self.journal is not None:
            if self.watchdog is None:
                self.journal.end()
            else:
                self.journal.begin(WatchHead(v.version, v.sha256))

    # ------------------------------------------------------------------ the canary
    def admission(self, tenant: str) -> AdmissionConfig:
        """The admission config that decides ``tenant``'s requests (what the streamer
        resolves a request's class and deadline by): a canary's candidate for the tenants
        under its share, the settled config's for the rest (and for all in shadow)."""
        h = self.history
        if h.trial is not None:
            trial: PolicySections = h.sections[h.trial]
            if trial.rollout.mode == "canary" and in_canary(tenant, trial.rollout.share):
                return trial.admission
        return h.config.admission

    def canary(self, tenant: str) -> bool | None:
        """Whether the canary watched now takes ``tenant`` (None: none is watched)."""
        if self.watchdog is None:
            return None
        return in_canary(tenant, self.watchdog.cfg.share)

    def decided(self, at: float, started: float, tenant: str, service_class: str,
                admitted: bool) -> None:
        """Admission decided a request of ``tenant`` (arrived at ``started``)."""
        w = self.watchdog
        if w is not None and started >= w.started:
            d = Decided(at, in_canary(tenant, w.cfg.share), tenant, service_class, admitted)
            w.decided(d)
            if self.journal is not None:
                self.journal.pending.append(d)

    def ended(self, e: Ended, started: float) -> None:
        """A request (arrived at ``started``) ended as ``e`` (its side set here)."""
        w = self.watchdog
        if w is not None and started >= w.started:
            w.ended(e)
            if self.journal is not None:
                self.journal.pending.append(e)

    def watch(self, now: float, mono: float, waiting: dict[tuple[bool, str], float]
              ) -> tuple[Verdict, ConfigVersion, PolicyChange] | None:
        """The watchdog's verdict now, carried out: the new version and the change to send
        (None: no canary, or no verdict yet)."""
        if self.watchdog is None:
            return None
        verdict = self.watchdog.verdict(mono, waiting)
        if verdict is None:
            if self.journal is not None and self.journal.flush(now - mono):
                self._compact(now - mono)
            return None
        h = self.history
        made = (h.promote(WATCHDOG, now, verdict.reason) if verdict.action == "promote"
                else h.rollback(None, WATCHDOG, now, verdict.reason))
        self.watchdog = None
        if self.journal is not None:
            self.journal.end()
        if not isinstance(made, ConfigVersion):        # the settled config always applies
            raise RuntimeError(made.message)
        self._save()
        self.counts["applied"] += 1
        self.counts["promoted" if verdict.action == "promote" else "rolled_back"] += 1
        return verdict, made, self.change()

    def stats(self) -> dict[str, float]:
        h = self.history
        out: dict[str, float] = {f"rollout.{k}": v for k, v in self.counts.items()}
        trial = h.versions[h.trial] if h.trial is not None else None
        out["rollout.trial_version"] = trial.version if trial else 0
        out["rollout.shadow"] = float(trial is not None and trial.rollout == "shadow")
        out["rollout.canary_share"] = self.watchdog.cfg.share if self.watchdog else 0.0
        out["rollout.canary_ended"] = self.watchdog.canary_ended if self.watchdog else 0
        return out
