"""Admission's pure core: the decision for each tokenized request, the queue of requests it
holds, and the ledger of what admitted requests reserve. The TTFT it predicts for a request
is :class:`components.admission.ttft.TtftModel`'s.

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
``e2e_deadline_ms`` and its class's ``e2e_slo_ms`` (``Admitted.e2e_deadline_ms``; the
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

import math
from collections import Counter
from dataclasses import dataclass, replace

import msgspec

from components.admission.estimate import OutputStats, TokenBucket
from components.admission.live import Horizon, LiveEngine
from components.admission.queue import AdmissionQueue, Queued
from components.admission.retry import DrainRate
from components.admission.ttft import TtftModel
from components.admission.validate import check_length, check_params
from components.scheduler.fairness import VirtualCounters
from schemas.config import ServiceClass, TenantConfig, WeirConfig
from schemas.wire import Admitted, HeldRequest, Rejected, SchedulerLoad, Tokenized


ACCEPT, DEGRADE, QUEUE, REJECT = "accept", "degrade", "queue", "reject"
# what holds a request for its own tenant's caps, not the engine's capacity
_TENANT_BLOCKERS = frozenset({"tenant_cap", "tenant_running", "tenant_kv"})
# what a lower max_tokens can make fit
_KV_BLOCKERS = frozenset({"kv", "tenant_kv", "kv_pressure"})
# the reason a request held by the engine is rejected with, when its class does not queue
_REJECTED_FOR = {"kv_pressure": "kv_pressure", "tpot": "tpot_slo_at_risk"}


def headroom_pct(kept: float) -> str:
    return f"{(1 - kept) * 100:.0f}%"


@dataclass(frozen=True)
class Estimate:
    """What a request will cost, as admission sees it before prefill."""

    uncached_tokens: int
    expected_output: int
    kv_blocks: int
    predicted_ttft_s: float | None       # None until the scheduler has measured its rates
    deadline_ms: float | None            # the request's own, else its class's (see deadline_ms)
    scheduler_ttft_s: float | None = None   # the backlog part alone, before the learned bias
    decode_context: int = 0              # KV positions each of its sequences reads decoding
    decode_step_s: float | None = None   # the decode step predicted with it (the horizon)
    e2e_deadline_ms: float | None = None # the end-to-end bound in force (see e2e_deadline_ms)


@dataclass(frozen=True)
class Decision:
    kind: str                            # ACCEPT | DEGRADE | QUEUE | REJECT
    reason: str                          # a reason code (see the module docstring)
    service_class: str
    priority: int
    max_tokens: int | None               # the cap the request runs with
    estimate: Estimate
    rejected: Rejected | None = None


def effective_deadline_ms(d: Decision) -> int | None:
    """The TTFT deadline the scheduler gets with an admitted request: the request's own,
    else its class's ``ttft_slo_ms`` (urgency preemption reads it)."""
    ms = d.estimate.deadline_ms
    return None if ms is None else round(ms)


def due_ns(req: Tokenized, deadline_ms: float | None) -> int:
    """When the request's first token is due, on the wall clock of its arrival (as the
    scheduler orders a tenant's waiting work: ``SchedulerCore.add``); 0 with no deadline."""
    return 0 if deadline_ms is None else req.arrival_ns + int(round(deadline_ms) * 1e6)


def e2e_deadline_ms(req: Tokenized, cls: ServiceClass) -> float | None:
    """The end-to-end bound a request runs under: the tighter of its own
    ``e2e_deadline_ms`` and its class's ``e2e_slo_ms`` (a client may tighten its class's
    bound, never loosen it); None when neither sets one. Either policy: the scheduler ends
    the request there (late.py)."""
    bounds = [b for b in (req.e2e_deadline_ms, cls.e2e_slo_ms) if b is not None]
    return min(bounds) if bounds else None


def first_token_bound_ms(est: Estimate) -> float | None:
    """By when the first token must come for the request to be of use: its TTFT deadline,
    or its end-to-end bound if that is sooner (past it the request ends with nothing)."""
    bounds = [b for b in (est.deadline_ms, est.e2e_deadline_ms) if b is not None]
    return min(bounds) if bounds else None


class AdmissionPolicy:
    def __init__(self, config: WeirConfig) -> None:
        self.config = config
        adm = config.admission
        self.kind = adm.policy
        self.tenants: dict[str, TenantConfig] = {t.name: t for t in adm.tenants}
        self.classes: dict[str, ServiceClass] = adm.service_classes()
        self.outstanding: dict[str, str] = {}          # request_id -> tenant (admitted)
        self.per_tenant: Counter[str] = Counter()
        self.held: dict[str, HeldRequest] = {}         # the ledger's entries (see _hold)
        self.reserved_blocks = 0
        self.tenant_blocks: Counter[str] = Counter()
        self.tenant_seqs: Counter[str] = Counter()
        self.class_seqs: Counter[str] = Counter()      # admitted sequences by class
        self.releases = DrainRate()
        self.decisions: Counter[tuple[str, str]] = Counter()     # (kind, class) -> count
        self.rejections: Counter[tuple[str, str]] = Counter()    # (reason, class) -> count
        self.outputs = OutputStats(adm.output_percentile)
        self._buckets: dict[str, TokenBucket] = {}
        self.vtc = VirtualCounters({t.name: t.weight for t in adm.tenants})   # queue order
        self.queue = AdmissionQueue(self.vtc)
        self.ttft = TtftModel(config, self.vtc)
        self.live = LiveEngine(config)                 # the pool and the decode horizon
        kv = config.kv
        self.block_size = kv.block_size
        self.kv_capacity = kv.num_blocks - kv.watermark_blocks

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
        params = req.params
        if d.max_tokens != params.max_tokens:
            params = msgspec.structs.replace(params, max_tokens=d.max_tokens)
        cls = self.classes[d.service_class]
        e2e = d.estimate.e2e_deadline_ms
        return Admitted(req.request_id, req.tenant, req.prompt_token_ids, req.block_hashes,
                        params, req.arrival_ns, req.eos_token_ids, effective_deadline_ms(d),
                        d.priority, req.public_scope, req.public_blocks, d.service_class,
                        cls.tpot_slo_ms, int(queued_s * 1e9),
                        e2e_deadline_ms=None if e2e is None else max(round(e2e), 1),
                        held=self.held.get(req.request_id), drop_late=self.drops_late(d),
                        aging_per_s=cls.aging_per_s)

    def on_load(self, load: SchedulerLoad, now: float | None = None) -> str:
        """The scheduler's load report (every 100 ms): the TTFT model's backlog and rates,
        and the live pool and decode batch. Returns the ledger cross-check's verdict (""
        when it agrees or cannot tell: ``LiveEngine.check``)."""
        self.ttft.on_load(load, now)
        return self.live.check(load, len(self.outstanding))

    # ------------------------------------------------------------------ decision
    def decide(self, req: Tokenized, cached: int, now: float) -> Decision:
        """Decide for ``req`` (``cached``: prompt tokens the pool already holds). An
        accepted or degraded request is in the ledger when this returns; a queued one is
        held until ``release`` or ``expire`` hands it back."""
        decision = self._decide(req, cached, now)
        self.decisions[decision.kind, decision.service_class] += 1
        if decision.kind == REJECT:
            self.rejections[decision.reason, decision.service_class] += 1
        if decision.kind in (ACCEPT, DEGRADE):
            self._admit(req, decision, now)
        elif decision.kind == QUEUE:
            self._enqueue(req, decision, now)
        return decision

    def beyond_deadline(self, req: Tokenized, cached: int) -> bool:
        """Whether ``req`` misses its TTFT deadline even with ``cached`` prompt tokens
        already cached (the most a prefix lookup could find). Prediction only grows with
        the uncached prompt, so such a request is rejected as ``deadline_unmeetable`` by
        whatever the lookup finds: the service decides it without asking the kv_manager,
        which makes a rejection under overload one hop cheaper."""
        if self.kind != "deadline" or (tenant := self.tenants.get(req.tenant)) is None:
            return False
        cls = self._grant_class(tenant, req.service_class)
        if isinstance(cls, str):
            return False
        prompt = len(req.prompt_token_ids)
        uncached, done = max(prompt - cached, 0), min(cached, prompt)
        deadline = self.deadline_ms(req, cls, uncached, done)
        raw = self.ttft.predicted_s(uncached, req.tenant, done,
                                    max(cls.priority, req.priority), due_ns(req, deadline))
        return deadline is not None and raw is not None and \
            (raw + self.ttft.bias_s) * 1e3 > deadline * (1.0 - self.config.admission.ttft_headroom)

    def _decide(self, req: Tokenized, cached: int, now: float) -> Decision:
        cfg = self.config
        tenant = self.tenants.get(req.tenant)
        if tenant is None:
            return self._reject(req, "unknown_tenant", f"unknown tenant {req.tenant!r}")
        granted = self._grant_class(tenant, req.service_class)
        if isinstance(granted, str):
            return self._reject(req, "class_not_allowed", granted)
        cls = granted
        priority = max(cls.priority, req.priority)     # a client may only lower its own
        max_tokens = req.params.max_tokens
        if cls.max_tokens is not None and (max_tokens is None or max_tokens > cls.max_tokens):
            max_tokens = cls.max_tokens
        est = self.estimate(req, cached, cls, max_tokens)
        base = dict(service_class=cls.name, priority=priority, max_tokens=max_tokens,
                    estimate=est)
        if (why := check_params(req.params)) is not None:
            return self._reject(req, "invalid_request", why, **base)
        if req.params.n > cfg.scheduler.max_num_seqs:
            return self._reject(req, "invalid_request", f"n ({req.params.n}) exceeds the "
                                f"engine's max_num_seqs ({cfg.scheduler.max_num_seqs})", **base)
        if (bad := check_length(len(req.prompt_token_ids), max_tokens,
                                cfg.engine.max_model_len)) is not None:
            return self._reject(req, bad[0], bad[1], **base)
        if self.kind == "fcfs":
            return self._fcfs(req, tenant, now, base)
        return self._deadline(req, tenant, cls, now, base)

    def _fcfs(self, req: Tokenized, tenant: TenantConfig, now: float, base: dict) -> Decision:
        cap = self.config.admission.max_outstanding
        if len(self.outstanding) >= cap:
            return self._reject(req, "overloaded", f"the engine holds {cap} requests, its cap",
                                retry=len(self.outstanding) - cap + 1, now=now, **base)
        held = self.per_tenant[req.tenant]
        if held >= tenant.max_outstanding:
            return self._reject(req, "tenant_over_budget",
                                f"tenant holds {tenant.max_outstanding} requests, its cap",
                                retry=held - tenant.max_outstanding + 1, now=now, **base)
        return Decision(ACCEPT, "within_caps", **base)

    def _deadline(self, req: Tokenized, tenant: TenantConfig, cls: ServiceClass, now: float,
                  base: dict) -> Decision:
        est: Estimate = base["estimate"]
        seqs = req.params.n
        if tenant.kv_blocks and est.kv_blocks > tenant.kv_blocks:
            if not (cls.may_degrade and self._degraded_tokens(req, est, tenant.kv_blocks, cls)):
                return self._reject(req, "tenant_kv_budget",
                                    f"needs {est.kv_blocks} KV blocks; the tenant's budget is "
                                    f"{tenant.kv_blocks}", **base)
        bucket = self._bucket(tenant, now)
        cost = est.uncached_tokens + seqs * est.expected_output
        if bucket is not None and bucket.refill(now) < cost:
            fit = self._degrade_for_tokens(req, est, bucket.level, cls)
            if fit is None:
                return self._reject(req, "tenant_token_budget",
                                    f"needs {cost} tokens; the tenant's bucket holds "
                                    f"{int(bucket.level)} (rate {tenant.token_rate:g}/s)",
                                    retry_s=bucket.wait_s(cost, now), **base)
            return self._degrade(req, cls, fit, base, "tenant_token_budget", now)
        headroom = 1.0 - self.config.admission.ttft_headroom
        bound = first_token_bound_ms(est)
        if bound is not None and est.predicted_ttft_s is not None \
                and est.predicted_ttft_s * 1e3 > bound * headroom:
            which = "deadline" if bound == est.deadline_ms else "end-to-end deadline"
            return self._reject(req, "deadline_unmeetable",
                                f"predicted TTFT {est.predicted_ttft_s * 1e3:.0f} ms; {which} "
                                f"{bound:.0f} ms less {headroom_pct(headroom)} headroom",
                                retry_s=est.predicted_ttft_s - bound / 1e3, **base)
        blocker = self._blocker(req.tenant, tenant, est, seqs, cls.name)
        if blocker is None and self._behind_queue(req.tenant, base["priority"], est, now):
            blocker = "queue"                  # fits, but must not jump those waiting
        if blocker is None:
            return Decision(ACCEPT, "fits", **base)
        if cls.may_degrade and blocker in _KV_BLOCKERS:
            room = self._room(req.tenant, tenant)
            fit = self._degraded_tokens(req, est, room, cls)
            if fit is not None:
                degraded = self._degrade(req, cls, fit, base, "kv_pressure"
                                         if blocker == "kv_pressure" else "kv_capacity", now)
                if degraded.kind == DEGRADE:
                    return degraded
        if cls.max_queue_ms <= 0:
            reason = "tenant_over_budget" if blocker.startswith("tenant") else \
                _REJECTED_FOR.get(blocker, "overloaded")
            why = self._why(blocker, est, cls.name, seqs)
            return self._reject(req, reason, f"no capacity now ({why}) and class "
                                f"{cls.name!r} does not queue", retry=1, now=now, **base)
        if len(self.queue) >= self.config.admission.max_queued or \
                self.queue.count(req.tenant) >= tenant.max_queued:
            return self._reject(req, "queue_full", "admission's queue is full",
                                retry=len(self.queue) + 1, now=now, **base)
        return Decision(QUEUE, f"waiting_for_{blocker}", **base)

    def _grant_class(self, tenant: TenantConfig, asked: str | None) -> ServiceClass | str:
        allowed = self.config.admission.allowed_classes(tenant)
        default = self.classes[allowed[0]]
        if asked is None or asked == default.name:
            return default
        if asked not in allowed:
            return f"tenant {tenant.name!r} may not use class {asked!r} (allowed: " \
                   f"{', '.join(allowed)})"
        cls = self.classes[asked]
        if cls.priority < default.priority:
            return f"class {asked!r} is above the tenant's class {default.name!r}; a " \
                   f"client may ask only for a lower class"
        return cls

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
                                    max(cls.priority, req.priority), due_ns(req, deadline))
        context = prompt + expected // 2           # each choice's mean over its decode
        horizon = self._horizon(cls.name, req.params.n, context)
        return Estimate(uncached, expected, self._blocks(uncached, expected, req.params.n),
                        None if raw is None else raw + self.ttft.bias_s, deadline, raw,
                        context, horizon.step_s if horizon is not None else None,
                        e2e_deadline_ms(req, cls))

    def _horizon(self, cls: str, n: int, context: int) -> Horizon | None:
        """The decode horizon of ``n`` more sequences of ``cls`` (``LiveEngine.horizon``);
        checked under the deadline policy only."""
        if self.kind != "deadline":
            return None
        return self.live.horizon(cls, n, context, self.class_seqs)

    def deadline_ms(self, req: Tokenized, cls: ServiceClass, uncached: int,
                    cached: int) -> float | None:
        """The request's TTFT deadline: its own ``deadline_ms`` as the client set it; else
        its class's ``ttft_slo_ms``, stretched for a prompt whose own prefill on this
        machine (``TtftModel.alone_s``, nothing ahead of it) takes more than half of it, to
        that prefill plus half the target. A class's target is what interactive work may
        wait; a prompt is never refused for its size alone (8k tokens on two CPU cores take
        longer than a 3 s target with nothing else running), and it still may not wait
        longer than a short one could."""
        if req.deadline_ms is not None:
            return req.deadline_ms
        if cls.ttft_slo_ms is None:
            return None
        alone = self.ttft.alone_s(uncached, cached)
        if alone is None:
            return cls.ttft_slo_ms
        return max(cls.ttft_slo_ms, cls.ttft_slo_ms / 2 + alone * 1e3)

    def _blocks(self, uncached: int, output: int, n: int) -> int:
        grow = output * (1 + self.config.admission.kv_safety)
        return math.ceil((uncached + n * grow) / self.block_size)

    # ------------------------------------------------------------------ capacity
    def _room(self, name: str, tenant: TenantConfig) -> int:
        room = self.kv_capacity - self.reserved_blocks
        live = self.live.kv_room(self.reserved_blocks)
        if live is not None:
            room = min(room, live)
        if tenant.kv_blocks:
            room = min(room, tenant.kv_blocks - self.tenant_blocks[name])
        return room

    def _blocker(self, name: str, tenant: TenantConfig, est: Estimate, seqs: int,
                 cls: str) -> str | None:
        """What keeps a request of class ``cls`` with estimate ``est`` and ``seqs``
        sequences from starting now, or None. The decode horizon (``tpot``) comes before
        the KV checks: a lower max_tokens does not shorten a step."""
        blocks = est.kv_blocks
        if len(self.outstanding) >= self.config.admission.max_outstanding:
            return "engine_cap"
        if self.per_tenant[name] >= tenant.max_outstanding:
            return "tenant_cap"
        if tenant.max_running and self.tenant_seqs[name] + seqs > tenant.max_running:
            return "tenant_running"
        if tenant.kv_blocks and self.tenant_blocks[name] + blocks > tenant.kv_blocks:
            return "tenant_kv"
        horizon = self._horizon(cls, seqs, est.decode_context)
        if horizon is not None and horizon.at_risk:
            return "tpot"
        if self.reserved_blocks + blocks > self.kv_capacity:
            return "kv"
        live = self.live.kv_room(self.reserved_blocks)
        if live is not None and blocks > live:
            return "kv_pressure"
        return None

    def _why(self, blocker: str, est: Estimate, cls: str, seqs: int) -> str:
        """What holds a request, for its rejection's message."""
        if blocker == "kv_pressure":
            return (f"it needs {est.kv_blocks} KV blocks; the pool has "
                    f"{self.live.load.kv_free_blocks} free, "
                    f"{self.live.kv_room(self.reserved_blocks)} of them neither owed to "
                    f"admitted requests nor the watermark")
        horizon = self._horizon(cls, seqs, est.decode_context) if blocker == "tpot" else None
        return horizon.why(self.live.load) if horizon is not None else blocker

    def _behind_queue(self, tenant: str, priority: int, est: Estimate, now: float) -> bool:
        """Is a queued request that waits for the engine's capacity ahead of this one (which
        fits now)? Requests held by their own tenant's caps, and their tenant's later ones,
        are passed over, as ``release`` passes them."""
        if not self.queue:
            return False
        deadline_at = now + est.deadline_ms / 1e3 if est.deadline_ms is not None else math.inf
        capped: set[str] = set()
        for item in self.queue.ahead_of(tenant, priority, deadline_at, now):
            if item.req.tenant in capped:
                continue
            blocker = self._blocker(item.req.tenant, self.tenants[item.req.tenant],
                                    item.decision.estimate, item.req.params.n,
                                    item.decision.service_class)
            if blocker in _TENANT_BLOCKERS:
                capped.add(item.req.tenant)
            elif blocker is not None:
                return True
        return False

    def _degraded_tokens(self, req: Tokenized, est: Estimate, blocks: int,
                         cls: ServiceClass) -> int | None:
        """The largest max_tokens whose reservation fits ``blocks`` (>= min_max_tokens)."""
        n = req.params.n
        per = n * (1 + self.config.admission.kv_safety)
        fit = int((blocks * self.block_size - est.uncached_tokens) / per) if per else 0
        fit = min(fit, est.expected_output - 1)
        return fit if fit >= cls.min_max_tokens else None

    def _degrade_for_tokens(self, req: Tokenized, est: Estimate, level: float,
                            cls: ServiceClass) -> int | None:
        if not cls.may_degrade:
            return None
        fit = int((level - est.uncached_tokens) / req.params.n)
        fit = min(fit, est.expected_output - 1)
        return fit if fit >= cls.min_max_tokens else None

    def _degrade(self, req: Tokenized, cls: ServiceClass, max_tokens: int, base: dict,
                 why: str, now: float) -> Decision:
        est: Estimate = base["estimate"]
        blocks = self._blocks(est.uncached_tokens, max_tokens, req.params.n)
        tenant = self.tenants[req.tenant]
        degraded = replace(est, expected_output=max_tokens, kv_blocks=blocks,
                           decode_context=est.decode_context - est.expected_output // 2
                           + max_tokens // 2)
        if self._blocker(req.tenant, tenant, degraded, req.params.n, cls.name) is not None:
            return self._reject(req, "overloaded", "no capacity even degraded", retry=1,
                                now=now, **base)
        return Decision(DEGRADE, why, cls.name, base["priority"], max_tokens, degraded)

    def _bucket(self, tenant: TenantConfig, now: float) -> TokenBucket | None:
        if tenant.token_rate <= 0:
            return None
        if tenant.name not in self._buckets:
            self._buckets[tenant.name] = TokenBucket(tenant.token_rate, tenant.token_burst, now)
        return self._buckets[tenant.name]

    def _reject(self, req: Tokenized, reason: str, message: str, *, retry: int = 0,
                retry_s: float | None = None, now: float = 0.0, service_class: str = "",
                priority: int = 0, max_tokens: int | None = None,
                estimate: Estimate | None = None) -> Decision:
        after = retry_s if retry_s is not None else (
            self.releases.retry_after(retry, now) if retry else None)
        if after is not None:
            after = round(min(max(after, 0.1), 60.0), 1)
        est = estimate or Estimate(len(req.prompt_token_ids), 0, 0, None, req.deadline_ms)
        return Decision(REJECT, reason, service_class, priority, max_tokens, est,
                        Rejected(req.request_id, reason, message, after))

    # ------------------------------------------------------------------ ledger
    def _admit(self, req: Tokenized, decision: Decision, now: float) -> None:
        rid, tenant = req.request_id, req.tenant
        seqs = req.params.n
        blocks = decision.estimate.kv_blocks if self.kind == "deadline" else 0
        self._hold(HeldRequest(rid, tenant, decision.service_class, seqs, blocks,
                               decision.estimate.scheduler_ttft_s))
        self.ttft.admitted(rid, tenant, decision.estimate.uncached_tokens,
                           decision.estimate.scheduler_ttft_s,
                           len(req.prompt_token_ids) - decision.estimate.uncached_tokens,
                           decision.priority, due_ns(req, decision.estimate.deadline_ms))
        self.vtc.charge(tenant, decision.estimate.uncached_tokens,
                        seqs * decision.estimate.expected_output)
        self.live.admitted_since += 1
        if self.kind == "deadline" and (bucket := self._bucket(self.tenants[tenant], now)):
            bucket.take(decision.estimate.uncached_tokens
                        + seqs * decision.estimate.expected_output, now)

    def _hold(self, entry: HeldRequest) -> None:
        """Count an admitted request in the ledger; ``released`` subtracts this entry."""
        self.outstanding[entry.request_id] = entry.tenant
        self.per_tenant[entry.tenant] += 1
        self.held[entry.request_id] = entry
        self.reserved_blocks += entry.kv_blocks
        self.tenant_blocks[entry.tenant] += entry.kv_blocks
        self.tenant_seqs[entry.tenant] += entry.n
        self.class_seqs[entry.service_class] += entry.n

    def released(self, request_ids: list[str], now: float,
                 output_tokens: dict[str, int] | None = None,
                 ttft_s: dict[str, float] | None = None) -> None:
        """Requests the scheduler let go. ``output_tokens`` teach the expected output;
        ``ttft_s`` (arrival → first token, as the engine saw it) teach the TTFT model's
        bias (:meth:`TtftModel.ended`)."""
        for rid in request_ids:
            tenant = self.outstanding.pop(rid, None)
            if tenant is None:
                continue
            self.per_tenant[tenant] -= 1
            self.releases.ended(now)
            held = self.held.pop(rid)
            self.reserved_blocks -= held.kv_blocks
            self.tenant_blocks[tenant] -= held.kv_blocks
            self.tenant_seqs[tenant] -= held.n
            self.class_seqs[held.service_class] -= held.n
            if output_tokens and rid in output_tokens and held.service_class:
                self.outputs.observe(tenant, held.service_class,
                                     output_tokens[rid] // max(held.n, 1))
            self.ttft.ended(rid, now, ttft_s.get(rid) if ttft_s else None,
                            held.predicted_ttft_s)

    def holding(self, held: list[HeldRequest]) -> None:
        """After a restart of admission: the scheduler's requests, each with the entry this
        ledger made when it admitted it (``Admitted.held``), counted again as it was, so
        budgets, running caps and each ``Released`` come out as if nothing restarted. A
        request already here keeps its entry: the streamer replayed it first and it was
        decided again, and its ``Released`` subtracts that one. Their prefill is not
        added to the TTFT model's unreported tokens: the scheduler's load reports count
        it; nor charged to VTC or the token buckets, which were charged once already."""
        for entry in held:
            if entry.request_id not in self.outstanding:
                self._hold(entry)

    def forget_all(self) -> None:
        """The scheduler restarted and dropped everything it held."""
        self.outstanding.clear()
        self.per_tenant.clear()
        self.held.clear()
        self.reserved_blocks = 0
        self.tenant_blocks.clear()
        self.tenant_seqs.clear()
        self.class_seqs.clear()
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
            decision, blocker = self._fits_now(item, now)
            if decision is None:
                if blocker in _TENANT_BLOCKERS:
                    capped.add(item.tenant)
                    continue
                break
            self.queue.remove(item.request_id)
            self._admit(item.req, decision, now)
            out.append((item.req, decision, now - item.queued_at))
        return out

    def _fits_now(self, item: Queued, now: float) -> tuple[Decision | None, str | None]:
        """The decision a queued request starts with now (degraded if its class may and
        only that fits), or None and what holds it."""
        tenant = self.tenants[item.req.tenant]
        est = item.decision.estimate
        decision = Decision(ACCEPT, "released", item.decision.service_class,
                            item.decision.priority, item.decision.max_tokens, est)
        blocker = self._blocker(item.req.tenant, tenant, est, item.req.params.n,
                                item.decision.service_class)
        if blocker is None:
            return decision, None
        # a class that may degrade starts with a lower max_tokens once that fits
        cls = self.classes[item.decision.service_class]
        if not (cls.may_degrade and blocker in _KV_BLOCKERS):
            return None, blocker
        fit = self._degraded_tokens(item.req, est, self._room(item.req.tenant, tenant), cls)
        if fit is None:
            return None, blocker
        decision = self._degrade(item.req, cls, fit, {"priority": decision.priority,
                                                      "estimate": est}, "released", now)
        return (decision, None) if decision.kind == DEGRADE else (None, blocker)

    @property
    def queued(self) -> int:
        return len(self.queue)

    def stats(self) -> dict[str, float]:
        """Counters for ``weir status`` and the gateway's metrics."""
        out: dict[str, float] = {"outstanding": len(self.outstanding), "queued": self.queued,
                                 "reserved_kv_blocks": self.reserved_blocks}
        # a router's load signal: the wait a new prompt would see before its own prefill
        # (the whole backlog, learned bias included), and the measured prefill rate
        ahead = self.ttft.predicted_s(0)
        if ahead is not None:
            out["predicted_queue_s"] = max(ahead + self.ttft.bias_s, 0.0)
            out["ttft_bias_s"] = round(self.ttft.bias_s, 4)
            out["prefill_tokens_per_s"] = self.ttft.load.prefill_tokens_per_s
        out.update({f"decisions.{kind}.{cls}": v for (kind, cls), v in self.decisions.items()})
        out.update({f"rejections.{reason}.{cls}": v
                    for (reason, cls), v in self.rejections.items()})
        out.update({f"queue_depth.{cls}": v for cls, v in self.queue_depth.items()})
        out.update(self.ledger_stats())
        out.update(self.live_stats())
        return out

    def live_stats(self) -> dict[str, float]:
        """The live engine as admission sees it: the pool's free and evictable blocks, the
        room a reservation has by it, the blocks it holds beyond the ledger's reservations
        and the cross-check's mismatches (``live.py``); the decode batch's measured step,
        each class's live TPOT, the cost model's decode rates and the knee (the batch the
        tightest running TPOT target allows; -1 without rates)."""
        live, load = self.live, self.live.load
        out: dict[str, float] = {"kv.crosscheck_mismatches": live.mismatches}
        if load.kv_free_blocks >= 0:
            out["kv.live_free_blocks"] = load.kv_free_blocks
            out["kv.live_evictable_blocks"] = load.kv_evictable_blocks
            out["kv.live_room_blocks"] = live.kv_room(self.reserved_blocks)
            out["kv.unreserved_blocks"] = live.unreserved_blocks(self.reserved_blocks)
        if self.kind == "deadline" and live.enabled:
            knee = live.knee(self.class_seqs)
            out["horizon.knee_seqs"] = knee if knee is not None else -1
        if (rates := load.decode_rates) is not None:
            out["horizon.decode_base_ms"] = round(rates.base_s * 1e3, 3)
            out["horizon.decode_per_seq_ms"] = round(rates.per_seq_s * 1e3, 4)
            out["horizon.decode_per_position_us"] = round(rates.per_context_s * 1e6, 4)
        out["horizon.decode_measured_ms"] = round(load.decode_measured_s * 1e3, 2)
        out["horizon.decode_error"] = round(load.decode_error, 3)
        out.update({f"horizon.tpot_ms.{c}": round(v * 1e3, 2) for c, v in load.tpot_s.items()})
        return out

    def ledger_stats(self) -> dict[str, float]:
        """The ledger by tenant (``ledger.outstanding|kv_blocks|seqs.<tenant>``) and by
        class (``ledger.class_outstanding|class_kv_blocks.<class>``). A tenant or class
        with nothing held is left out, so an idle engine reports none and a count that
        went wrong (negative) shows."""
        out: dict[str, float] = {}
        for tenant in self.per_tenant.keys() | self.tenant_blocks.keys() | \
                self.tenant_seqs.keys():
            counts = (self.per_tenant[tenant], self.tenant_blocks[tenant],
                      self.tenant_seqs[tenant])
            if any(counts):
                for key, v in zip(("outstanding", "kv_blocks", "seqs"), counts):
                    out[f"ledger.{key}.{tenant}"] = v
        by_class: Counter[str] = Counter()
        for entry in self.held.values():
            by_class[f"ledger.class_outstanding.{entry.service_class}"] += 1
            by_class[f"ledger.class_kv_blocks.{entry.service_class}"] += entry.kv_blocks
        out.update(by_class)
        return out
