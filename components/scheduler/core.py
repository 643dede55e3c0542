"""The scheduler's pure core: continuous batching under a uniform token budget.

NOTE: there is no prefill phase and no decode phase. Every step, each running
sequence advances ``num_computed`` toward ``num_tokens``. Decode tokens (one per
sequence that has caught up) are reserved first; prefill chunks fill what
remains of the step's token budget, so a long prompt is prefilled over several
steps while others keep decoding.

KV blocks come from the kv_manager asynchronously. The core never waits: it
emits batched ``AllocRequest``/``FreeRequest`` ops, asks for growth
``lookahead_tokens`` ahead, and a sequence whose grant has not arrived simply
sits out a step. Each sequence's lifecycle is one explicit state machine
(``sequence.py``); the core is split by subject:

- ``planning.py``: the step plan: decode first, chunked prefill, new work in fair order
  under each tenant's running cap.
- ``kv_requests.py``: leases, growth, swap-in and fork requests, and their grants.
- ``preemption.py``: who gives blocks back when growth is refused, recompute or swap,
  and urgency preemption for a request about to miss its TTFT deadline.
- ``output.py``: sampled tokens, forks for n > 1, stop conditions, finishing.

Steps in flight: up to ``scheduler.async_depth`` plans may be at the executor at once (it
runs them in order). ``in_flight`` maps each one's step id, oldest first, to the tokens it
computes per sequence; each sequence also keeps its own (``Seq.in_flight``) and plans from
its planned position. A result is taken only for the oldest step in flight. A sequence that
ends or is preempted gives its blocks back at once (``FreeRequest``, which also enters its
computed blocks in the prefix cache, or ``SwapOutRequest``), steps in flight or not: the
executor runs plans in order, so the blocks are used again only after those steps
(``kv_requests.py``).

Synchronous and torch-free; ``loop.py`` feeds it messages and the service sends what it
returns.
"""
from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Sequence
from typing import Callable

from components.tenancy.bucket import TokenBucket
from components.costs.cost_model import StepCostModel, StepShape, prefill_shape
from components.tenancy.fairness import VirtualCounters
from components.scheduler.kv_requests import KvRequests
from components.scheduler.output import Outcome, Output
from components.scheduler.planning import Planning
from components.scheduler.preemption import Preemption, Preempting, UrgencyDecision
from components.scheduler.sequence import Seq, State
from schemas.config import KvConfig, SchedulerConfig, TenantConfig
from schemas.wire import (Admitted, AllocRequest, BlockCopy, ForkRequest, FreeRequest, KvOps,
                          StepSample, SwapOutRequest)

__all__ = ["Outcome", "Preemption", "SchedulerCore", "UrgencyDecision"]


class SchedulerCore(Planning, KvRequests, Preempting, Output):
    def __init__(self, cfg: SchedulerConfig, kv: KvConfig, max_model_len: int,
                 epoch: int = 1, weights: dict[str, float] | None = None,
                 tenants: Sequence[TenantConfig] = ()) -> None:
        self.cfg = cfg
        self.block_size = kv.block_size
        self.grow_blocks = kv.grow_blocks
        self.num_blocks = kv.num_blocks
        self.max_model_len = max_model_len
        self.epoch = epoch
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.by_request: dict[str, Seq] = {}
        self.by_seq: dict[int, Seq] = {}
        self._ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._allocs: list[AllocRequest] = []
        self._frees: list[FreeRequest] = []
        self._drop: list[int] = []
        # the steps sent to the executor and not answered, oldest first:
        # step_id -> {seq_id: tokens computed for it}
        self.in_flight: dict[int, dict[int, int]] = {}
        self.discarded_samples = 0   # sampled for a sequence that ended (or was preempted)
                                     # while the step ran: the price of planning ahead
        self._frees_emitted = 0    # FreeRequests so far; a refused lease retries after more
        self._tenant_frees: Counter[str] = Counter()    # the same, per tenant (budget refusals)
        self._forks: list[ForkRequest] = []
        self._swap_outs: list[SwapOutRequest] = []
        self._swap_ins: list[int] = []
        self._copies: list[BlockCopy] = []
        self.preemption_mode = kv.preemption_mode
        self.cpu_free = kv.num_cpu_blocks       # host-tier blocks free, as last reported
        self.block_bytes = 0                    # set when the executor reports in
        self.copy_bytes_per_s = 0.0
        self.cost = StepCostModel()             # learned from measured steps (loop.py)
        self.recompute_s: Callable[[int], float] = \
            lambda tokens: self.cost.predict(prefill_shape(tokens))   # prefill estimate
        self.preemptions = 0
        self.preemptions_by_kind: Counter[str] = Counter()
        self.preemption_reasons: Counter[str] = Counter()
        self.wasted_tokens = 0           # computed tokens thrown away by preemption (recompute)
        self.swapped_blocks = 0          # blocks sent to the host tier by preemption
        self.last_preempted: list[Preemption] = []
        self.last_urgency: list[UrgencyDecision] = []
        self.steps = 0
        limits = {t.name: t for t in tenants}
        self.kv_budget = {name: t.kv_blocks for name, t in limits.items() if t.kv_blocks}
        self.max_running = {name: t.max_running for name, t in limits.items() if t.max_running}
        # the tenant's token rate, as admission's bucket, charged with the tokens the engine
        # really computes and samples: a tenant past it starts new work after the others
        self.buckets = {name: TokenBucket(t.token_rate, t.token_burst, 0.0)
                        for name, t in limits.items() if t.token_rate}
        if weights is None:
            weights = {name: t.weight for name, t in limits.items()}
        self.vtc = VirtualCounters(weights)
        self.fair = cfg.fairness == "vtc"
        self.urgency = cfg.urgency_preemption

    # ------------------------------------------------------------------ inputs
    def _backlogged_tenants(self) -> set[str]:
        """Tenants with work waiting to start, as VTC counts them: a tenant whose work is
        all running is not backlogged, so its next request is lifted (no banked credit)."""
        return {s.tenant for s in self.waiting}

    def add(self, req: Admitted, now_ns: int = 0) -> Seq:
        """Take an admitted request in at wall-clock ``now_ns`` (0: unknown), from which its
        ingress is measured: the time since its arrival that neither admission's queue nor
        this one held it."""
        deadline_ns = req.arrival_ns + int(req.deadline_ms * 1e6) \
            if req.deadline_ms is not None else 0
        seq = Seq(next(self._ids), req.request_id, req.tenant, req.params,
                  len(req.prompt_token_ids), list(req.prompt_token_ids), list(req.block_hashes),
                  req.arrival_ns, frozenset(req.eos_token_ids), priority=req.priority,
                  aging_per_s=req.aging_per_s, deadline_ns=deadline_ns,
                  tpot_slo_s=req.tpot_slo_ms / 1e3 if req.tpot_slo_ms else None,
                  public_scope=req.public_scope, public_blocks=req.public_blocks,
                  held=req.held, service_class=req.service_class or "",
                  prompt_lps=None if req.params.prompt_logprobs is None else [],
                  ingress_ns=max(now_ns - req.arrival_ns - req.queued_ns, 0) if now_ns else 0)
        seq.group.append(seq)
        self.by_request[seq.request_id] = seq
        self.by_seq[seq.seq_id] = seq
        backlogged = self._backlogged_tenants()
        # lifted, or of a more important class than work already waiting, it may start
        # before others: put it in its place before leases are asked
        reorder = self.fair and (seq.tenant not in backlogged
                                 or any(s.priority > seq.priority for s in self.waiting))
        self.waiting.append(seq)
        if seq.tenant not in backlogged:
            self.vtc.backlogged(seq.tenant, backlogged)
        if reorder:
            self._fair_order(now_ns or req.arrival_ns)
        self._lease_waiting()                 # ask its lease now, not when the next step is planned
        return seq

    def cancel(self, request_id: str) -> Outcome:
        """Cancel a request (every choice) wherever it is; its blocks go back at once."""
        seq = self.by_request.get(request_id)
        out = Outcome()
        if seq is None:
            return out
        if any(s.outputs_sent for s in seq.group):
            out.forget.append(request_id)
        for s in list(seq.group):
            if not s.ended:
                self._finish(s, out)
        return out

    def stop(self, request_id: str, index: int = 0) -> Outcome:
        """A stop string ended choice ``index`` (the detokenizer already closed it)."""
        seq = self.by_request.get(request_id)
        out = Outcome()
        if seq is None:
            return out
        if seq.n == 1:
            return self.cancel(request_id)
        for s in seq.group:
            if s.index == index and not s.ended:
                self._finish(s, out)
        return out

    def on_executor(self, block_bytes: int, copy_bytes_per_s: float,
                    step_costs: Sequence[StepSample] = ()) -> None:
        """The executor reported what moving a block to and from its host tier costs, and
        the steps it timed at startup: the step-cost model starts from their fit (the steps
        this scheduler measures then refine it)."""
        self.block_bytes, self.copy_bytes_per_s = block_bytes, copy_bytes_per_s
        self.cost.prior_from((StepShape(s.tokens, s.context, s.seqs, s.pairs), s.seconds)
                             for s in step_costs)

    def reset(self, kv_lost: bool) -> Outcome:
        """A peer lost its state (executor or kv_manager restarted), or a step failed: drop
        every sequence and every step in flight (their late results are ignored). Their
        blocks are freed unless the pool itself was lost, at once: nothing is planned on
        them any more, and the executor runs any later plan after the steps it still has.
        Starts a new epoch if the pool was lost."""
        out = Outcome()
        self.in_flight.clear()
        for parent in list(self.by_request.values()):
            out.forget.append(parent.request_id)
            for seq in list(parent.group):
                if seq.ended:
                    continue
                seq.num_computed = 0      # the executor's KV is gone (or void): cache nothing
                seq.known_to_executor = False
                self._finish(seq, out, free=not kv_lost)
        self._copies.clear()              # the executor's memory is new (or void)
        if kv_lost:
            self._frees.clear()
            self._allocs.clear()
            self._forks.clear()
            self._swap_outs.clear()
            self._swap_ins.clear()
            self.epoch += 1
        self._drop.clear()
        self.by_seq.clear()
        return out

    # ------------------------------------------------------------------ kv traffic
    def take_kv_ops(self) -> KvOps | None:
        if not (self._allocs or self._frees or self._forks or self._swap_outs or self._swap_ins):
            return None
        ops = KvOps(self.epoch, self._frees, self._allocs, self._forks, self._swap_outs,
                    self._swap_ins)
        self._allocs, self._frees, self._forks, self._swap_outs, self._swap_ins = [], [], [], [], []
        return ops

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------------ tenants
    def held_blocks(self) -> Counter[str]:
        """Device blocks each tenant's sequences hold (as the core knows them)."""
        held: Counter[str] = Counter()
        for seq in self.by_seq.values():
            if seq.holds_lease and seq.state not in (State.SWAPPED, State.SWAPPING_IN,
                                                     State.SWAP_REFUSED):
                held[seq.tenant] += len(seq.block_ids)
        return held

    def over_rate(self, tenant: str, now_s: float) -> bool:
        """Has ``tenant`` used more than its token bucket holds?"""
        bucket = self.buckets.get(tenant)
        return bucket is not None and bucket.refill(now_s) < 0

    def charge(self, tenant: str, now_ns: int, input_tokens: int = 0,
               output_tokens: int = 0) -> None:
        self.vtc.charge(tenant, input_tokens=input_tokens, output_tokens=output_tokens)
        if (bucket := self.buckets.get(tenant)) is not None:
            bucket.take(input_tokens + output_tokens, now_ns / 1e9)

    def over_share(self) -> set[str]:
        """Tenants holding more device blocks than their weighted share of the pool, among
        the tenants with work running or waiting. A full pool holds up the queue for them
        only: they wait, the others go on (KV fairness)."""
        held = self.held_blocks()
        active = {s.tenant for s in self.running} | {s.tenant for s in self.waiting}
        total = sum(self.vtc.weight(t) for t in active) or 1.0
        return {t for t in active if held[t] > self.num_blocks * self.vtc.weight(t) / total}

    def running_slots(self) -> Counter[str]:
        """Running sequences per tenant, an unforked n > 1 request counting n."""
        slots: Counter[str] = Counter()
        for seq in self.running:
            slots[seq.tenant] += seq.slots
        return slots
