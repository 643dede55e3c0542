"""The router's config versions (``weir config`` with ``--endpoint`` naming a router): an
operator's ``ConfigCommand`` checked and answered (``schemas/config_change.py``'s
``ROUTER`` scope decides), and the history kept on disk so that a restarted router goes on
with it.

The history is a JSON-lines file (``router.config_history``; by default
``router_config_history.jsonl`` in the router's run directory, which the supervisor keeps
across a restart of the router process): a ``start`` line with the digest of the config
the router started with, and a ``version`` line per version, with its live sections. A
restarted router reads it back (``ConfigHistory.resumed``): started with the same file, it
goes on with the version that was in force; started with a changed file, the file is a new
version (``startup``) and in force. A line cut short by a crash while it was written is
dropped; a file that cannot be read otherwise is set aside (``.unreadable``) and the
history starts again at version 0, with a warning. A write that fails keeps the version in
memory (counted: ``config.persist_errors``) and the router goes on.
"""
from __future__ import annotations

import os
from pathlib import Path

import msgspec
import structlog

from bus.identity import Identity, Refusal, acting_operator
from schemas.client import ConfigAnswer, ConfigCommand
from schemas.config import WeirConfig
from schemas.config_change import (
    ROUTER,
    ConfigHistory,
    ConfigVersion,
    Refused,
    RouterSections,
)

log = structlog.get_logger("router")
HISTORY_FILE = "router_config_history.jsonl"


class StartLine(msgspec.Struct, tag="start", frozen=True):
    boot: str                     # the digest of the config the router started with
    at: float


class VersionLine(msgspec.Struct, tag="version", frozen=True):
    version: ConfigVersion
    sections: RouterSections


_LINE = msgspec.json.Decoder(StartLine | VersionLine)


def history_path(config: WeirConfig) -> Path | None:
    """Where the router keeps its history (None: nowhere, in memory only)."""
    if config.router.config_history:
        return Path(config.router.config_history)
    return Path(config.topology.run_dir) / HISTORY_FILE if config.topology.run_dir else None


def read(path: Path) -> tuple[list[ConfigVersion], list[RouterSections], str]:
    """The versions saved in ``path``, their sections, and the last start's digest (none
    saved: empty). ``ValueError`` if the file is not a history."""
    versions: list[ConfigVersion] = []
    sections: list[RouterSections] = []
    boot = ""
    lines = path.read_bytes().split(b"\n")
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            line = _LINE.decode(raw)
        except msgspec.DecodeError as exc:
            if i == len(lines) - 1:          # the last line, cut short by a crash
                break
            raise ValueError(f"line {i + 1}: {exc}") from exc
        if isinstance(line, StartLine):
            boot = line.boot
        elif line.version.version != len(versions):
            raise ValueError(f"line {i + 1}: version {line.version.version} after "
                             f"{len(versions) - 1}")
        else:
            versions.append(line.version)
            sections.append(line.sections)
    return versions, sections, boot


def config_stats(live: RouterLiveConfig) -> dict[str, float]:
    """The version in force, and the writes that failed, for the router's stats."""
    return {"config_version": live.history.current.version,
            "config.persist_errors": live.persist_errors}


class RouterLiveConfig:
    def __init__(self, boot: WeirConfig, path: Path | None, now: float) -> None:
        self.path = path
        self.persist_errors = 0
        self.resumed_from = 0             # the versions read back at start
        saved: tuple[list[ConfigVersion], list[RouterSections], str] = ([], [], "")
        if path is not None and path.exists():
            try:
                saved = read(path)
            except (OSError, ValueError) as exc:
                log.warning("config_history_unreadable", path=str(path), error=str(exc))
                self._set_aside(path)
        self.resumed_from = len(saved[0])
        self.history = ConfigHistory.resumed(boot, *saved, now, ROUTER)
        # a canary by pool that ran when the router stopped: (its version, its pool); its
        # watch is over, so it is rolled back (a version by ``watchdog``, and each replica
        # of its pool that still runs it, as it answers: service.py)
        self.orphan: tuple[int, str] | None = None
        h = self.history
        last = len(saved[0]) - 1
        if last >= 0 and h.sections[last].trial:
            self.orphan = (last, h.sections[last].rollout.pool)
        booted = ROUTER.sections.of(boot).digest()
        new = self.history.versions[len(saved[0]):]
        if new or booted != saved[2]:
            self._write([StartLine(booted, now)] + [
                VersionLine(v, s) for v, s in zip(new, self.history.sections[len(saved[0]):],
                                                  strict=True)])
        if self.orphan is not None and h.current.version == self.orphan[0]:
            h.trial = self.orphan[0]
            self.end_trial(False, "watchdog", now, "the router restarted during the trial: "
                                                  "its watch is over")
        if saved[0]:
            log.info("config_history_resumed", versions=len(saved[0]),
                     version=self.history.current.version, file_changed=bool(new))

    @property
    def config(self) -> WeirConfig:
        """The config in force."""
        return self.history.config

    def command(self, cmd: ConfigCommand, who: Identity | Refusal,
                now: float) -> tuple[ConfigAnswer, WeirConfig | None]:
        """The answer to ``cmd`` (from the key ``who``), and the config to put in force
        when it made a version (saved before it is answered)."""
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
        self._write([VersionLine(made, h.sections[-1])])
        return ConfigAnswer(cmd.query_id, None, made), h.config

    def begin_trial(self, new: WeirConfig, by: str, now: float) -> ConfigVersion:
        """A canary by pool in force on its replicas (pool_canary.py): its trial version,
        saved."""
        v = self.history.begin_trial(new, by, now)
        self._write([VersionLine(v, self.history.sections[-1])])
        return v

    def end_trial(self, promote: bool, by: str, now: float,
                  reason: str) -> ConfigVersion | Refused:
        """The trial promoted (its admission in force here too) or rolled back (the settled
        version again): the new version, saved."""
        h = self.history
        made = h.promote(by, now, reason) if promote else h.rollback(None, by, now, reason)
        if isinstance(made, ConfigVersion):
            self._write([VersionLine(made, h.sections[-1])])
        return made

    def _write(self, lines: list[StartLine | VersionLine]) -> None:
        if self.path is None or not lines:
            return
        data = b"".join(msgspec.json.encode(line) + b"\n" for line in lines)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "ab") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            self.persist_errors += 1
            log.warning("config_history_not_saved", path=str(self.path), error=str(exc))

    @staticmethod
    def _set_aside(path: Path) -> None:
        try:
            path.replace(path.with_name(path.name + ".unreadable"))
        except OSError as exc:
            log.warning("config_history_not_set_aside", path=str(path), error=str(exc))
