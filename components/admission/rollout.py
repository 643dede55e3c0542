"""A candidate admission policy beside the one in force: a config on trial
(``PolicyChange.trial``, ``[rollout] mode``; docs/operations.md).

- **shadow**: every request is decided by the policy in force, which is enforced, and by
  the candidate, which is not: the candidate decides first, over the same state (nothing
  it decides touches a ledger, a queue, a bucket's level or a counter of the policy in
  force), and what it would have done is counted here (``shadow.<kind>.<reason>``, and
  ``shadow.disagree.<live kind>.<shadow kind>``) and set on the decision's span.
- **canary**: the candidate decides, and is enforced, for the tenants whose name hashes
  under its share (``components/tenancy/canary.py``); the policy in force for the rest.
  Its admitted and queued requests go into the one ledger and the one queue, so the
  engine's capacity is counted once; a queued one is released by the rule that queued
  it. Token buckets and VTC weights of the canary's tenants are the candidate's.

The candidate is a *view* of the policy in force (``AdmissionPolicy.view``): its own
config, classes, tenants, capacity and deadline rule over the same ledger, queue, TTFT
model, live pool, buckets, virtual counters and counters. Two config-derived settings
live in shared state, the decode horizon's targets and headroom (``LiveEngine.retune``)
and the expected-output percentile; they are the candidate's for each of its decisions
and set back after (``tuned``). In shadow, a candidate's different token rates are not
modelled (its tenants' buckets are the ones in force).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from components.admission.decision import Decision
from components.admission.live import LiveEngine
from components.costs.estimate import OutputStats
from components.tenancy.canary import in_canary
from schemas.config import WeirConfig
from schemas.wire import Tokenized

_MAX_CACHED_TENANTS = 4096      # tenants whose side is remembered (the hash is cheap anyway)


class Judge(Protocol):
    """What a rollout needs of a policy: its config, the shared parts ``tuned`` sets,
    and a decision that changes nothing (``AdmissionPolicy.judge``)."""

    config: WeirConfig
    live: LiveEngine
    outputs: OutputStats

    def judge(self, req: Tokenized, cached: int, now: float) -> Decision: ...


class Rollout:
    """The trial of config ``version`` beside ``base`` (the policy in force); ``candidate``
    is the view deciding by the trial's config."""

    def __init__(self, base: Judge, candidate: Judge, version: int, sha256: str) -> None:
        rollout = candidate.config.rollout
        self.mode, self.share = rollout.mode, rollout.share
        self.base, self.candidate = base, candidate
        self.version, self.sha256 = version, sha256
        self.counts: Counter[str] = Counter()
        self._sides: dict[str, bool] = {}

    def takes(self, tenant: str) -> bool:
        """Whether the candidate decides (and is enforced) for ``tenant``'s requests."""
        if self.mode != "canary":
            return False
        side = self._sides.get(tenant)
        if side is None:
            side = in_canary(tenant, self.share)
            if len(self._sides) < _MAX_CACHED_TENANTS:
                self._sides[tenant] = side
        return side

    @contextmanager
    def tuned(self) -> Iterator[None]:
        """The shared config-derived settings are the candidate's inside."""
        live, outputs = self.base.live, self.base.outputs
        percentile = outputs.percentile
        live.retune(self.candidate.config)
        outputs.percentile = self.candidate.config.admission.output_percentile
        try:
            yield
        finally:
            live.retune(self.base.config)
            outputs.percentile = percentile

    def shadow(self, req: Tokenized, cached: int, now: float) -> Decision:
        """What the candidate would decide for ``req`` now (nothing is changed)."""
        with self.tuned():
            return self.candidate.judge(req, cached, now)

    def compare(self, shadow: Decision, live: Decision) -> None:
        """Count the shadow decision and whether it differs from the one enforced."""
        c = self.counts
        c["shadow.decisions"] += 1
        c[f"shadow.{shadow.kind}.{shadow.reason}"] += 1
        if shadow.kind != live.kind:
            c["shadow.disagreements"] += 1
            c[f"shadow.disagree.{live.kind}.{shadow.kind}"] += 1

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {"rollout.version": self.version,
                                 "rollout.shadow": float(self.mode == "shadow"),
                                 "rollout.canary_share": self.share if self.mode == "canary"
                                 else 0.0}
        if self.mode == "shadow":
            out.update({"shadow.decisions": 0, "shadow.disagreements": 0})
        out.update(self.counts)
        return out
