"""A config change applied to a running engine: what a candidate changes, whether it may be
applied live, and the versions applied so far. Pure: no I/O, no clock (the caller passes
the time and the actor).

A candidate is a TOML text laid over the running config table by table: a field it gives
replaces the running value, a field it leaves out keeps it (an array of tables, such as
``admission.tenants``, is one field: given whole). The result is validated as any config
is (``WeirConfig``: a ``ConfigError`` names the bad field).

What may change live is the policy (``LIVE``): all of ``[admission]``, the scheduler's
order and preemption rules, and the speculation limits. Everything else was built into a
process at its start (the model, dtype, the KV pool, sockets, the executor's buffers) and
is refused, each field named with why, and nothing is applied. Two changes are refused
inside the live sections too: removing a service class (a request admitted or queued
under it keeps it until it ends: a class may be changed or left unused, not removed), and
raising ``speculative.max_k`` past the engine's start (the draft buffers are sized by it).

Every applied config is a ``ConfigVersion``: a number one past the last, the sha256 of
its live sections (canonical JSON, so one policy has one hash whatever the file's
layout), who applied it and when. Version 0 is the config the engine started with. A
rollback applies an earlier version's live sections as a new version (history only
grows).

A candidate whose ``[rollout] mode`` is "shadow" or "canary" is a *trial*: it gets a
version, but the version before it stays *settled* (in force for every request the trial
does not decide: all of them in shadow, the tenants outside the canary's share). A trial
ends by a new version: the candidate promoted (its sections, ``rollout.mode = "off"``:
``promote``), the settled config restored (``rollback`` with no version), or another
apply. While a trial runs a candidate is laid over the settled config, not over the
trial. A trial may not add a service class or a tenant: what it admitted under one would
outlive its rollback (add it with mode "off" first). The TOML an engine starts with is
never a trial (its mode is taken as "off": there is nothing to compare it with).
"""
from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from schemas.config import (
    AdmissionConfig,
    ConfigError,
    RolloutConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WeirConfig,
)

# the fields that may change while the engine runs: a whole section (True) or some of its
# fields
LIVE: dict[str, bool | frozenset[str]] = {
    "admission": True,
    "scheduler": frozenset({"fairness", "chunking", "urgency_preemption"}),
    "speculative": frozenset({"max_k", "control", "acceptance_prior", "class_priors"}),
    "rollout": True,
}

# why a field outside ``LIVE`` needs a restart, by section (the refusal's words)
_RESTART_WHY = {
    "engine": "the model, dtype and device are loaded at start",
    "kv": "the KV pool is sized and allocated at start",
    "topology": "sockets are bound at start",
    "scheduler": "the executor's batch buffers and step pipeline are sized at start",
    "speculative": "the draft method and model are loaded at start",
    "router": "a router's weights and policy are not yet applied live (restart it)",
}


class PolicySections(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The live part of a config: what a version records and what is fanned out to
    admission and the scheduler."""

    admission: AdmissionConfig
    scheduler: SchedulerConfig
    speculative: SpeculativeConfig
    rollout: RolloutConfig = RolloutConfig()

    @classmethod
    def of(cls, config: WeirConfig) -> PolicySections:
        return cls(config.admission, config.scheduler, config.speculative, config.rollout)

    def digest(self) -> str:
        """sha256 of the canonical encoding (sorted keys, every field, defaults included)."""
        canonical = msgspec.json.encode(msgspec.to_builtins(self), order="sorted")
        return hashlib.sha256(canonical).hexdigest()

    def onto(self, config: WeirConfig) -> WeirConfig:
        """``config`` with these sections in force."""
        return msgspec.structs.replace(config, admission=self.admission,
                                       scheduler=self.scheduler, speculative=self.speculative,
                                       rollout=self.rollout)

    @property
    def trial(self) -> bool:
        """Whether these sections are a candidate on trial (shadow or canary)."""
        return self.rollout.mode != "off"


class ConfigVersion(msgspec.Struct, frozen=True):
    """One applied config: its number, the sha256 of its live sections, who applied it
    (the operator key's name, and the actor the client named), when (unix seconds), and
    what it changed (dotted field names; a rollback says which version it restored).
    ``rollout``: "off" for a config put in force, "shadow" or "canary" for a trial;
    ``promotion_of``: the trial a promotion put in force; ``reason``: why the watchdog
    promoted or rolled back."""

    version: int
    sha256: str
    applied_by: str
    applied_at: float
    changed: tuple[str, ...] = ()
    rollback_of: int | None = None
    rollout: str = "off"
    promotion_of: int | None = None
    reason: str = ""


class Refused(msgspec.Struct, frozen=True):
    """A candidate that was not applied, with every reason (one line each)."""

    reasons: tuple[str, ...]

    @property
    def message(self) -> str:
        return "config not applied: " + "; ".join(self.reasons)


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
    """``{"section.field": value}`` (a top-level scalar keeps its own name)."""
    out: dict[str, Any] = {}
    for section, values in config.items():
        if isinstance(values, dict):
            out.update({f"{section}.{k}": v for k, v in values.items()})
        else:
            out[section] = values
    return out


def _overlay(running: dict[str, Any], candidate: dict[str, Any]) -> dict[str, Any]:
    merged = dict(running)
    for section, values in candidate.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section] = {**merged[section], **values}
        else:
            merged[section] = values
    return merged


def is_live(field: str) -> bool:
    section, _, name = field.partition(".")
    live = LIVE.get(section, False)
    return live is True or (isinstance(live, frozenset) and name in live)


def candidate(running: WeirConfig, toml_text: str) -> WeirConfig:
    """``toml_text`` laid over ``running`` and validated (``ConfigError`` if it is not a
    config)."""
    try:
        raw = msgspec.toml.decode(toml_text.encode())
    except msgspec.DecodeError as exc:
        raise ConfigError(f"not TOML: {exc}") from exc
    try:
        return msgspec.convert(_overlay(msgspec.to_builtins(running), raw), WeirConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config: {exc}") from exc


def changed_fields(running: WeirConfig, new: WeirConfig) -> list[str]:
    """The dotted names of the fields whose values differ, sorted."""
    a, b = _flatten(msgspec.to_builtins(running)), _flatten(msgspec.to_builtins(new))
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def check(running: WeirConfig, new: WeirConfig, boot: WeirConfig) -> list[str]:
    """Why ``new`` cannot replace ``running`` live (empty: it can). ``boot``: the config
    the engine started with (what its buffers were sized by)."""
    reasons = []
    for name in changed_fields(running, new):
        if not is_live(name):
            section = name.partition(".")[0]
            why = _RESTART_WHY.get(section, "it is read only at start")
            reasons.append(f"{name} needs a restart ({why})")
    gone = sorted(set(running.admission.service_classes()) - set(new.admission.service_classes()))
    if gone:
        reasons.append(f"admission.classes removes {', '.join(gone)}: requests in flight keep "
                       "their class (change it or leave it unused)")
    if new.speculative.max_k > boot.speculative.max_k:
        reasons.append(f"speculative.max_k {new.speculative.max_k} is above the "
                       f"{boot.speculative.max_k} the engine started with (its draft "
                       "buffers are sized by it; lower it, or restart)")
    return reasons


def check_trial(running: WeirConfig, new: WeirConfig) -> list[str]:
    """Why ``new`` cannot go on trial beside ``running`` (empty: it can)."""
    reasons = []
    for what, old, now in (
            ("service class", running.admission.service_classes(),
             new.admission.service_classes()),
            ("tenant", running.admission.tenants_by_name, new.admission.tenants_by_name)):
        added = sorted(set(now) - set(old))
        if added:
            reasons.append(f"a {new.rollout.mode} trial adds the {what} {', '.join(added)}: "
                           "what it admitted under it would outlive a rollback (add it with "
                           "rollout.mode = \"off\" first)")
    return reasons


class ConfigHistory:
    """The versions applied to one engine, in order; the settled config (in force) and
    the trial beside it, if one runs."""

    def __init__(self, boot: WeirConfig, started_at: float) -> None:
        if boot.rollout.mode != "off":
            boot = msgspec.structs.replace(
                boot, rollout=msgspec.structs.replace(boot.rollout, mode="off"))
        self.boot = boot
        self.sections = [PolicySections.of(boot)]
        self.versions = [ConfigVersion(0, self.sections[0].digest(), "startup", started_at)]
        self.settled = 0                      # the version in force
        self.trial: int | None = None         # the version on trial beside it

    @property
    def current(self) -> ConfigVersion:
        return self.versions[-1]

    @property
    def config(self) -> WeirConfig:
        """The settled config (what a candidate is laid over)."""
        return self.sections[self.settled].onto(self.boot)

    def promote(self, by: str, now: float, reason: str = "") -> ConfigVersion | Refused:
        """Put the trial's candidate in force (its sections with ``rollout.mode = "off"``)."""
        if self.trial is None:
            return Refused(("no candidate is on trial",))
        sections = self.sections[self.trial]
        off = msgspec.structs.replace(sections.rollout, mode="off")
        new = msgspec.structs.replace(sections, rollout=off).onto(self.boot)
        return self._record(new, by, now, None, self.trial, reason)

    def apply(self, toml_text: str, by: str, now: float) -> ConfigVersion | Refused:
        """Apply a candidate: its new version, or why none was made."""
        try:
            new = candidate(self.config, toml_text)
        except ConfigError as exc:
            return Refused((str(exc),))
        return self._record(new, by, now, None)

    def rollback(self, version: int | None, by: str, now: float,
                 reason: str = "") -> ConfigVersion | Refused:
        """Apply version ``version``'s sections again (None: while a trial runs, the
        settled config, which ends the trial; else the version before the current)."""
        if version is None:
            target = self.settled if self.trial is not None else self.current.version - 1
        else:
            target = version
        if not 0 <= target < len(self.versions):
            return Refused((f"no version {target} (versions 0..{self.current.version})",))
        if self.sections[target].trial:
            return Refused((f"version {target} was a {self.versions[target].rollout} trial, "
                            "never in force: apply its file again to try it again",))
        return self._record(self.sections[target].onto(self.boot), by, now, target,
                            reason=reason)

    def _record(self, new: WeirConfig, by: str, now: float, rollback_of: int | None,
                promotion_of: int | None = None, reason: str = "") -> ConfigVersion | Refused:
        running = self.config
        reasons = check(running, new, self.boot)
        if new.rollout.mode != "off":
            reasons += check_trial(running, new)
        if reasons:
            return Refused(tuple(reasons))
        sections = PolicySections.of(new)
        # what it changes for someone: against the trial while one runs
        before = running if self.trial is None else self.sections[self.trial].onto(self.boot)
        v = ConfigVersion(len(self.versions), sections.digest(), by, now,
                          tuple(changed_fields(before, new)), rollback_of,
                          new.rollout.mode, promotion_of, reason)
        self.sections.append(sections)
        self.versions.append(v)
        if sections.trial:
            self.trial = v.version
        else:
            self.settled, self.trial = v.version, None
        return v
