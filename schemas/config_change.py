"""A config change applied to a running engine or router: what a candidate changes, whether
it may be applied live, and the versions applied so far. Pure: no I/O, no clock (the caller
passes the time and the actor).

A candidate is a TOML text laid over the running config table by table: a field it gives
replaces the running value, a field it leaves out keeps it (an array of tables, such as
``admission.tenants``, is one field: given whole). The result is validated as any config
is (``WeirConfig``: a ``ConfigError`` names the bad field).

What may change live depends on the process (a ``Scope``). On an engine (``ENGINE``) it
is the policy: all of ``[admission]``, the scheduler's order and preemption rules, the
speculation limits, and ``[rollout]`` (the bars a candidate is judged by: a candidate file
carries its own). On a router (``ROUTER``) it is the routing policy and weights, the
fleet's tenant budgets and fleet-queue weights (``router.tenants``), the fleet queue's
bounds and the overload and reroute thresholds, and ``[admission]`` (the router reads only
the classes' deadlines and the tenants' classes from it, to rank replicas against a
request's deadline). Everything else was built into the process at its start (the model,
dtype, the KV pool, sockets, the executor's buffers, the router's replica list and
discovery) and is refused, each field named with why, and nothing is applied. Two changes
are refused inside the live sections too: removing a service class (a request admitted or
queued under it keeps it until it ends: a class may be changed or left unused, not
removed), and raising ``speculative.max_k`` past the engine's start (the draft buffers are
sized by it).

Every applied config is a ``ConfigVersion``: a number one past the last, the sha256 of
its live sections (canonical JSON, so one policy has one hash whatever the file's
layout), who applied it and when. Version 0 is the config the process started with. A
rollback applies an earlier version's live fields as a new version (history only grows).
A history saved by a process (an engine's streamer, a router: ``ConfigHistory.resumed``)
goes on across its restart, a trial running then included.

On an engine, a candidate whose ``[rollout] mode`` is "shadow" or "canary" is a *trial*:
it gets a version, but the version before it stays *settled* (in force for every request
the trial does not decide: all of them in shadow, the tenants outside the canary's share).
A trial ends by a new version: the candidate promoted (its sections, ``rollout.mode =
"off"``: ``promote``), the settled config restored (``rollback`` with no version), or
another apply. While a trial runs a candidate is laid over the settled config, not over
the trial. A trial may not add a service class or a tenant: what it admitted under one
would outlive its rollback (add it with mode "off" first). The TOML a process starts with
is never a trial (its mode is taken as "off": there is nothing to compare it with). A
router's one trial is a canary by replica pool (``[rollout] pool``): the candidate runs on
that pool's replicas, the router records it (``begin_trial``) and its watchdog ends it by
``promote`` or ``rollback`` (components/router/pool_canary.py); ``[rollout] pool`` applied
to an engine is refused.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from schemas.config import (
    AdmissionConfig,
    ConfigError,
    RolloutConfig,
    RouterConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WeirConfig,
)

Live = Mapping[str, bool | frozenset[str]]


class Sections(msgspec.Struct, frozen=True):
    """The live sections of a config (a subclass names them as its fields): what a version
    records and hashes."""

    def digest(self) -> str:
        """sha256 of the canonical encoding (sorted keys, every field, defaults included)."""
        canonical = msgspec.json.encode(msgspec.to_builtins(self), order="sorted")
        return hashlib.sha256(canonical).hexdigest()

    @classmethod
    def of(cls, config: WeirConfig) -> Any:
        return cls(**{name: getattr(config, name) for name in cls.__struct_fields__})

    def onto(self, config: WeirConfig) -> WeirConfig:
        """``config`` with these sections in force."""
        return msgspec.structs.replace(config, **{name: getattr(self, name)
                                                  for name in self.__struct_fields__})

    @property
    def trial(self) -> bool:
        """Whether these sections are a candidate on trial (shadow or canary; a router's:
        a canary by pool)."""
        rollout: RolloutConfig | None = getattr(self, "rollout", None)
        return rollout is not None and rollout.mode != "off"


class PolicySections(Sections, frozen=True, forbid_unknown_fields=True):
    """An engine's live sections: what a version records and what is fanned out to
    admission and the scheduler."""

    admission: AdmissionConfig
    scheduler: SchedulerConfig
    speculative: SpeculativeConfig
    rollout: RolloutConfig = RolloutConfig()   # the bars a candidate is judged by


class RouterSections(Sections, frozen=True, forbid_unknown_fields=True):
    """A router's live sections (its own, and the admission it resolves deadlines by); and
    what a canary by pool tries on its replicas (``begin_trial``): the engine's policy
    sections and the ``[rollout]`` bars (outside a trial, those of the router's TOML)."""

    admission: AdmissionConfig
    router: RouterConfig
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    rollout: RolloutConfig = RolloutConfig()


def _engine_checks(running: WeirConfig, new: WeirConfig, boot: WeirConfig) -> list[str]:
    if new.rollout.pool:
        return [f"rollout.pool {new.rollout.pool!r}: a canary by replica pool is a router's "
                "(apply it with --endpoint naming the router)"]
    if new.speculative.max_k > boot.speculative.max_k:
        return [f"speculative.max_k {new.speculative.max_k} is above the "
                f"{boot.speculative.max_k} the engine started with (its draft buffers are "
                "sized by it; lower it, or restart)"]
    return []


@dataclass(frozen=True)
class Scope:
    """What one kind of process may change live: ``live``, the fields (a whole section:
    True; or some of its fields); ``restart_why``, why any other field needs a restart, by
    ``section.field`` or by section (the refusal's words); ``elsewhere``, the sections
    another kind of process reads, and where to apply them instead; ``sections``, what a
    version records; ``checks``, refusals inside the live fields beyond the common ones."""

    kind: str
    live: Live
    restart_why: Mapping[str, str]
    elsewhere: Mapping[str, str]
    sections: type[Sections]
    checks: Callable[[WeirConfig, WeirConfig, WeirConfig], list[str]] = lambda *_: []

    def is_live(self, field: str) -> bool:
        section, _, name = field.partition(".")
        live = self.live.get(section, False)
        return live is True or (isinstance(live, frozenset) and name in live)

    def refusal(self, field: str) -> str:
        """Why ``field`` is not changed live here (one line)."""
        section = field.partition(".")[0]
        if section in self.elsewhere:
            return f"{field} is {self.elsewhere[section]}"
        why = self.restart_why.get(field) or self.restart_why.get(
            section, "it is read only at start")
        return f"{field} needs a restart ({why})"


_SOCKETS = "sockets are bound at start"
ENGINE = Scope(
    "engine",
    {"admission": True,
     "scheduler": frozenset({"fairness", "chunking", "urgency_preemption"}),
     "speculative": frozenset({"max_k", "control", "acceptance_prior", "class_priors"}),
     "rollout": True},
    {"engine": "the model, dtype and device are loaded at start",
     "kv": "the KV pool is sized and allocated at start",
     "topology": _SOCKETS,
     "bus": _SOCKETS,
     "scheduler": "the executor's batch buffers and step pipeline are sized at start",
     "speculative": "the draft method and model are loaded at start"},
    {"router": "a router's: apply it with --endpoint naming the router"},
    PolicySections,
    _engine_checks,
)

_DISCOVERY = "discovery is set up at start"
_TIMING = "the replicas' heartbeat and load-report timing is set at start"
ROUTER = Scope(
    "router",
    {"admission": True,
     "router": frozenset({"policy", "weights", "overload_ttft_s", "kv_high",
                          "reroute_attempts", "default_prefill_tokens_per_s", "tenants",
                          "fleet_queue_max", "fleet_queue_max_wait_s"})},
    {"router.replicas": "the replica list is read at start; change it live with "
                        "`weir replicas add/remove`",
     **{f"router.{f}": _DISCOVERY for f in (
         "discovery", "discovery_name", "discovery_pools", "discovery_port",
         "discovery_kv_events_port",
         "discovery_interval_s", "discovery_misses")},
     **{f"router.{f}": _TIMING for f in (
         "heartbeat_interval_s", "heartbeat_timeout_s", "load_interval_s")},
     "router.session_ttl_s": "the session table is made at start",
     "router.max_sessions": "the session table is made at start",
     "router.fleet_queue": "the fleet queue is made or not at start; its bounds change "
                           "live",
     "engine": "the router's tokenizer and prompt bounds are loaded at start",
     "kv": "the router hashes prompts in blocks of the size set at start",
     "topology": _SOCKETS,
     "bus": _SOCKETS,
     "gateway": "the API keys and the HTTP gateway are read at start"},
    {s: "an engine's: apply it to each replica with --endpoint naming it"
     for s in ("scheduler", "speculative", "rollout")},
    RouterSections,
)

# the engine's (kept for the callers that predate scopes)
LIVE = ENGINE.live


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


def is_live(field: str, scope: Scope = ENGINE) -> bool:
    return scope.is_live(field)


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


def live_fields(source: WeirConfig, running: WeirConfig, scope: Scope) -> WeirConfig:
    """``running`` with ``source``'s live fields (what a rollback, or a history resumed
    after a restart, puts back: the fields read only at start stay as they are)."""
    src, out = msgspec.to_builtins(source), msgspec.to_builtins(running)
    for section, live in scope.live.items():
        if isinstance(live, bool):
            if live:
                out[section] = src[section]
        else:
            out[section] = {**out[section], **{k: src[section][k] for k in live
                                               if k in src[section]}}
    return msgspec.convert(out, WeirConfig)


def changed_fields(running: WeirConfig, new: WeirConfig) -> list[str]:
    """The dotted names of the fields whose values differ, sorted."""
    a, b = _flatten(msgspec.to_builtins(running)), _flatten(msgspec.to_builtins(new))
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def check(running: WeirConfig, new: WeirConfig, boot: WeirConfig,
          scope: Scope = ENGINE) -> list[str]:
    """Why ``new`` cannot replace ``running`` live (empty: it can). ``boot``: the config
    the process started with (what its buffers were sized by)."""
    reasons = [scope.refusal(name) for name in changed_fields(running, new)
               if not scope.is_live(name)]
    gone = sorted(set(running.admission.service_classes()) - set(new.admission.service_classes()))
    if gone:
        reasons.append(f"admission.classes removes {', '.join(gone)}: requests in flight keep "
                       "their class (change it or leave it unused)")
    return reasons + scope.checks(running, new, boot)


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
    """The versions applied to one process, in order; the settled config (in force: a
    version's sections on the boot config) and, on an engine, the trial beside it, if one
    runs."""

    STARTUP: ClassVar[str] = "startup"

    def __init__(self, boot: WeirConfig, started_at: float, scope: Scope = ENGINE) -> None:
        if boot.rollout.mode != "off":
            boot = msgspec.structs.replace(
                boot, rollout=msgspec.structs.replace(boot.rollout, mode="off"))
        self.boot = boot
        self.scope = scope
        self.sections: list[Any] = [scope.sections.of(boot)]
        self.versions = [ConfigVersion(0, self.sections[0].digest(), self.STARTUP,
                                       started_at)]
        self.settled = 0                      # the version in force
        self.trial: int | None = None         # the version on trial beside it

    @classmethod
    def resumed(cls, boot: WeirConfig, versions: list[ConfigVersion], sections: list[Any],
                last_boot: str, now: float, scope: Scope) -> ConfigHistory:
        """A history saved before a restart, going on. ``last_boot``: the digest of the
        config the process started with last time. The same file again: the version in
        force then is in force now (its live fields over the file), and a trial running
        then (the last version) goes on beside it (its watch is the caller's to resume).
        A changed file: it is a new version, applied by ``startup``, and in force (what the
        operator restarted with wins over what was applied before); a trial running then
        is over."""
        h = cls(boot, now, scope)
        if not versions or len(versions) != len(sections):
            return h
        h.versions, h.sections = list(versions), list(sections)
        h.settled = max(i for i, s in enumerate(h.sections) if not s.trial)
        booted = scope.sections.of(h.boot)
        if booted.digest() == last_boot:
            h.sections[h.settled] = scope.sections.of(live_fields(
                h.sections[h.settled].onto(h.boot), h.boot, scope))
            if h.sections[-1].trial:
                h.trial = len(h.sections) - 1
            return h
        before = h.config
        h.sections.append(booted)
        h.versions.append(ConfigVersion(len(h.versions), booted.digest(), cls.STARTUP, now,
                                        tuple(changed_fields(before, h.boot))))
        h.settled = len(h.versions) - 1
        return h

    @property
    def current(self) -> ConfigVersion:
        return self.versions[-1]

    @property
    def config(self) -> WeirConfig:
        """The settled config (what a candidate is laid over)."""
        return self._onto(self.settled)

    def _onto(self, i: int) -> WeirConfig:
        sections: Sections = self.sections[i]
        return sections.onto(self.boot)

    def promote(self, by: str, now: float, reason: str = "") -> ConfigVersion | Refused:
        """Put the trial's candidate in force (its sections with ``rollout.mode = "off"``)."""
        if self.trial is None:
            return Refused(("no candidate is on trial",))
        sections = self.sections[self.trial]
        off = msgspec.structs.replace(sections.rollout, mode="off", pool="")
        new = msgspec.structs.replace(sections, rollout=off).onto(self.boot)
        return self._record(live_fields(new, self.config, self.scope), by, now, None,
                            self.trial, reason)

    def begin_trial(self, new: WeirConfig, by: str, now: float) -> ConfigVersion:
        """Record ``new`` (a trial: its ``rollout.mode`` is not "off"; checked by the
        caller) beside the settled config: a router's canary by pool, which its replicas
        run, not the router."""
        sections: Sections = self.scope.sections.of(new)
        assert sections.trial, "begin_trial takes a trial"
        v = ConfigVersion(len(self.versions), sections.digest(), by, now,
                          tuple(changed_fields(self.config, new)), None, new.rollout.mode)
        self.sections.append(sections)
        self.versions.append(v)
        self.trial = v.version
        return v

    def apply(self, toml_text: str, by: str, now: float) -> ConfigVersion | Refused:
        """Apply a candidate: its new version, or why none was made."""
        try:
            new = candidate(self.config, toml_text)
        except ConfigError as exc:
            return Refused((str(exc),))
        return self._record(new, by, now, None)

    def rollback(self, version: int | None, by: str, now: float,
                 reason: str = "") -> ConfigVersion | Refused:
        """Apply version ``version``'s live fields again (None: while a trial runs, the
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
        return self._record(live_fields(self._onto(target), self.config, self.scope), by,
                            now, target, reason=reason)

    def _record(self, new: WeirConfig, by: str, now: float, rollback_of: int | None,
                promotion_of: int | None = None, reason: str = "") -> ConfigVersion | Refused:
        running = self.config
        reasons = check(running, new, self.boot, self.scope)
        sections: Sections = self.scope.sections.of(new)
        if sections.trial:
            reasons += check_trial(running, new)
        if reasons:
            return Refused(tuple(reasons))
        # what it changes for someone: against the trial while one runs
        before = running if self.trial is None else self._onto(self.trial)
        v = ConfigVersion(len(self.versions), sections.digest(), by, now,
                          tuple(changed_fields(before, new)), rollback_of,
                          new.rollout.mode if sections.trial else "off", promotion_of, reason)
        self.sections.append(sections)
        self.versions.append(v)
        if sections.trial:
            self.trial = v.version
        else:
            self.settled, self.trial = v.version, None
        return v
