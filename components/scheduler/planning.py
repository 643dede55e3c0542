"""Planning one step: decode tokens first, then chunked prefill of running sequences, then
new work from the waiting queue under the step's token budget.

New work starts in fair order (``fairness = "vtc"``): sequences coming back from
preemption first, then by class (aged priority, ``Seq.aged_priority``), then within a class
by the tenant's virtual token counter, then arrival (``_fair_order``). The queue is
head-of-line: a sequence that is not ready (its lease not granted yet, or refused because
the pool is full) holds back those behind it, so a large request is not starved by small
ones. A tenant at its own KV budget or running cap holds back only itself.

With a step in flight (``scheduler.async_depth`` 2), running sequences are planned from
their planned position (``Seq.planned``, ``Seq.todo``): a sequence whose step in flight
samples may decode once more, its input being the token that step samples (the executor
has it; the plan only counts it), unless ``Seq.may_plan_ahead`` has it sit out."""
from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from components.scheduler.kv_requests import TENANT_BUDGET
from components.scheduler.sequence import Event, InFlight, Seq, State
from schemas.wire import NewSeq, Penalties, SamplingParams, SeqStep, StepPlan

if TYPE_CHECKING:
    from components.scheduler.core import SchedulerCore


_NEVER = 1 << 62                 # the deadline of a request that has none


def penalties_of(p: SamplingParams, eos_token_ids: Iterable[int] = ()) -> Penalties | None:
    """The logit adjustments a request asked for, as the executor takes them; None when
    it asked for none. With ``min_tokens``, the ids that would end a choice (its
    ``eos_token_ids`` unless ``ignore_eos``, and ``stop_token_ids``) are banned until then."""
    if (p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and p.repetition_penalty == 1.0 and not p.logit_bias and p.min_tokens == 0):
        return None
    stop_ids = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                      ) if p.min_tokens else []
    return Penalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                     sorted((p.logit_bias or {}).items()), p.min_tokens, stop_ids)


class Planning:
    def schedule(self: SchedulerCore, now_ns: int = 0, budget: int | None = None) -> StepPlan | None:
        """Plan the next step, or None if nothing can run now. Call only with fewer than
        ``scheduler.async_depth`` steps in flight. ``now_ns`` (wall clock) stamps first
        scheduling, for queue time, and dates deadlines; ``budget`` overrides the step's
        token budget (stall-free chunking, chunking.py)."""
        assert len(self.in_flight) < max(self.cfg.async_depth, 1)    # 0: auto (loop.py)
        self.last_preempted = []
        if self.fair or self.buckets:
            self._fair_order(now_ns)
        self._preempt_if_stuck()
        self._rescue_urgent(now_ns)
        if budget is None:
            budget = self.cfg.max_num_batched_tokens
        bs, max_len = self.block_size, self.max_model_len
        chosen: list[tuple[Seq, int]] = []
        for seq in self.running:                      # decode tokens first
            if (budget and seq.todo == 1 and seq.capacity(bs) >= seq.planned_tokens
                    and seq.may_plan_ahead(max_len)):
                chosen.append((seq, 1))
                budget -= 1
        # chunked prefill of running sequences; under VTC, those that rank after the head of
        # the queue (a less important class, or the same class of a tenant served more) go
        # after its new work (a flood's long prompts in progress do not hold back a lighter
        # tenant's next request, nor batch prompts an interactive one)
        prefilling = [s for s in self.running if s.todo > 1 and s.may_plan_ahead(max_len)]
        later: list[Seq] = []
        if self.fair and self.waiting and prefilling:
            head = self._rank(self.waiting[0], now_ns)
            later = [s for s in prefilling if self._rank(s, now_ns) > head]
            prefilling = [s for s in prefilling if self._rank(s, now_ns) <= head]
        budget = self._prefill_chunks(prefilling, budget, chosen)
        claimed = self.running_slots()
        leased = self._leased_slots(claimed)
        over: list[set[str]] = []
        share = self._step_shares(budget, claimed, now_ns)
        taken: Counter[str] = Counter()               # new-work tokens per tenant this step
        started: list[int] = []                       # new work's places in chosen
        for seq in list(self.waiting):                # new work, in fair order
            if not budget or len(self.running) >= self.cfg.max_num_seqs:
                break
            if self._at_running_cap(seq, claimed):
                continue                              # only its tenant waits
            limit = budget if share is None else share.get(seq.tenant, 0) - taken[seq.tenant]
            if limit <= 0:
                continue                              # its tenant had its share this step
            if seq.state is not State.READY:
                if self._holds_up_only_its_tenant(seq, leased, over):
                    continue
                break                                 # head of line
            if seq is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(seq)
            seq.to(Event.SCHEDULE)
            claimed[seq.tenant] += seq.slots
            # VTC charges a request's input when it starts (what is cached is not computed)
            self.charge(seq.tenant, now_ns, input_tokens=max(seq.prompt_len - seq.num_computed, 0))
            seq.first_scheduled_ns = seq.first_scheduled_ns or now_ns
            self.running.append(seq)
            # a sequence back from the host tier holds only its computed blocks: it runs
            # once growth (asked below, as for any running sequence) is granted
            n = min(seq.remaining, budget, limit, seq.capacity(bs) - seq.num_computed)
            if n > 0:
                started.append(len(chosen))
                chosen.append((seq, n))
                budget -= n
                taken[seq.tenant] += n
        for i in started:                             # what the shares left, in order
            seq, n = chosen[i]
            more = min(seq.remaining - n, budget, seq.capacity(bs) - seq.num_computed - n)
            if more > 0:
                chosen[i] = (seq, n + more)
                budget -= more
        budget = self._prefill_chunks(later, budget, chosen)
        self._request_blocks(chosen)
        if not chosen:
            return None
        plan = self._plan(chosen, now_ns)
        self.in_flight[plan.step_id] = {seq.seq_id: n for seq, n in chosen}
        self.steps += 1
        return plan

    def _leased_slots(self: SchedulerCore, claimed: Counter[str]) -> Counter[str]:
        """``claimed`` (running slots) plus the waiting sequences that hold or are asking a
        lease, per tenant."""
        leased = claimed.copy()
        for seq in self.waiting:
            if seq.state in (State.LEASING, State.READY, State.SWAPPING_IN):
                leased[seq.tenant] += seq.slots
        return leased

    def _holds_up_only_its_tenant(self: SchedulerCore, seq: Seq, leased: Counter[str],
                                  over: list[set[str]]) -> bool:
        """A waiting sequence that is not ready holds up only its own tenant when what keeps
        it is the tenant's: its KV budget, its running cap (counting leases), or a full pool
        it holds more than its weighted share of. ``over`` caches ``over_share()`` (empty
        until first needed)."""
        if ((seq.state is State.REFUSED and seq.refusal == TENANT_BUDGET)
                or self._at_running_cap(seq, leased)):
            return True
        if seq.state in (State.REFUSED, State.SWAP_REFUSED):
            if not over:
                over.append(self.over_share())
            return seq.tenant in over[0]
        return False

    def _rank(self: SchedulerCore, seq: Seq, now_ns: int) -> tuple[int, float]:
        """Where ``seq``'s work stands in the fair order: its class (aged), then its
        tenant's counter."""
        return seq.aged_priority(now_ns), self.vtc.of(seq.tenant)

    def _step_shares(self: SchedulerCore, budget: int, claimed: Counter[str],
                     now_ns: int = 0) -> dict[str, int] | None:
        """Under VTC, tenants with new work ready whose first ready request is of the most
        important class among those (aged, as ``_fair_order`` ranks them) and whose counters
        are within one request of the least served of them (the cost of that tenant's next
        prompt) are tied: each first gets its weighted share of what the step has left for
        new prompts, and what the shares leave then goes to the prompts started, in order.
        Without this, whichever tied tenant sorts first takes the whole step with one long
        prompt, and a tied tenant's short prompt waits a step more for its first token.
        Tenants served more than that, or whose work is of a less important class, wait,
        as the fair order has them. None: nobody is tied (or fcfs)."""
        if not self.fair:
            return None
        heads: dict[str, Seq] = {}
        for s in self.waiting:
            if (s.state is State.READY and s.tenant not in heads
                    and not self._at_running_cap(s, claimed)):
                heads[s.tenant] = s
        if len(heads) < 2:
            return None
        best = min(s.aged_priority(now_ns) for s in heads.values())
        heads = {t: s for t, s in heads.items() if s.aged_priority(now_ns) == best}
        if len(heads) < 2:
            return None
        least = min(heads, key=self.vtc.of)
        window = (max(heads[least].prompt_len - heads[least].num_computed, 0) * self.vtc.w_in / 2
                  / self.vtc.weight(least))
        tied = [t for t in heads if self.vtc.of(t) <= self.vtc.of(least) + window]
        if len(tied) < 2:
            return None
        total = sum(self.vtc.weight(t) for t in tied)
        return {t: max(int(budget * self.vtc.weight(t) / total), 1) for t in tied}

    def _prefill_chunks(self: SchedulerCore, seqs: list[Seq], budget: int,
                        chosen: list[tuple[Seq, int]]) -> int:
        for seq in seqs:
            if budget and seq.todo > 1:
                n = min(seq.todo, budget, seq.capacity(self.block_size) - seq.planned)
                if n > 0:
                    chosen.append((seq, n))
                    budget -= n
        return budget

    def _fair_order(self: SchedulerCore, now_ns: int) -> None:
        """Put the waiting queue in the order its work will start, so that leases are asked
        in that order too: sequences rescued by urgency, then those back from preemption
        (they hold work, and ran before; among them the more important class first), then
        fresh ones.

        Fresh work is picked one request at a time. Under VTC the pick is the head of the
        tenant that ranks first by: its head's class (``Seq.aged_priority`` at ``now_ns``:
        the class's priority less the whole units its ``aging_per_s`` has earned since
        arrival), then within that class a tenant within its token rate before one past
        it, then the least served (its virtual counter), then arrival. So an interactive
        request of a heavily served tenant starts before a barely served tenant's batch
        work, VTC orders tenants within a class, and batch work that has waited long enough
        ranks with, then ahead of, new interactive work: it cannot starve. Under ``fairness
        = "fcfs"`` (ordered here only when tenants have token rates) classes do not cross
        tenants: within token rate first, then arrival. Within a tenant: aged class, then
        the earlier deadline, then arrival.

        Each pick charges its tenant its prompt, as starting it will, so one tenant does not
        take a whole step of new prompts because it was least served when the step began,
        and a tenant arriving with the lowest counter is asked for first. The order is made
        afresh at every plan (one sort per tenant, a heap over tenants), so aging moves a
        request as soon as the next step; nothing from the last order is kept."""
        if len(self.waiting) < 2:
            return
        head, fresh = [], {}
        for seq in self.waiting:
            if seq.resumes:
                head.append(seq)
            else:
                fresh.setdefault(seq.tenant, deque()).append(seq)
        head.sort(key=lambda s: (not s.rescued, s.aged_priority(now_ns)))  # stable
        for tenant, queue in fresh.items():    # within a tenant: class, deadline, arrival
            if len(queue) > 1:
                fresh[tenant] = deque(sorted(queue, key=lambda s: (
                    s.aged_priority(now_ns), s.deadline_ns or _NEVER, s.arrival_ns, s.seq_id)))
        now_s = now_ns / 1e9

        def pick(tenant: str, seq: Seq, over: bool, counter: float) -> tuple:
            level = seq.aged_priority(now_ns) if self.fair else 0
            return level, over, counter, seq.arrival_ns, seq.seq_id, tenant

        picks = []
        for tenant, queue in fresh.items():
            counter = self.vtc.of(tenant) if self.fair else 0.0
            picks.append(pick(tenant, queue[0], self.over_rate(tenant, now_s), counter))
        heapq.heapify(picks)
        order = head
        while picks:
            _, over, counter, _, _, tenant = heapq.heappop(picks)
            queue = fresh[tenant]
            seq = queue.popleft()
            order.append(seq)
            if queue:
                if self.fair:
                    counter += (max(seq.prompt_len - seq.num_computed, 0) * self.vtc.w_in
                                / self.vtc.weight(tenant))
                heapq.heappush(picks, pick(tenant, queue[0], over, counter))
        self.waiting = deque(order)

    def _plan(self: SchedulerCore, chosen: list[tuple[Seq, int]], now_ns: int) -> StepPlan:
        step_id = next(self._step_ids)
        new_seqs, steps = [], []
        for seq, n in chosen:
            sample = seq.planned + n == seq.planned_tokens
            samples = seq.n if sample and seq.n > 1 and not seq.forked else 1
            seq.in_flight.append(InFlight(step_id, n, int(sample)))   # after ``sample``
            if not seq.known_to_executor:
                assert len(seq.in_flight) == 1, "a sequence new to the executor is in no step"
                p = seq.params
                seed = None if p.seed is None else p.seed + seq.index
                new_seqs.append(NewSeq(seq.seq_id, list(seq.token_ids), seq.prompt_len,
                                       seq.num_computed, list(seq.block_ids), p.temperature,
                                       p.top_p, p.top_k, seed,
                                       penalties_of(p, seq.eos_token_ids), p.logprobs,
                                       p.prompt_logprobs if seq.owes_prompt_logprobs
                                       else None, p.structured))
                seq.known_to_executor = True
                steps.append(SeqStep(seq.seq_id, n, [], sample, samples))
            else:
                steps.append(SeqStep(seq.seq_id, n, seq.block_ids[seq.blocks_sent:], sample,
                                     samples))
            seq.blocks_sent = len(seq.block_ids)
        drop, self._drop = self._drop, []
        copies, self._copies = self._copies, []
        return StepPlan(step_id, new_seqs, steps, drop, copies)
