"""Admission's pure core: the decision for each tokenized request, the queue of requests it
holds, and the ledger of what admitted requests reserve. Its parts, each in its module:
the decision's values and deadline rules (``decision.py``), the ledger (``ledger.py``),
what fits now and degrade (``capacity.py``), the deadline policy's decision
(``deadline.py``), the queue's order (``queue.py``), the TTFT a request is predicted
(``ttft.py``), the live pool and decode horizon (``live.py``), the counters (``stats.py``).

The admission service and the replay simulator (``weir simulate``) both drive this class,
so a policy tried in the simulator is the one that runs. Synchronous and clock-free: the
caller passes ``now`` (seconds, monotonic).

Every request first gets its class (the tenant's default, or a lower one it asked for; a
higher one is refused) and its priority (the class's; a client value may only lower it).

Policies (``admission.policy``):

- ``fcfs`` (the baseline, Weir's behaviour before classes): accept while the engine and
  the tenant are under their caps on outstanding requests, else reject at once with a
  retry-after. Nothing is queued; the scheduler serves in arrival order.
- ``deadline``: decide before any prefill or KV is spent, from a cost estimate (uncached
  prompt tokens, expected output, KV blocks for both) and a predicted TTFT:

  ===========  ===================================================================
  accept       it fits now (KV reservation, tenant budgets, running caps) and its
               predicted TTFT meets its deadline
  degrade      it fits only with a lower ``max_tokens`` (>= the class's
               ``min_max_tokens``) and its class allows that
  queue        it does not fit now, its class may wait (``max_queue_ms``), and the
               queues have room; released in the scheduler's order (across tenants
               class first, aged, then the least served; within a tenant class,
               deadline, arrival: ``queue.py``) as capacity frees; one held by its
               own tenant's caps does not hold back other tenants' requests
  reject       with one reason: ``deadline_unmeetable``, ``tenant_token_budget``,
               ``tenant_kv_budget``, ``queue_full``, ``overloaded``, ``kv_pressure``
               (the live pool has no room for it), ``tpot_slo_at_risk`` (the decode
               horizon), ``tenant_over_budget``, ``class_not_allowed``, or a validity
               reason
  ===========  ===================================================================

  A queued request past its deadline or ``max_queue_ms`` ends ``deadline_expired``.

End-to-end bound (either policy): a request runs under the tighter of its own
``e2e_deadline_ms`` and its class's ``e2e_slo_ms`` (``Admitted.header.e2e_deadline_ns``; the
scheduler ends it there, ``late.py``). Under ``deadline`` it also bounds the first token:
a predicted TTFT past it is ``deadline_unmeetable``, and a queued request expires at it.

KV reservation: an admitted request holds ``ceil((uncached prompt + n × expected output ×
(1 + kv_safety)) / block_size)`` blocks of the pool (less the watermark) until it is
released; a request starts only when its reservation fits, both the ledger's room and the
live pool's (the kv_manager's free blocks less what the ledger still owes: ``live.py``), so
growth past it is the exception preemption handles.

Decode horizon (``live.py``): a request starts only when the decode step predicted with its
``n`` sequences keeps the tightest running TPOT target (less ``tpot_headroom``), and while
no running class's measured TPOT is over its target.
"""
from __future__ import annotations

import copy
from collections import Counter
from typing import cast

import msgspec

from components.admission.capacity import Capacity, TenantBuckets
from components.admission.deadline import DeadlineRule
from components.admission.decision import (
    Decision,
    Estimate,
    Grant,
    Kind,
    due_ns,
    e2e_deadline_ms,
    effective_deadline_ms,
    first_token_bound_ms,
    reject,
    ttft_deadline_ms,
)
from components.admission.ledger import Ledger
from components.admission.live import LiveEngine
from components.admission.queue import AdmissionQueue
from components.admission.rollout import Rollout
from components.admission.stats import decision_stats, live_stats, ttft_stats
from components.admission.ttft import TtftModel
from components.costs.estimate import OutputStats
from components.tenancy.bucket import TokenBucket
from components.tenancy.fairness import VirtualCounters
from components.tenancy.retry import DrainRate
from components.tenancy.window import UsageWindow
from schemas.config import ServiceClass, TenantConfig, WeirConfig
from schemas.resolve import resolve
from schemas.validate import check_length
from schemas.wire import Admitted, HeldRequest, Rejected, SchedulerLoad, Tokenized, deadline_ns


class AdmissionPolicy:
    """The decision for each request, and what follows from it: the ledger entry of an
    admitted one, the queue entry of a waiting one; the counters of both. Its parts are
    public and each owns its state: ``ledger`` (what admitted requests hold), ``queue``,
    ``capacity`` (what fits now), ``rule`` (the deadline policy's decision), ``ttft``,
    ``live``, ``buckets``, ``vtc``."""

    def __init__(self, config: WeirConfig) -> None:
        self.config = config
        adm = config.admission
        self.kind = adm.policy
        self.tenants: dict[str, TenantConfig] = adm.tenants_by_name     # the config's index
        self.classes: dict[str, ServiceClass] = adm.service_classes()
        self.ledger = Ledger()
        self.releases = DrainRate()
        self.decisions: Counter[tuple[str, str]] = Counter()     # (kind, class) -> count
        self.rejections: Counter[tuple[str, str]] = Counter()    # (reason, class) -> count
        self.outputs = OutputStats(adm.output_percentile)
        self.buckets = TenantBuckets()
        self.usage = UsageWindow()      # tokens used per tenant, recently: a router's buckets
        self.vtc = VirtualCounters({t.name: t.weight for t in adm.tenants})   # queue order
        self.queue = AdmissionQueue(self.vtc)
        self.ttft = TtftModel(config, self.vtc)
        self.live = LiveEngine(config)                 # the pool and the decode horizon
        self.capacity = Capacity(config, self.ledger, self.live)
        self.rule = DeadlineRule(config, self.capacity, self.queue, self.buckets,
                                 self.releases, self.tenants, self.classes)
        self.trial: Rollout | None = None          # a candidate beside it (rollout.py)

    def view(self, config: WeirConfig) -> AdmissionPolicy:
        """A policy deciding by ``config``'s admission section over this one's state: the
        same ledger, queue, TTFT model, live pool, buckets, virtual counters and counters
        (what it admits or queues is held and counted here); its own classes, tenants,
        capacity rule and deadline rule (``rollout.py``)."""
        other = copy.copy(self)
        adm = config.admission
        other.config, other.kind, other.trial = config, adm.policy, None
        other.tenants, other.classes = adm.tenants_by_name, adm.service_classes()
        other.capacity = Capacity(config, self.ledger, self.live)
        other.rule = DeadlineRule(config, other.capacity, self.queue, self.buckets,
                                  self.releases, other.tenants, other.classes)
        return other

    def try_candidate(self, candidate: WeirConfig | None, version: int = 0,
                      sha256: str = "") -> None:
        """Run ``candidate`` (a config on trial: ``rollout.mode`` shadow or canary) beside
        this policy from the next decision, or none (None). A canary's tenants get the
        candidate's token rates and VTC weights; the others keep this policy's."""
        self.trial = None if candidate is None else Rollout(self, self.view(candidate),
                                                            version, sha256)
        tenants = dict(self.tenants)
        if self.trial is not None:
            tenants.update({name: t for name, t in self.trial.candidate.tenants.items()
                            if self.trial.takes(name)})
        self.buckets.retune(tenants)
        self.vtc.weights = {t.name: t.weight for t in tenants.values()}

    def _side(self, tenant: str) -> tuple[AdmissionPolicy, Rollout | None]:
        """The policy that decides for ``tenant``, and the canary if it is the candidate."""
        trial = self.trial
        if trial is not None and trial.takes(tenant):
            return cast(AdmissionPolicy, trial.candidate), trial
        return self, None

    def reconfigure(self, config: WeirConfig) -> None:
        """Decide by ``config``'s admission section from now on (a live config change,
        ``schemas/config_change.py``; only its policy sections differ). Nothing decided
        is decided again: the ledger, the queue (each entry keeps the class and deadline
        it was decided with), the TTFT model's learned state, the live pool and the
        counters stay; the token buckets and virtual counters carry over by tenant name,
        with the tenants' new rates and weights (a bucket over its new burst is cut to
        it)."""
        adm = config.admission
        self.config = config
        self.kind = adm.policy
        self.tenants = adm.tenants_by_name
        self.classes = adm.service_classes()
        self.outputs.percentile = adm.output_percentile
        self.buckets.retune(self.tenants)
        self.vtc.weights = {t.name: t.weight for t in adm.tenants}
        self.ttft.fairness = config.scheduler.fairness
        self.live.retune(config)
        self.capacity.config = config
        self.capacity.checks_horizon = adm.policy == "deadline"
        self.rule.config, self.rule.tenants, self.rule.classes = (
            config, self.tenants, self.classes)

    def drops_late(self, d: Decision) -> bool:
        """Whether the engine ends this admitted request ``deadline_expired`` if its TTFT
        deadline passes before its first token: under the deadline policy, when it has a
        deadline and its class's ``late`` is ``drop``."""
        return self.kind == "deadline" and d.estimate.deadline_ms is not None \
            and self.classes[d.service_class].late == "drop"

    def admitted(self, req: Tokenized, d: Decision, queued_s: float = 0.0) -> Admitted:
        """What the scheduler gets for ``req``, admitted as ``d`` after ``queued_s`` in the
        queue: its cap, the deadline decided on, its class's TPOT target, aging and late
        rule, and its ledger entry. The admission service and the replay simulator both
        send this, so the simulated scheduler drops and ages what the live one does."""
        side, _ = self._side(req.tenant)
        if side is not self:
            return side.admitted(req, d, queued_s)
        params = req.params
        if d.max_tokens != params.max_tokens:
            params = msgspec.structs.replace(params, max_tokens=d.max_tokens)
        cls = self.classes[d.service_class]
        e2e = d.estimate.e2e_deadline_ms
        arrival = req.header.arrival_ns
        header = msgspec.structs.replace(
            req.header, params=params, priority=d.priority, granted_class=d.service_class,
            ttft_deadline_ns=deadline_ns(arrival, effective_deadline_ms(d)),
            e2e_deadline_ns=deadline_ns(arrival, None if e2e is None else max(round(e2e), 1)),
            tpot_slo_ms=cls.tpot_slo_ms, speculate=d.kind != Kind.DEGRADE)
        return Admitted(header, req.prompt_token_ids, req.block_hashes, req.eos_token_ids,
                        req.public_scope, req.public_blocks, int(queued_s * 1e9),
                        held=self.ledger.entry(req.request_id), drop_late=self.drops_late(d),
                        aging_per_s=cls.aging_per_s)

    def on_load(self, load: SchedulerLoad, now: float | None = None) -> str:
        """The scheduler's load report (every 100 ms): the TTFT model's backlog and rates,
        and the live pool and decode batch. Returns the ledger cross-check's verdict (""
        when it agrees or cannot tell: ``LiveEngine.check``)."""
        self.ttft.on_load(load, now)
        return self.live.check(load, len(self.ledger))

    def token_bucket(self, tenant: str) -> TokenBucket | None:
        """``tenant``'s token bucket, if it has one yet (its first request makes it)."""
        return self.buckets.get(tenant)

    # ------------------------------------------------------------------ decision
    def decide(self, req: Tokenized, cached: int, now: float) -> Decision:
        """Decide for ``req`` (``cached``: prompt tokens the pool already holds). An
        accepted or degraded request is in the ledger when this returns; a queued one is
        held until ``release`` or ``expire`` hands it back. A canary's tenant is decided
        by the candidate (``rollout.py``)."""
        side, canary = self._side(req.tenant)
        if canary is not None:
            with canary.tuned():
                return side.decide(req, cached, now)
        decision = self._decide(req, cached, now)
        self.decisions[decision.kind, decision.service_class] += 1
        if decision.kind == Kind.REJECT:
            self.rejections[decision.reason, decision.service_class] += 1
        if decision.kind in (Kind.ACCEPT, Kind.DEGRADE):
            self._admit(req, decision, now)
        elif decision.kind == Kind.QUEUE:
            self._enqueue(req, decision, now)
        return decision

    def beyond_deadline(self, req: Tokenized, cached: int) -> bool:
        """Whether ``req`` misses its TTFT deadline even with ``cached`` prompt tokens
        already cached (the most a prefix lookup could find). Prediction only grows with
        the uncached prompt, so such a request is rejected as ``deadline_unmeetable`` by
        whatever the lookup finds: the service decides it without asking the kv_manager,
        which makes a rejection under overload one hop cheaper."""
        side, canary = self._side(req.tenant)
        if canary is not None:
            with canary.tuned():
                return side.beyond_deadline(req, cached)
        if self.kind != "deadline":
            return False
        cls = resolve(self.config.admission, req.tenant, req.header.asked_class, None).granted
        if cls is None:
            return False
        prompt = len(req.prompt_token_ids)
        uncached, done = max(prompt - cached, 0), min(cached, prompt)
        deadline = self.deadline_ms(req, cls, uncached, done)
        raw = self.ttft.predicted_s(uncached, req.tenant, done,
                                    max(cls.priority, req.header.priority), due_ns(req, deadline),
                                    req.params.deterministic)
        return deadline is not None and raw is not None and \
            (raw + self.ttft.bias_s) * 1e3 > deadline * (1.0 - self.config.admission.ttft_headroom)

    def judge(self, req: Tokenized, cached: int, now: float) -> Decision:
        """The decision for ``req``, changing nothing (no ledger, queue or counter; a
        token bucket is refilled to ``now``): a shadow's (``rollout.py``)."""
        return self._decide(req, cached, now)

    def _decide(self, req: Tokenized, cached: int, now: float) -> Decision:
        cfg = self.config
        resolved = resolve(cfg.admission, req.tenant, req.header.asked_class,
                           req.header.ttft_deadline_ms)
        tenant, cls = resolved.tenant, resolved.granted
        if tenant is None or cls is None:
            return reject(req, resolved.refusal, resolved.message)
        priority = max(cls.priority, req.header.priority)     # a client may only lower its own
        max_tokens = req.params.max_tokens
        if cls.max_tokens is not None and (max_tokens is None or max_tokens > cls.max_tokens):
            max_tokens = cls.max_tokens
        est = self.estimate(req, cached, cls, max_tokens)
        grant = Grant(cls.name, priority, max_tokens, est)
        if req.params.n > cfg.scheduler.max_num_seqs:
            return reject(req, "invalid_request", f"n ({req.params.n}) exceeds the "
                          f"engine's max_num_seqs ({cfg.scheduler.max_num_seqs})", grant=grant)
        if (bad := check_length(len(req.prompt_token_ids), max_tokens,
                                cfg.engine.max_model_len)) is not None:
            return reject(req, bad[0], bad[1], grant=grant)
        if self.kind == "fcfs":
            return self._fcfs(req, tenant, now, grant)
        return self.rule.decide(req, tenant, cls, now, grant)

    def _fcfs(self, req: Tokenized, tenant: TenantConfig, now: float, grant: Grant) -> Decision:
        cap, outstanding = self.config.admission.max_outstanding, len(self.ledger)
        if outstanding >= cap:
            return reject(req, "overloaded", f"the engine holds {cap} requests, its cap",
                          self.releases.retry_after(outstanding - cap + 1, now), grant)
        held = self.ledger.tenant_requests(req.tenant)
        if held >= tenant.max_outstanding:
            return reject(req, "tenant_over_budget",
                          f"tenant holds {tenant.max_outstanding} requests, its cap",
                          self.releases.retry_after(held - tenant.max_outstanding + 1, now),
                          grant)
        return grant.decision(Kind.ACCEPT, "within_caps")

    # ------------------------------------------------------------------ estimates
    def estimate(self, req: Tokenized, cached: int, cls: ServiceClass,
                 max_tokens: int | None) -> Estimate:
        prompt = len(req.prompt_token_ids)
        uncached = max(prompt - cached, 0)
        room = max(self.config.engine.max_model_len - prompt, 1)
        cap = min(max_tokens, room) if max_tokens is not None else room
        expected = self.outputs.expected(req.tenant, cls.name, cap, cap)
        deadline = self.deadline_ms(req, cls, uncached, prompt - uncached)
        raw = self.ttft.predicted_s(uncached, req.tenant, prompt - uncached,
                                    max(cls.priority, req.header.priority), due_ns(req, deadline),
                                    req.params.deterministic)
        context = prompt + expected // 2           # each choice's mean over its decode
        horizon = self.capacity.horizon(cls.name, req.params.n, context)
        return Estimate(uncached, expected,
                        self.capacity.blocks(uncached, expected, req.params.n),
                        None if raw is None else raw + self.ttft.bias_s, deadline, raw,
                        context, horizon.step_s if horizon is not None else None,
                        e2e_deadline_ms(req, cls))

    def deadline_ms(self, req: Tokenized, cls: ServiceClass, uncached: int,
                    cached: int) -> float | None:
        """The request's TTFT deadline (``decision.ttft_deadline_ms``: its own, else its
        class's target stretched for a prompt whose own prefill takes most of it)."""
        return ttft_deadline_ms(req.header.ttft_deadline_ms, cls,
                                self.ttft.alone_s(uncached, cached,
                                                  req.params.deterministic))

    # ------------------------------------------------------------------ ledger
    def _admit(self, req: Tokenized, decision: Decision, now: float) -> None:
        rid, tenant, est = req.request_id, req.tenant, decision.estimate
        seqs = req.params.n
        blocks = est.kv_blocks if self.kind == "deadline" else 0
        self.ledger.hold(HeldRequest(rid, tenant, decision.service_class, seqs, blocks,
                                     est.scheduler_ttft_s))
        self.ttft.admitted(rid, tenant, est.uncached_tokens, est.scheduler_ttft_s,
                           len(req.prompt_token_ids) - est.uncached_tokens, decision.priority,
                           due_ns(req, est.deadline_ms))
        self.vtc.charge(tenant, est.uncached_tokens, seqs * est.expected_output)
        self.usage.add(tenant, len(req.prompt_token_ids), now)
        self.live.admitted_since += 1
        if self.kind == "deadline" and (bucket := self.buckets.of(self.tenants[tenant], now)):
            bucket.take(est.uncached_tokens + seqs * est.expected_output, now)

    def released(self, request_ids: list[str], now: float,
                 output_tokens: dict[str, int] | None = None,
                 ttft_s: dict[str, float] | None = None) -> None:
        """Requests the scheduler let go. ``output_tokens`` teach the expected output;
        ``ttft_s`` (arrival → first token, as the engine saw it) teach the TTFT model's
        bias (:meth:`TtftModel.ended`)."""
        for rid in request_ids:
            held = self.ledger.release(rid)
            if held is None:
                continue
            self.releases.ended(now)
            if output_tokens and rid in output_tokens:
                self.usage.add(held.tenant, output_tokens[rid], now)
            if output_tokens and rid in output_tokens and held.service_class:
                self.outputs.observe(held.tenant, held.service_class,
                                     output_tokens[rid] // max(held.n, 1))
            self.ttft.ended(rid, now, ttft_s.get(rid) if ttft_s else None,
                            held.predicted_ttft_s)

    def holding(self, held: list[HeldRequest]) -> None:
        """After a restart of admission: the scheduler's requests, each with the entry this
        ledger made when it admitted it (``Admitted.held``), counted again as it was, so
        budgets, running caps and each ``Released`` come out as if nothing restarted
        (``Ledger.holding``). Their prefill is not added to the TTFT model's unreported
        tokens: the scheduler's load reports count it; nor charged to VTC or the token
        buckets, which were charged once already."""
        self.ledger.holding(held)

    def forget_all(self) -> None:
        """The scheduler restarted and dropped everything it held."""
        self.ledger.forget_all()
        self.ttft.forget_all()

    # ------------------------------------------------------------------ queue
    def _enqueue(self, req: Tokenized, decision: Decision, now: float) -> None:
        cls = self.classes[decision.service_class]
        est = decision.estimate
        self.queue.add(req, decision, cls.aging_per_s, now, self._deadline_at(decision, now),
                       (est.uncached_tokens, req.params.n * est.expected_output))

    def _deadline_at(self, decision: Decision, queued_at: float) -> float:
        """When a queued request expires: its TTFT deadline or end-to-end bound (from
        arrival) or its class's max_queue_ms (from queueing), whichever comes first."""
        cls = self.classes[decision.service_class]
        limits = [queued_at + cls.max_queue_ms / 1e3]
        bound = first_token_bound_ms(decision.estimate)
        if bound is not None:                             # queued moments after arrival
            limits.append(queued_at + bound / 1e3)
        return min(limits)

    def queue_position(self, request_id: str) -> int:
        return self.queue.position(request_id)

    @property
    def queue_depth(self) -> Counter[str]:
        return self.queue.depth()

    @property
    def queued(self) -> int:
        return len(self.queue)

    def cancel(self, request_id: str) -> bool:
        """Remove a queued request (cancelled by its client); True if it was queued."""
        return self.queue.remove(request_id) is not None

    def expire(self, now: float) -> list[Rejected]:
        """Queued requests past their deadline or max_queue_ms: ``deadline_expired``."""
        gone = self.queue.expired(now)
        for item in gone:
            self.rejections["deadline_expired", item.decision.service_class] += 1
        return [Rejected(q.request_id, "deadline_expired",
                         f"held {now - q.queued_at:.2f} s in admission's queue; its deadline "
                         f"passed before capacity freed") for q in gone]

    def release(self, now: float) -> list[tuple[Tokenized, Decision, float]]:
        """Queued requests that may start now, in queue order: each with its decision and
        the seconds it waited. A request held by its own tenant's caps (``tenant_cap``,
        ``tenant_running``, ``tenant_kv``) is passed over, and so are its tenant's later
        ones (a tenant's requests start in its own order); the first one held by the
        engine's (``kv``, ``engine_cap``) stops the release: no request jumps a bigger one
        ahead of it that waits for the same capacity."""
        out: list[tuple[Tokenized, Decision, float]] = []
        capped: set[str] = set()
        for item in self.queue.in_order(now):
            if item.tenant in capped:
                continue
            side, canary = self._side(item.tenant)
            if canary is not None:
                with canary.tuned():
                    decision, blocker = side.rule.fits_now(item, now)
            else:
                decision, blocker = self.rule.fits_now(item, now)
            if decision is None:
                if blocker is not None and blocker.tenants_own:
                    capped.add(item.tenant)
                    continue
                break
            self.queue.remove(item.request_id)
            side._admit(item.req, decision, now)
            out.append((item.req, decision, now - item.queued_at))
        return out

    # ------------------------------------------------------------------ stats
    def stats(self, now: float | None = None) -> dict[str, float]:
        """Counters for ``weir status`` and the gateway's metrics (``stats.py``); at
        ``now``, each tenant's recent token use too."""
        out: dict[str, float] = {"outstanding": len(self.ledger), "queued": self.queued,
                                 "reserved_kv_blocks": self.ledger.reserved_blocks}
        out.update(ttft_stats(self.ttft))
        out.update(decision_stats(self.decisions, self.rejections, self.queue_depth))
        out.update(self.ledger.stats())
        # with ``ledger.outstanding.<tenant>``, what a router rebuilds its fleet-wide
        # outstanding caps from after it restarts (components/router/budgets.py)
        out.update({f"queued.{t}": v for t, v in self.queue.tenant_depth().items()})
        # and ``used_tokens.<window>s.<tenant>``, its token buckets (tenancy/window.py)
        if now is not None:
            out.update(self.usage.stats(now))
        out.update(self.live_stats())
        if self.trial is not None:
            out.update(self.trial.stats())
        return out

    def live_stats(self) -> dict[str, float]:
        """The live pool and decode horizon as admission sees them (``stats.live_stats``)."""
        return live_stats(self.live, self.ledger, self.kind == "deadline")
