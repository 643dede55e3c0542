"""What admission decides and why, as values: the decision's kind, what holds a request
that cannot start now, the estimate a decision is made on, and the rules that turn a
request and its class into its deadlines. Pure; no state.

The enums' values are the strings the wire, the spans and the stats carry
(``schemas.wire.RejectReason``, ``weir.admission.decision``, ``decisions.<kind>.<class>``,
a queued request's reason ``waiting_for_<blocker>``): an enum member is its string.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from schemas.client import RejectReason
from schemas.config import ServiceClass
from schemas.resolve import ttft_deadline_ms as own_else_class_ms
from schemas.wire import Rejected, Tokenized, deadline_ns


class Kind(StrEnum):
    """What admission does with a request."""

    ACCEPT = "accept"      # it starts now
    DEGRADE = "degrade"    # it starts now with a lower max_tokens
    QUEUE = "queue"        # it waits in admission's queue
    REJECT = "reject"      # it ends now, with a reason


class Blocker(StrEnum):
    """What keeps a request that is otherwise admissible from starting now."""

    ENGINE_CAP = "engine_cap"          # the engine holds admission.max_outstanding requests
    TENANT_CAP = "tenant_cap"          # its tenant holds its max_outstanding
    TENANT_RUNNING = "tenant_running"  # its n would take its tenant past max_running
    TENANT_KV = "tenant_kv"            # its reservation would take its tenant past kv_blocks
    TPOT = "tpot"                      # the decode horizon: a running TPOT target at risk
    KV = "kv"                          # the ledger's pool has no room for its reservation
    KV_PRESSURE = "kv_pressure"        # the live pool has no room for it
    QUEUE = "queue"                    # it fits, but must not jump those already waiting

    @property
    def tenants_own(self) -> bool:
        """Held by its own tenant's caps, not the engine's capacity: the queue passes it
        (and its tenant's later requests) over instead of stopping there."""
        return self in _TENANT_BLOCKERS

    @property
    def kv_bound(self) -> bool:
        """A lower max_tokens (a smaller reservation) can make it fit."""
        return self in _KV_BLOCKERS

    @property
    def rejected_as(self) -> RejectReason:
        """The reason a request it holds is rejected with when its class does not queue."""
        if self in _TENANT_BLOCKERS:
            return "tenant_over_budget"
        return _REJECTED_FOR.get(self, "overloaded")


_TENANT_BLOCKERS = frozenset({Blocker.TENANT_CAP, Blocker.TENANT_RUNNING, Blocker.TENANT_KV})
_KV_BLOCKERS = frozenset({Blocker.KV, Blocker.TENANT_KV, Blocker.KV_PRESSURE})
_REJECTED_FOR: dict[Blocker, RejectReason] = {Blocker.KV_PRESSURE: "kv_pressure",
                                              Blocker.TPOT: "tpot_slo_at_risk"}


@dataclass(frozen=True)
class Estimate:
    """What a request will cost, as admission sees it before prefill."""

    uncached_tokens: int
    expected_output: int
    kv_blocks: int
    predicted_ttft_s: float | None       # None until the scheduler has measured its rates
    deadline_ms: float | None            # the request's own, else its class's (ttft_deadline_ms)
    scheduler_ttft_s: float | None = None   # the backlog part alone, before the learned bias
    decode_context: int = 0              # KV positions each of its sequences reads decoding
    decode_step_s: float | None = None   # the decode step predicted with it (the horizon)
    e2e_deadline_ms: float | None = None # the end-to-end bound in force (see e2e_deadline_ms)


@dataclass(frozen=True)
class Decision:
    kind: Kind
    reason: str                          # a reason code (see policy.py's docstring)
    service_class: str
    priority: int
    max_tokens: int | None               # the cap the request runs with
    estimate: Estimate
    rejected: Rejected | None = None


@dataclass(frozen=True)
class Grant:
    """What a valid request is granted before the decision: its class, its priority, the
    max_tokens it runs with (its class may cap it) and its estimate."""

    service_class: str
    priority: int
    max_tokens: int | None
    estimate: Estimate

    def decision(self, kind: Kind, reason: str) -> Decision:
        return Decision(kind, reason, self.service_class, self.priority, self.max_tokens,
                        self.estimate)


def reject(req: Tokenized, reason: RejectReason, message: str, after_s: float | None = None,
           grant: Grant | None = None) -> Decision:
    """A rejection of ``req`` with ``reason``, as ``grant`` (None: before a class was
    granted); ``after_s``: the retry-after it suggests, kept within 0.1 s .. 60 s, in
    tenths (None: none)."""
    if after_s is not None:
        after_s = round(min(max(after_s, 0.1), 60.0), 1)
    if grant is None:
        grant = Grant("", 0, None, Estimate(len(req.prompt_token_ids), 0, 0, None,
                                            req.header.ttft_deadline_ms))
    return Decision(Kind.REJECT, reason, grant.service_class, grant.priority,
                    grant.max_tokens, grant.estimate,
                    Rejected(req.request_id, reason, message, after_s))


def ttft_deadline_ms(own_ms: float | None, cls: ServiceClass,
                     alone_s: float | None) -> float | None:
    """A request's TTFT deadline (``schemas.resolve.ttft_deadline_ms``): its own
    ``deadline_ms`` as the client set it; else its class's ``ttft_slo_ms``, stretched for a
    prompt whose own prefill on this machine (``alone_s``: ``TtftModel.alone_s``, nothing
    ahead of it; None: not measured yet) takes more than half of it, to that prefill plus
    half the target. A class's target is what interactive work may wait; a prompt is never
    refused for its size alone (8k tokens on two CPU cores take longer than a 3 s target
    with nothing else running), and it still may not wait longer than a short one could."""
    deadline = own_else_class_ms(own_ms, cls)
    if own_ms is not None or deadline is None or alone_s is None:
        return deadline
    return max(deadline, deadline / 2 + alone_s * 1e3)


def e2e_deadline_ms(req: Tokenized, cls: ServiceClass) -> float | None:
    """The end-to-end bound a request runs under: the tighter of its own
    ``e2e_deadline_ms`` and its class's ``e2e_slo_ms`` (a client may tighten its class's
    bound, never loosen it); None when neither sets one. Either policy: the scheduler ends
    the request there (late.py)."""
    bounds = [b for b in (req.header.e2e_deadline_ms, cls.e2e_slo_ms) if b is not None]
    return min(bounds) if bounds else None


def effective_deadline_ms(d: Decision) -> int | None:
    """The TTFT deadline the scheduler gets with an admitted request: the request's own,
    else its class's ``ttft_slo_ms`` (urgency preemption reads it)."""
    ms = d.estimate.deadline_ms
    return None if ms is None else round(ms)


def due_ns(req: Tokenized, deadline_ms: float | None) -> int:
    """When the request's first token is due, on the wall clock of its arrival, as
    admission will grant it (``RequestHeader.ttft_deadline_ns``, by which the scheduler
    orders a tenant's waiting work); 0 with no deadline."""
    return deadline_ns(req.header.arrival_ns, deadline_ms) or 0


def first_token_bound_ms(est: Estimate) -> float | None:
    """By when the first token must come for the request to be of use: its TTFT deadline,
    or its end-to-end bound if that is sooner (past it the request ends with nothing)."""
    bounds = [b for b in (est.deadline_ms, est.e2e_deadline_ms) if b is not None]
    return min(bounds) if bounds else None


def headroom_pct(kept: float) -> str:
    return f"{(1 - kept) * 100:.0f}%"
