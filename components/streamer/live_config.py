"""The engine's config versions, kept by the streamer (where operators' commands arrive):
an operator's ``ConfigCommand`` checked and answered, and the ``PolicyChange`` admission
and the scheduler are sent when a version is made (``schemas/config_change.py`` decides).

The history is written to ``config_history.json`` in the engine's run directory (which
the supervisor keeps across a restart of the streamer) each time a version is made,
before admission and the scheduler are sent it. A restarted streamer reads it back
(``ConfigHistory.resumed``: the engine's TOML is the same, so the version in force goes
on) and sends that version again, so one its predecessor recorded but died before sending
reaches them. A file that cannot be read is set aside (``.unreadable``) and the history
starts again at version 0; a write that fails keeps the version in memory. A new engine
(a new run directory) starts from its TOML. A restarted admission or scheduler starts
from the TOML: the streamer sends it the version in force again (``resend``).
"""
from __future__ import annotations

import os
from pathlib import Path

import msgspec
import structlog

from bus.identity import Identity, Refusal, acting_operator
from schemas.client import ConfigAnswer, ConfigCommand
from schemas.config import WeirConfig
from schemas.config_change import ENGINE, ConfigHistory, ConfigVersion, PolicySections
from schemas.wire import PolicyChange

log = structlog.get_logger("streamer")
HISTORY_FILE = "config_history.json"


class SavedHistory(msgspec.Struct, frozen=True):
    """The history on disk: the digest of the config the engine started with, every
    version and the sections it put in force."""

    boot: str
    versions: tuple[ConfigVersion, ...]
    sections: tuple[PolicySections, ...]


class LiveConfig:
    """``path``: where the history is kept (None: in memory only)."""

    def __init__(self, boot: WeirConfig, now: float, path: Path | None = None) -> None:
        self.path = path
        self.restored = False              # the history was read back from ``path``
        self.history = ConfigHistory(boot, now)
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
        """The version in force, as admission and the scheduler are sent it."""
        v = self.history.current
        return PolicyChange(v.version, v.sha256, self.history.sections[-1])

    def command(self, cmd: ConfigCommand, who: Identity | Refusal,
                now: float) -> tuple[ConfigAnswer, PolicyChange | None]:
        """The answer to ``cmd`` (from the key ``who``), and the change to send when it
        made a version."""
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
        self._save()
        return ConfigAnswer(cmd.query_id, None, made), self.change()
