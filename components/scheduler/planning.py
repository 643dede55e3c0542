"""Planning one step: decode tokens first, then chunked prefill of running sequences, then
new work from the waiting queue under the step's token budget.

New work starts in fair order (``fairness = "vtc"``): sequences coming back from
preemption first, then by the tenant's virtual token counter, then arrival. The queue is
head-of-line: a sequence that is not ready (its lease not granted yet, or refused because
the pool is full) holds back those behind it, so a large request is not starved by small
ones. A tenant at its own KV budget or running cap holds back only itself."""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from components.scheduler.kv_requests import TENANT_BUDGET
from components.scheduler.sequence import ON_HOST, Event, Seq, State
from schemas.wire import NewSeq, SeqStep, StepPlan

if TYPE_CHECKING:
    from components.scheduler.core import SchedulerCore


class Planning:
    def schedule(self: SchedulerCore, now_ns: int = 0, budget: int | None = None) -> StepPlan | None:
        """Plan the next step, or None if nothing can run now. Call only when no step
        is in flight. ``now_ns`` (wall clock) stamps first scheduling, for queue time, and
        dates deadlines; ``budget`` overrides the step's token budget (stall-free chunking,
        chunking.py)."""
        assert self.in_flight is None
        self.last_preempted = []
        if self.fair or self.buckets:
            self._fair_order(now_ns)
        self._preempt_if_stuck()
        self._rescue_urgent(now_ns)
        if budget is None:
            budget = self.cfg.max_num_batched_tokens
        bs = self.block_size
        chosen: list[tuple[Seq, int]] = []
        for seq in self.running:                      # decode tokens first
            if budget and seq.remaining == 1 and seq.capacity(bs) >= seq.num_tokens:
                chosen.append((seq, 1))
                budget -= 1
        for seq in self.running:                      # chunked prefill of running sequences
            if budget and seq.remaining > 1:
                n = min(seq.remaining, budget, seq.capacity(bs) - seq.num_computed)
                if n > 0:
                    chosen.append((seq, n))
                    budget -= n
        claimed = self.running_slots()
        for seq in list(self.waiting):                # new work, in queue order
            if not budget or len(self.running) >= self.cfg.max_num_seqs:
                break
            if self._at_running_cap(seq, claimed):
                continue                              # only its tenant waits
            if seq.state is not State.READY:
                if seq.state is State.REFUSED and seq.refusal == TENANT_BUDGET:
                    continue                          # only its tenant waits
                break                                 # head of line
            if seq is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(seq)
            seq.to(Event.SCHEDULE)
            claimed[seq.tenant] += seq.slots
            seq.first_scheduled_ns = seq.first_scheduled_ns or now_ns
            self.running.append(seq)
            # a sequence back from the host tier holds only its computed blocks: it runs
            # once growth (asked below, as for any running sequence) is granted
            n = min(seq.remaining, budget, seq.capacity(bs) - seq.num_computed)
            if n > 0:
                chosen.append((seq, n))
                budget -= n
        self._request_blocks(chosen)
        if not chosen:
            return None
        self.in_flight = {seq.seq_id: n for seq, n in chosen}
        plan = self._plan(chosen, now_ns)
        self.in_flight_step = plan.step_id
        self.steps += 1
        return plan

    def _fair_order(self: SchedulerCore, now_ns: int) -> None:
        """Waiting work in fair order: sequences rescued by urgency, then those back from
        preemption (they hold work, and ran before), then fresh ones: tenants within their
        token rate before those past it, then by their tenant's virtual counter (the least
        served first; ``fairness = "fcfs"``: arrival), arrival order within a tenant."""
        if len(self.waiting) < 2:
            return
        rescued = [s for s in self.waiting if s.rescued]
        back = [s for s in self.waiting if not s.rescued and (s.preemptions or s.state in ON_HOST)]
        fresh = [s for s in self.waiting
                 if not (s.rescued or s.preemptions or s.state in ON_HOST)]
        now_s = now_ns / 1e9
        over = {t: self.over_rate(t, now_s) for t in {s.tenant for s in fresh}}
        fresh.sort(key=lambda s: (over[s.tenant], self.vtc.of(s.tenant) if self.fair else 0.0,
                                  s.arrival_ns, s.seq_id))
        self.waiting = deque(rescued + back + fresh)

    def _plan(self: SchedulerCore, chosen: list[tuple[Seq, int]], now_ns: int) -> StepPlan:
        new_seqs, steps = [], []
        for seq, n in chosen:
            self.charge(seq.tenant, now_ns,
                        input_tokens=max(min(n, seq.prompt_len - seq.num_computed), 0))
            sample = seq.num_computed + n == seq.num_tokens
            samples = seq.n if sample and seq.n > 1 and not seq.forked else 1
            if not seq.known_to_executor:
                p = seq.params
                seed = None if p.seed is None else p.seed + seq.index
                new_seqs.append(NewSeq(seq.seq_id, list(seq.token_ids), seq.prompt_len,
                                       seq.num_computed, list(seq.block_ids), p.temperature,
                                       p.top_p, p.top_k, seed))
                seq.known_to_executor = True
                steps.append(SeqStep(seq.seq_id, n, [], sample, samples))
            else:
                steps.append(SeqStep(seq.seq_id, n, seq.block_ids[seq.blocks_sent:], sample,
                                     samples))
            seq.blocks_sent = len(seq.block_ids)
        drop, self._drop = self._drop, []
        copies, self._copies = self._copies, []
        return StepPlan(next(self._step_ids), new_seqs, steps, drop, copies)
