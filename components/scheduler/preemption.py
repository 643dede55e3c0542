"""Preemption: who gives KV back when a sequence cannot grow, how (recompute or swap), and
urgency preemption for a request about to miss its time-to-first-token deadline.

Growth refused because the pool is full: ready-but-unscheduled sequences give their blocks
back first; then a running victim is chosen by ``victim_key``: a tenant over its configured
KV budget first, then the least important priority, then a tenant holding more than its
weighted share of the pool, then the latest arrival. Growth refused because the sequence's
own tenant is at its KV budget: the victim comes from that tenant, so other tenants never
pay for it. A stuck sequence may be its own victim.

Recompute frees the victim's blocks (its computed full blocks stay in the prefix cache) and
sends it back to wait under a fresh seq id; swap copies its blocks to the executor's host
tier. The cheaper by estimate is chosen, unless ``kv.preemption_mode`` forces one.

A victim may be in a step still in flight (``scheduler.async_depth`` 2): it is preempted all
the same, what that step computes for it is discarded, and its free or swap-out is sent at
once. The executor runs that step before any plan that uses the blocks again, and the
swap-out's copies ride in a later plan, so they read the victim's KV after the step; they
move its first ``num_computed`` tokens, which answered steps wrote (``kv_requests.py``).
Excluding such victims would leave nothing to preempt: with steps overlapped, every decoding
sequence is nearly always in one.

Urgency: a waiting request that is blocked (no KV, or no free running slot) and would miss
its TTFT deadline waiting for a slot may preempt one running sequence of a lower class. It
does so only when the step-cost model says the intervention (redoing the victim's work) costs
less than the lateness it avoids, and when starting now would meet the deadline. Every such
decision, taken or not, is kept in ``last_urgency`` with both estimates (the step span).

Aging is not importance. Victims and urgency compare the class's own ``priority`` (as
admitted), never ``Seq.aged_priority``: aging is there so that waiting batch work gets to
start (planning.py's fair order), and once started it is still batch work. A batch sequence
that aged to rank with interactive work is preempted before an interactive one, and an
interactive request about to miss its deadline may still preempt it. Preempted, it goes
back ahead of all fresh work in the queue (it holds work), so the wait it aged through is
not lost."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from components.costs.cost_model import decode_shape, prefill_shape
from components.scheduler.kv_requests import LeaseBook
from components.scheduler.prices import Prices
from components.scheduler.queues import Queues
from components.scheduler.sequence import TENANT_BUDGET, Event, Seq, State, in_running
from schemas.config import SchedulerConfig


@dataclass(frozen=True)
class Preemption:
    """One preemption, as recorded for traces and stats."""

    request_id: str
    index: int
    reason: str            # "kv_growth_denied" | "tenant_kv_budget" | "urgency" | ...
    choice: str            # "recompute" | "swap"
    wasted_tokens: int     # computed tokens that will be computed again
    recompute_s: float     # the estimates the choice was made on
    swap_s: float


@dataclass(frozen=True)
class UrgencyDecision:
    """A blocked request about to miss its TTFT deadline, and whether a lower-class running
    sequence was preempted for it."""

    request_id: str
    victim: str
    intervention_s: float     # the victim's work to redo (recompute or swap, the cheaper)
    lateness_avoided_s: float  # predicted TTFT past the deadline, waiting for a free slot
    preempted: bool
    reason: str               # "cost_below_loss" | "cost_above_loss" | "too_late_anyway"


class Preemptor:
    """Owns the preemption counters, the last step's preemptions and urgency decisions, the
    host tier's free blocks as last reported (less what it swapped out since) and the
    preemption mode. Moves sequences through the queues and gives leases back through the
    lease book."""

    def __init__(self, cfg: SchedulerConfig, queues: Queues, leases: LeaseBook, prices: Prices,
                 max_model_len: int, preemption_mode: str, cpu_blocks: int) -> None:
        self.cfg = cfg
        self.queues = queues
        self.leases = leases
        self.prices = prices
        self.block_size = prices.block_size
        self.max_model_len = max_model_len
        self.preemption_mode = preemption_mode
        self.cpu_free = cpu_blocks              # host-tier blocks free, as last reported
        self.urgency = cfg.urgency_preemption
        self.preemptions = 0
        self.preemptions_by_kind: Counter[str] = Counter()
        self.preemption_reasons: Counter[str] = Counter()
        self.wasted_tokens = 0           # computed tokens thrown away by preemption (recompute)
        self.swapped_blocks = 0          # blocks sent to the host tier by preemption
        self.last_preempted: list[Preemption] = []
        self.last_urgency: list[UrgencyDecision] = []

    def new_step(self) -> None:
        """A step is being planned: what it preempts is listed afresh."""
        self.last_preempted = []

    def preempt_if_stuck(self) -> None:
        """Free memory for sequences that cannot proceed."""
        queues = self.queues
        blocker = self._blocker()
        if blocker is not None and blocker.state in (State.REFUSED, State.SWAP_REFUSED):
            for seq in [s for s in queues.waiting if s.state is State.READY]:
                self._give_back(seq)
        for seq in [s for s in queues.running if s.state is State.STALLED]:
            if seq.state is not State.STALLED:       # preempted as a victim meanwhile
                continue
            if seq.capacity(self.block_size) > seq.planned:
                seq.to(Event.RETRY)                  # can still make progress; ask again later
                continue
            own = seq.refusal == TENANT_BUDGET       # its tenant is at its KV budget
            ready = [s for s in queues.waiting if s.state is State.READY
                     and (not own or s.tenant == seq.tenant)]
            if ready:
                self._give_back(max(ready, key=lambda s: (s.arrival_ns, s.seq_id)))
            elif own:
                self.preempt(max((s for s in queues.running if s.tenant == seq.tenant),
                                 key=lambda s: (s.priority, s.arrival_ns, s.seq_id)),
                             TENANT_BUDGET)
            else:
                self.preempt(max(queues.running, key=self.victim_key()))
            if seq.state is State.STALLED:
                seq.to(Event.RETRY)

    def _blocker(self) -> Seq | None:
        """The waiting sequence that holds up the queue (head of line), skipping those that
        hold up only their own tenant (its KV budget, its running cap, a full pool it holds
        more than its share of), as planning does; None if the first it reaches can start."""
        queues = self.queues
        claimed = queues.running_slots()
        leased = queues.leased_slots(claimed)
        over: list[set[str]] = []
        for seq in queues.waiting:
            if queues.tenants.at_running_cap(seq, claimed):
                continue
            if seq.state is State.READY:
                return None
            if not queues.holds_up_only_its_tenant(seq, leased, over):
                return seq
        return None

    def victim_key(self) -> Callable[[Seq], tuple[bool, int, bool, int, int]]:
        """Sort key of running sequences; the largest is preempted first. Priority is the
        class's, not aged (the module docstring)."""
        held = self.queues.held_blocks()
        over = self.queues.over_share()
        kv_budget = self.queues.tenants.kv_budget

        def over_budget(tenant: str) -> bool:
            budget = kv_budget.get(tenant)
            if not budget:
                return False
            return held[tenant] > budget

        return lambda s: (over_budget(s.tenant), s.priority, s.tenant in over,
                          s.arrival_ns, s.seq_id)

    def _give_back(self, seq: Seq) -> None:
        """A ready sequence returns its blocks. One resumed from the host tier holds real
        work, so it is preempted like a running victim; a fresh one loses nothing."""
        if seq.num_computed > seq.cached_tokens:
            self.preempt(seq, "returned_unscheduled_blocks")
        else:
            self.recompute(seq, "returned_unscheduled_blocks", count=False)

    # ------------------------------------------------------------------ urgency
    def rescue_urgent(self, now_ns: int) -> None:
        """At most one urgency preemption per step (see the module docstring)."""
        self.last_urgency = []
        queues = self.queues
        if not self.urgency or not now_ns or not queues.running:
            return
        cost = self.prices.cost
        running = len(queues.running)
        decode_s = cost.predict(decode_shape(running,
                                             sum(s.num_tokens for s in queues.running)))
        if decode_s <= 0:
            return                                   # nothing measured yet
        slots_full = running >= self.cfg.max_num_seqs
        for u in queues.waiting:
            if not u.deadline_ns or u.preemptions or u.first_scheduled_ns or u.rescued:
                continue
            blocked = ((u.state is State.REFUSED and u.refusal != TENANT_BUDGET)
                       or (u.state is State.WAITING and slots_full))
            victims = [s for s in queues.running if s.priority > u.priority
                       and s.state in (State.RUNNING, State.STALLED)]
            if not blocked or not victims:
                continue
            prefill_s = cost.predict(prefill_shape(u.remaining, u.num_computed))
            # waiting, it starts when a running sequence ends: at the latest, when the one
            # closest to its max_tokens gets there (EOS may come sooner)
            wait_s = decode_s * max(min(self._tokens_left(s) for s in queues.running), 0)
            late_s = (now_ns - u.deadline_ns) / 1e9 + wait_s + prefill_s
            if late_s <= 0:
                continue                             # it makes its deadline without help
            victim = max(victims, key=lambda s: (s.priority, s.arrival_ns, s.seq_id))
            cost_s = min(self.prices.costs(victim))
            if (now_ns - u.deadline_ns) / 1e9 + prefill_s + decode_s > 0:
                reason = "too_late_anyway"
            elif cost_s < late_s:
                reason = "cost_below_loss"
            else:
                reason = "cost_above_loss"
            act = reason == "cost_below_loss"
            self.last_urgency.append(UrgencyDecision(u.request_id, victim.request_id, cost_s,
                                                     late_s, act, reason))
            if act:
                self.preempt(victim, "urgency")
                u.rescued = True
                queues.to_front(u)
            return

    def _tokens_left(self, seq: Seq) -> int:
        cap = seq.params.max_tokens if seq.params.max_tokens is not None else self.max_model_len
        return min(cap - seq.num_output, self.max_model_len - seq.num_tokens) + seq.remaining - 1

    # ------------------------------------------------------------------ mechanics
    def preempt(self, seq: Seq, reason: str = "kv_growth_denied") -> None:
        recompute_s, swap_s = self.prices.costs(seq)
        blocks = -(-seq.num_computed // self.block_size)
        can_swap = (self.preemption_mode != "recompute" and seq.num_computed > 0
                    and seq.state in (State.RUNNING, State.STALLED, State.READY)
                    and blocks <= self.cpu_free and swap_s < math.inf)
        if can_swap and (self.preemption_mode == "swap" or swap_s < recompute_s):
            self._swap_out(seq, reason, blocks, recompute_s, swap_s)
        else:
            self.recompute(seq, reason, count=True, costs=(recompute_s, swap_s))

    def _record(self, seq: Seq, reason: str, choice: str, wasted: int,
                recompute_s: float, swap_s: float) -> None:
        self.last_preempted.append(Preemption(seq.request_id, seq.index, reason, choice, wasted,
                                              recompute_s, swap_s))
        self.preemptions += 1
        self.preemptions_by_kind[choice] += 1
        self.preemption_reasons[reason] += 1
        self.wasted_tokens += wasted

    def fork_refused(self, seq: Seq) -> None:
        """No block for an n > 1 choice's copy-on-write: compute it from scratch when there
        is room."""
        self.queues.to_head(seq)
        seq.to(Event.REFUSE)
        seq.num_computed = 0
        seq.preemptions += 1
        self._record(seq, "fork_denied", "recompute", 0, 0.0, 0.0)

    def _swap_out(self, seq: Seq, reason: str, blocks: int, recompute_s: float,
                  swap_s: float) -> None:
        """Send a victim's computed blocks to the host tier; it keeps its seq id, progress
        and lease, and waits at the head of the queue to be swapped back in."""
        self._record(seq, reason, "swap", 0, recompute_s, swap_s)
        seq.preemptions += 1
        self.swapped_blocks += blocks
        self.cpu_free -= blocks
        if in_running(seq):
            self.queues.to_head(seq)
        seq.to(Event.SWAP_OUT)
        seq.in_flight.clear()                       # what steps in flight compute is dropped
        # sent now, steps in flight or not; its blocks count as freed when the grant comes
        self.leases.swap_out(seq)
        if seq.known_to_executor:
            self.leases.drop(seq.seq_id)
        seq.block_ids = []
        seq.blocks_sent = 0
        seq.known_to_executor = False

    def recompute(self, seq: Seq, reason: str, count: bool,
                  costs: tuple[float, float] = (0.0, 0.0)) -> None:
        """Return a sequence's blocks (its computed full blocks stay cached) and send it
        back to wait under a fresh seq id; a running victim goes to the head of the queue."""
        if count:
            self._record(seq, reason, "recompute", seq.num_computed, *costs)
            seq.preemptions += 1
        else:
            self.last_preempted.append(Preemption(seq.request_id, seq.index, reason, "recompute",
                                                  0, *costs))
        if in_running(seq):
            self.queues.to_head(seq)
        seq.to(Event.RECOMPUTE)
        seq.in_flight.clear()                       # what steps in flight compute is dropped
        self.leases.free_lease(seq.seq_id, seq.num_computed, seq.tenant)
        if seq.known_to_executor:
            self.leases.drop(seq.seq_id)
        self.queues.renumber(seq)                   # late grants for the old lease get freed
        seq.num_computed = 0
        seq.block_ids = []
        seq.blocks_sent = 0
        seq.known_to_executor = False
