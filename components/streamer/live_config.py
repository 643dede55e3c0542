"""The engine's config versions, kept by the streamer (where operators' commands arrive):
an operator's ``ConfigCommand`` checked and answered, and the ``PolicyChange`` admission
and the scheduler are sent when a version is made (``schemas/config_change.py`` decides).

The history is in the streamer's memory: it lives as long as the engine (a restarted
streamer starts again at version 0, the TOML the engine was started with, and sends that
to nobody: admission and the scheduler keep the version they run until a new one comes).
A restarted admission or scheduler starts from the TOML: the streamer sends it the
version in force again (``resend``).
"""
from __future__ import annotations

from bus.identity import Identity, Refusal, acting_operator
from schemas.client import ConfigAnswer, ConfigCommand
from schemas.config import WeirConfig
from schemas.config_change import ConfigHistory, ConfigVersion
from schemas.wire import PolicyChange


class LiveConfig:
    def __init__(self, boot: WeirConfig, now: float) -> None:
        self.history = ConfigHistory(boot, now)

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
        return ConfigAnswer(cmd.query_id, None, made), self.change()
