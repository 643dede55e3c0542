"""Admission's pure core: what it holds (requests per tenant and overall), what it knows of
the scheduler's backlog, and the decision for one tokenized request.

The admission service and the replay simulator (``weir simulate``) both drive this class,
so a policy tried in the simulator is the one that runs. Synchronous and clock-free: the
caller passes ``now`` (seconds, monotonic).

Policies (``admission.policy``):

- ``fcfs``: first come, first served. A valid request is accepted while the engine and its
  tenant are under their caps on outstanding requests, else rejected at once with a
  retry-after estimate. The scheduler serves accepted work in arrival order.
"""
from __future__ import annotations

from collections import Counter

from components.admission.retry import DrainRate
from components.admission.validate import check_length, check_params
from schemas.config import WeirConfig
from schemas.wire import Rejected, SchedulerLoad, Tokenized

POLICIES = ("fcfs",)


class AdmissionPolicy:
    def __init__(self, config: WeirConfig) -> None:
        self.config = config
        self.tenants = {t.name: t for t in config.admission.tenants}
        self.outstanding: dict[str, str] = {}         # request_id -> tenant
        self.per_tenant: Counter[str] = Counter()
        self.releases = DrainRate()
        self.decisions: Counter[str] = Counter()
        self.load = SchedulerLoad(0, 0, 0, 0.0, 0.0)

    # ------------------------------------------------------------------ decision
    def decide(self, req: Tokenized, now: float) -> Rejected | None:
        """None to accept ``req``; else the rejection, with its reason code."""
        rejected = self._check(req, now)
        self.decisions[rejected.reason if rejected else "accepted"] += 1
        return rejected

    def _check(self, req: Tokenized, now: float) -> Rejected | None:
        rid, cfg = req.request_id, self.config
        tenant = self.tenants.get(req.tenant)
        if tenant is None:
            return Rejected(rid, "unknown_tenant", f"unknown tenant {req.tenant!r}")
        if (why := check_params(req.params)) is not None:
            return Rejected(rid, "invalid_request", why)
        if req.params.n > cfg.scheduler.max_num_seqs:
            return Rejected(rid, "invalid_request", f"n ({req.params.n}) exceeds the engine's "
                            f"max_num_seqs ({cfg.scheduler.max_num_seqs})")
        if (bad := check_length(len(req.prompt_token_ids), req.params.max_tokens,
                                cfg.engine.max_model_len)) is not None:
            return Rejected(rid, bad[0], bad[1])
        cap = cfg.admission.max_outstanding
        if len(self.outstanding) >= cap:
            return Rejected(rid, "overloaded", f"the engine holds {cap} requests, its cap",
                            self.retry_after(len(self.outstanding) - cap + 1, now))
        held = self.per_tenant[req.tenant]
        if held >= tenant.max_outstanding:
            return Rejected(rid, "tenant_over_budget",
                            f"tenant holds {tenant.max_outstanding} requests, its cap",
                            self.retry_after(held - tenant.max_outstanding + 1, now))
        return None

    def retry_after(self, backlog: int, now: float) -> float:
        """Seconds until ``backlog`` requests would drain at the recently observed rate."""
        return self.releases.retry_after(backlog, now)

    def predicted_ttft_s(self, prompt_tokens: int) -> float | None:
        """Backlog plus this prompt at the measured prefill rate, plus one step; None
        while the scheduler has not measured enough steps."""
        load = self.load
        if load.prefill_tokens_per_s <= 0:
            return None
        return (load.queued_prefill_tokens + prompt_tokens) / load.prefill_tokens_per_s \
            + load.decode_step_s

    # ------------------------------------------------------------------ bookkeeping
    def admitted(self, request_id: str, tenant: str) -> None:
        self.outstanding[request_id] = tenant
        self.per_tenant[tenant] += 1

    def released(self, request_ids: list[str], now: float) -> None:
        for rid in request_ids:
            tenant = self.outstanding.pop(rid, None)
            if tenant is not None:
                self.per_tenant[tenant] -= 1
                self.releases.ended(now)

    def holding(self, held: list[tuple[str, str]]) -> None:
        """After a restart of admission: resume the counts of what the scheduler holds."""
        for rid, tenant in held:
            if rid not in self.outstanding:
                self.admitted(rid, tenant)

    def forget_all(self) -> None:
        """The scheduler restarted and dropped everything it held."""
        self.outstanding.clear()
        self.per_tenant.clear()
