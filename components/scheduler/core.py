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
(``sequence.py``).

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

Contract
--------
The core is composed of parts, each a class owning its state; the core builds them and
hands each the others it uses, explicitly. None of them imports this module.

- ``tenants`` (tenants.py, ``Tenants``): each tenant's virtual counter, token bucket, KV
  budget and running cap.
- ``queues`` (queues.py, ``Queues``): ``waiting``, ``running``, ``by_request``, ``by_seq``,
  the seq ids and the fair order. The only part that adds or removes sequences.
- ``prices`` (prices.py, ``Prices``): recompute against copy estimates, and the host
  tier's measured bandwidth.
- ``leases`` (kv_requests.py, ``LeaseBook``): the epoch, the KV ops not sent yet (taken as
  one ``KvOps``), the block copies and drops the next plan carries, the free counts a
  refused lease waits on; applies grants.
- ``preemptor`` (preemption.py, ``Preemptor``): who gives KV back and how, urgency, and
  the preemption counters and the last step's decisions.
- ``output`` (output.py, ``OutputStage``): samples into ``TokenOut``, forks, stop
  conditions, and every end of a choice (stop, cancel, deadline, reset).
- ``planner`` (planning.py, ``Planner``): the step plan, the steps in flight, the count of
  steps.

What the loop (loop.py, and the replay simulator, weir/replay/sim.py) may call:

- inputs: ``add``, ``on_grants``, ``on_result``, ``on_executor``, ``cancel``, ``stop``,
  ``end_at_deadline``, ``reset``; each returns what it produced (an ``Outcome``, or the
  new ``Seq`` for ``add``), or nothing.
- outputs: ``schedule`` (a ``StepPlan`` or None; only with fewer than
  ``scheduler.async_depth`` steps in flight), then ``take_kv_ops`` (the ops to send to the
  kv_manager before that plan reaches the executor).
- reads, never to be mutated from outside: ``waiting``, ``running``, ``by_request``,
  ``by_seq``, ``in_flight``, ``has_work``, ``epoch``, ``vtc``, ``fair``, ``cost`` (the step
  cost model, which the loop teaches with ``cost.observe``), ``running_slots()``,
  ``over_rate()``, ``victim_key()``, the counters (``steps``, ``preemptions``,
  ``preemptions_by_kind``, ``preemption_reasons``, ``wasted_tokens``, ``swapped_blocks``,
  ``discarded_samples``) and the last plan's ``last_preempted`` and ``last_urgency``.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from components.costs.cost_model import StepCostModel, StepShape
from components.scheduler.kv_requests import LeaseBook
from components.scheduler.output import Outcome, OutputStage
from components.scheduler.planning import Planner
from components.scheduler.preemption import Preemption, Preemptor, UrgencyDecision
from components.scheduler.prices import Prices
from components.scheduler.queues import Queues
from components.scheduler.sequence import Seq
from components.scheduler.speculation import Speculation
from components.scheduler.tenants import Tenants
from components.tenancy.fairness import VirtualCounters
from schemas.config import KvConfig, SchedulerConfig, SpeculativeConfig, TenantConfig
from schemas.wire import Admitted, KvGrant, KvOps, StepPlan, StepResult, StepSample

__all__ = ["Outcome", "Preemption", "SchedulerCore", "UrgencyDecision"]


class SchedulerCore:
    def __init__(self, cfg: SchedulerConfig, kv: KvConfig, max_model_len: int,
                 epoch: int = 1, weights: dict[str, float] | None = None,
                 tenants: Sequence[TenantConfig] = (),
                 speculative: SpeculativeConfig | None = None) -> None:
        self.cfg = cfg
        self.max_model_len = max_model_len
        # learned from measured steps (loop.py)
        self.cost = StepCostModel(deterministic_factor=cfg.deterministic_cost_factor)
        self.tenants = Tenants(cfg, tenants, weights)
        self.queues = Queues(self.tenants, kv.num_blocks)
        self.prices = Prices(self.cost, kv.block_size)
        self.leases = LeaseBook(cfg, self.queues, self.prices, kv.block_size, kv.grow_blocks,
                                max_model_len, epoch)
        self.preemptor = Preemptor(cfg, self.queues, self.leases, self.prices, max_model_len,
                                   kv.preemption_mode, kv.num_cpu_blocks)
        # a bare core (unit tests, tools) does not speculate unless told; the service and
        # the simulator pass the config's section, on by default
        self.spec = Speculation(speculative or SpeculativeConfig(method="off"))
        if self.spec.on:                      # growth asked with room for the drafts
            self.leases.draft_room = self.spec.cfg.max_k
        self.output = OutputStage(self.queues, self.leases, max_model_len, self.spec)
        self.planner = Planner(cfg, self.queues, self.leases, self.preemptor, kv.block_size,
                               max_model_len, self.spec, self.cost)

    def reconfigure(self, cfg: SchedulerConfig, tenants: Sequence[TenantConfig],
                    speculative: SpeculativeConfig) -> None:
        """Plan by a live config change's policy from the next step on
        (``schemas/config_change.py``: only fairness, chunking, urgency preemption, the
        tenants' budgets and weights and the speculation limits differ). Every sequence
        keeps what it was admitted with; the tenants' counters carry over by name."""
        self.cfg = self.planner.cfg = self.preemptor.cfg = self.leases.cfg = cfg
        self.preemptor.urgency = cfg.urgency_preemption
        self.tenants.retune(cfg, tenants)
        self.spec.cfg, self.spec.on = speculative, speculative.on

    # ------------------------------------------------------------------ inputs
    def add(self, req: Admitted, now_ns: int = 0) -> Seq:
        """Take an admitted request in at wall-clock ``now_ns`` (0: unknown), from which its
        ingress is measured: the time since its arrival that neither admission's queue nor
        this one held it."""
        arrival_ns = req.header.arrival_ns
        seq = Seq(self.queues.next_id(), req.header, len(req.prompt_token_ids),
                  list(req.prompt_token_ids), list(req.block_hashes),
                  frozenset(req.eos_token_ids), aging_per_s=req.aging_per_s,
                  public_scope=req.public_scope, public_blocks=req.public_blocks,
                  held=req.held, prompt_lps=None if req.params.prompt_logprobs is None else [],
                  ingress_ns=max(now_ns - arrival_ns - req.queued_ns, 0) if now_ns else 0)
        seq.group.append(seq)
        self.queues.admit(seq, now_ns or arrival_ns)
        self.leases.lease_waiting()           # ask its lease now, not when the next step is planned
        return seq

    def on_grants(self, grants: list[KvGrant], free_cpu_blocks: int = -1) -> None:
        """The kv_manager answered (``free_cpu_blocks``: its host tier's free blocks, -1:
        not said)."""
        if free_cpu_blocks >= 0:
            self.preemptor.cpu_free = free_cpu_blocks
        self.leases.on_grants(grants, self.preemptor)

    def on_result(self, result: StepResult, now_ns: int = 0) -> Outcome:
        """A step answered: only the oldest step in flight is taken (any other step id is
        from before a reset, and ignored; results come in step order)."""
        planned = self.planner.answered(result.step_id)
        if planned is None:
            return Outcome()                  # a step planned before a reset
        return self.output.on_result(result, planned, now_ns)

    def on_executor(self, block_bytes: int, copy_bytes_per_s: float,
                    step_costs: Sequence[StepSample] = ()) -> None:
        """The executor reported what moving a block to and from its host tier costs, and
        the steps it timed at startup: the step-cost model starts from their fit (the steps
        this scheduler measures then refine it)."""
        self.prices.block_bytes, self.prices.copy_bytes_per_s = block_bytes, copy_bytes_per_s
        self.cost.prior_from((StepShape(s.tokens, s.context, s.seqs, s.pairs), s.seconds)
                             for s in step_costs)

    def cancel(self, request_id: str) -> Outcome:
        """Cancel a request (every choice) wherever it is; its blocks go back at once."""
        return self.output.cancel(request_id)

    def stop(self, request_id: str, index: int = 0) -> Outcome:
        """A stop string ended choice ``index`` (the detokenizer already closed it)."""
        return self.output.stop(request_id, index)

    def end_at_deadline(self, request_id: str, now_ns: int) -> Outcome:
        """End a request that has streamed tokens at its end-to-end deadline (output.py)."""
        return self.output.end_at_deadline(request_id, now_ns)

    def reset(self, kv_lost: bool) -> Outcome:
        """A peer lost its state (executor or kv_manager restarted), or a step failed: drop
        every sequence and every step in flight (their late results are ignored). Their
        blocks are freed unless the pool itself was lost, at once: nothing is planned on
        them any more, and the executor runs any later plan after the steps it still has.
        Starts a new epoch if the pool was lost."""
        out = Outcome()
        self.planner.in_flight.clear()
        for parent in list(self.queues.by_request.values()):
            out.forget.append(parent.request_id)
            for seq in list(parent.group):
                if seq.ended:
                    continue
                seq.num_computed = 0      # the executor's KV is gone (or void): cache nothing
                seq.known_to_executor = False
                self.output.finish(seq, out, free=not kv_lost)
        self.leases.reset(kv_lost)
        self.queues.clear_seqs()
        return out

    # ------------------------------------------------------------------ outputs
    def schedule(self, now_ns: int = 0, budget: int | None = None) -> StepPlan | None:
        """Plan the next step, or None if nothing can run now (planning.py)."""
        return self.planner.schedule(now_ns, budget)

    def take_kv_ops(self) -> KvOps | None:
        return self.leases.take_kv_ops()

    # ------------------------------------------------------------------ reads
    @property
    def has_work(self) -> bool:
        return bool(self.queues.running or self.queues.waiting)

    @property
    def waiting(self) -> deque[Seq]:
        return self.queues.waiting

    @property
    def running(self) -> list[Seq]:
        return self.queues.running

    @property
    def by_request(self) -> dict[str, Seq]:
        return self.queues.by_request

    @property
    def by_seq(self) -> dict[int, Seq]:
        return self.queues.by_seq

    @property
    def in_flight(self) -> dict[int, dict[int, int]]:
        return self.planner.in_flight

    @property
    def steps(self) -> int:
        return self.planner.steps

    @property
    def epoch(self) -> int:
        return self.leases.epoch

    @property
    def vtc(self) -> VirtualCounters:
        return self.tenants.vtc

    @property
    def fair(self) -> bool:
        return self.tenants.fair

    def running_slots(self) -> Counter[str]:
        return self.queues.running_slots()

    def over_rate(self, tenant: str, now_s: float) -> bool:
        return self.tenants.over_rate(tenant, now_s)

    def victim_key(self):
        return self.preemptor.victim_key()

    @property
    def preemptions(self) -> int:
        return self.preemptor.preemptions

    @property
    def preemptions_by_kind(self) -> Counter[str]:
        return self.preemptor.preemptions_by_kind

    @property
    def preemption_reasons(self) -> Counter[str]:
        return self.preemptor.preemption_reasons

    @property
    def wasted_tokens(self) -> int:
        return self.preemptor.wasted_tokens

    @property
    def swapped_blocks(self) -> int:
        return self.preemptor.swapped_blocks

    def spec_stats(self) -> dict[str, float]:
        """Speculation's counters (empty when off): drafted and accepted tokens by class,
        decode rows by k, verifies and the tokens they emitted."""
        if not self.spec.on:
            return {}
        st = self.spec.stats
        out: dict[str, float] = {"spec.verifies": st.passes, "spec.emitted": st.emitted}
        for cls in st.drafted:
            out[f"spec.drafted.{cls}"] = st.drafted[cls]
            out[f"spec.accepted.{cls}"] = st.accepted[cls]
        for k, n in st.k_hist.items():
            out[f"spec.k.{k}"] = n
        for why, n in st.reasons.items():
            out[f"spec.none.{why}"] = n
        return out

    @property
    def discarded_samples(self) -> int:
        return self.output.discarded_samples

    @property
    def last_preempted(self) -> list[Preemption]:
        return self.preemptor.last_preempted

    @property
    def last_urgency(self) -> list[UrgencyDecision]:
        return self.preemptor.last_urgency
