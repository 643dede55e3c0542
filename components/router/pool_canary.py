"""A canary by replica pool: the router puts a candidate engine policy on the replicas of
one pool while the others keep the config they run, compares the two sides over sliding
windows, and rolls the candidate back or promotes it. Pure: no sockets, no clock (the
service passes ``now``, sends the commands and feeds the watchdog).

- **The candidate.** ``weir config apply CANDIDATE --endpoint ROUTER`` with ``[rollout]
  mode = "canary"`` and ``pool = "NAME"`` (``parse``). It may hold only an engine's policy
  sections (``[admission]``, ``[scheduler]``, ``[speculative]``) and ``[rollout]`` (its
  bars); laid over the router's settled config it must pass the engine's own live checks
  (``schemas/config_change.py``: ``ENGINE``, ``check_trial``). What each replica of the
  pool gets (``engine_toml``) is the candidate's tables as the operator wrote them, less
  ``[rollout]``: each replica lays it over its own running config, as ``weir config
  apply`` to that replica would, and puts it in force for all its requests (the pool is
  the canary's share).
- **The versions.** The router records the trial as a version of its own history
  (``rollout = "canary"``, its sha256 over the candidate as the router sees it); each
  replica records the candidate as a version of its own, applied by the router with the
  actor ``router canary vN`` (``actor``). A rollback sends each replica that took it
  ``weir config rollback`` to the version before it; a promotion sends the candidate to
  every replica of the other pools. Both are a new router version by ``watchdog``.
- **The comparison** is the engine's watchdog (``components/tenancy/watchdog.py``),
  canary = a placement on a replica of the pool once the candidate is in force there,
  baseline = a placement on any other pool. The router sees, per placement
  (``placement_end``): refusals (for load or budget: ``REFUSED``; a refusal the router
  reroutes counts against the pool that refused), the time to the first token against
  the request's TTFT deadline (its own or its class's) or its end-to-end cut (``finish
  reason "deadline"``), the tokens computed (uncached prompt and output) per good output
  token, and admit/refuse decisions per tenant and class (``placement_decision``).
  Requests placed before the trial began, and placements on a pool replica that has not
  yet taken the candidate, are not compared. The watchdog's verdict is asked only once the
  baseline has ``min_requests`` ended in the window: a request may be placed on both
  sides (refused by one pool, rerouted to the other), and the refusals end first, so a
  canary judged against a baseline still counting as empty was rolled back for the
  refusals both pools make (a good candidate, in the e2e test, before this rule).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from components.tenancy.watchdog import Decided, Ended, Watchdog
from schemas.client import Accepted, Finished, Rejected
from schemas.config import ConfigError, RolloutConfig, WeirConfig
from schemas.config_change import (
    ENGINE,
    ConfigVersion,
    Refused,
    candidate,
    check,
    check_trial,
)

SECTIONS = ("admission", "scheduler", "speculative", "rollout")
# refusals that are a policy's decision about load or budget (invalid requests are not)
REFUSED = frozenset({"overloaded", "tenant_over_budget", "deadline_unmeetable",
                     "deadline_expired", "queue_full", "tenant_token_budget",
                     "tenant_kv_budget", "kv_pressure", "tpot_slo_at_risk", "draining"})
ACTOR = "router canary v"


def actor(version: int) -> str:
    """The actor a replica records the router's apply of trial ``version`` under."""
    return f"{ACTOR}{version}"


@dataclass(frozen=True)
class Candidate:
    pool: str
    rollout: RolloutConfig
    engine_toml: str              # what each replica of the pool is sent
    config: WeirConfig            # the candidate laid over the router's settled config


def parse(settled: WeirConfig, boot: WeirConfig, toml_text: str) -> Candidate | Refused | None:
    """A canary by pool from ``toml_text`` (None: the text is not one; Refused: it is, and
    cannot run, with every reason)."""
    try:
        raw = msgspec.toml.decode(toml_text.encode())
    except msgspec.DecodeError:
        return None                            # the ordinary path says why
    rollout = raw.get("rollout")
    if not (isinstance(rollout, dict) and rollout.get("pool")):
        return None
    reasons = [f"[{s}] is not an engine's policy: a canary by pool carries only "
               f"{', '.join(f'[{x}]' for x in SECTIONS)} (apply the rest separately)"
               for s in sorted(raw) if s not in SECTIONS]
    if reasons:
        return Refused(tuple(reasons))
    try:
        new = candidate(settled, toml_text)
    except ConfigError as exc:
        return Refused((str(exc),))
    off = msgspec.structs.replace(
        new, rollout=msgspec.structs.replace(new.rollout, mode="off", pool=""))
    reasons = check(settled, off, boot, ENGINE) + check_trial(settled, new)
    if reasons:
        return Refused(tuple(reasons))
    engine = {s: v for s, v in raw.items() if s != "rollout"}
    if not engine:
        return Refused(("the candidate changes no engine policy: nothing to try on a pool",))
    return Candidate(new.rollout.pool, new.rollout, toml_of(engine), new)


def placement_decision(body: Any, at: float, canary: bool, tenant: str,
                       service_class: str) -> Decided | None:
    """A replica's admission decision for one placement (its Accepted, or a refusal for
    load or budget), as the watchdog counts it."""
    if isinstance(body, Accepted):
        return Decided(at, canary, tenant, service_class, True)
    if isinstance(body, Rejected) and body.reason in REFUSED:
        return Decided(at, canary, tenant, service_class, False)
    return None


def placement_end(body: Any, now: float, canary: bool, service_class: str, arrival: float,
                  first_token_at: float, ttft_deadline_s: float | None,
                  admitted: bool) -> Ended | None:
    """One placement's end (``body``: its terminal, or a refusal the router reroutes) as
    the watchdog counts it; None for what says nothing of the policy (failed, cancelled,
    an invalid request). ``first_token_at``: when its client's first token came (0:
    none); ``ttft_deadline_s``: from ``arrival`` (None: none)."""
    if isinstance(body, Rejected):
        if body.reason not in REFUSED:
            return None
        return Ended(now, canary, service_class, rejected=True,
                     wait_s=now - arrival if admitted else None)
    if not isinstance(body, Finished):
        return None
    # a request not streamed to its client: its first token came ``decode_s`` before its end
    first = first_token_at or (now - body.timing.decode_s if body.timing else now)
    late = ttft_deadline_s is not None and first - arrival > ttft_deadline_s + 1e-9
    missed = late or body.finish_reason == "deadline"
    u = body.usage
    computed = max(u.prompt_tokens - u.cached_tokens, 0) + u.completion_tokens
    return Ended(now, canary, service_class, missed, False, first - arrival, computed,
                 0 if missed else u.completion_tokens)


def waiting(open_: Mapping[tuple[bool, str], float], canary: bool, service_class: str,
            wait_s: float) -> dict[tuple[bool, str], float]:
    """``open_`` with a request still waiting for its first token: the longest wait by
    (canary, class), as ``Watchdog.verdict`` takes it."""
    out = dict(open_)
    key = (canary, service_class)
    out[key] = max(out.get(key, 0.0), wait_s)
    return out


# ---------------------------------------------------------------------- TOML out
def toml_of(tables: Mapping[str, Any]) -> str:
    """``tables`` (section -> its fields, as TOML decodes them) as TOML text: a
    ``[section]`` each, every value inline (arrays of tables as arrays of inline tables).
    Strings are written as JSON writes them, which TOML's basic strings read the same."""
    lines: list[str] = []
    for section, fields in tables.items():
        if not isinstance(fields, Mapping):
            lines.append(f"{_key(section)} = {_value(fields)}")
            continue
        lines.append(f"[{_key(section)}]")
        lines += [f"{_key(k)} = {_value(v)}" for k, v in fields.items() if v is not None]
    return "\n".join(lines) + "\n"


def _key(k: str) -> str:
    bare = k and all(c.isalnum() and c.isascii() or c in "-_" for c in k)
    return k if bare else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()
                                if x is not None) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise ValueError(f"no TOML for a {type(v).__name__}")


def pre_trial_version(history: Sequence[ConfigVersion], by_actor: str) -> int | None:
    """The replica's version to roll back to: the last one before the versions at its end
    that ``by_actor`` (``actor(N)``) applied (a replica restarted with its history may
    already run the candidate, applied once or more); None if the last is not one."""
    i = len(history)
    while i > 0 and history[i - 1].applied_by.endswith(f"({by_actor})"):
        i -= 1
    return None if i == len(history) or i == 0 else history[i - 1].version


@dataclass
class Placed:
    """The candidate in force on one replica of the pool."""

    instance: int | None          # the replica's instance that took it
    before: int                   # the replica's version to roll back to
    at: float                     # since when (monotonic seconds): placements from then on
    #                               are the canary's


@dataclass
class PoolTrial:
    """One canary by pool under watch."""

    version: int                  # the router's trial version
    cand: Candidate
    key: str | None               # the key the replicas took its commands with
    watchdog: Watchdog
    applied: dict[str, Placed] = field(default_factory=dict)

    @property
    def pool(self) -> str:
        return self.cand.pool

    @property
    def actor(self) -> str:
        return actor(self.version)

    def side(self, replica: str, pool: str, placed_at: float) -> bool | None:
        """Which side a placement at ``placed_at`` on ``replica`` (of ``pool``) counts on:
        True the canary, False the baseline, None neither (placed before the trial, or on a
        pool replica that had not taken the candidate)."""
        if placed_at < self.watchdog.started:
            return None
        if pool != self.pool:
            return False
        p = self.applied.get(replica)
        return True if p is not None and placed_at >= p.at else None
