"""Planning one step: decode tokens first, then chunked prefill of running sequences, then
new work from the waiting queue under the step's token budget.

New work starts in the queues' fair order (queues.py). The queue is head-of-line: a
sequence that is not ready (its lease not granted yet, or refused because the pool is
full) holds back those behind it, so a large request is not starved by small ones. A
tenant at its own KV budget or running cap holds back only itself.

With a step in flight (``scheduler.async_depth`` 2), running sequences are planned from
their planned position (``Seq.planned``, ``Seq.todo``): a sequence whose step in flight
samples may decode once more, its input being the token that step samples (the executor
has it; the plan only counts it), unless ``Seq.may_plan_ahead`` has it sit out.

The planner owns the steps in flight (``in_flight``: step id, oldest first, to the tokens it
computes per seq id), the step ids and the count of steps planned. Before each plan it has
the preemptor free memory for stuck sequences and rescue an urgent request; after it, the
lease book asks growth and first leases for what it chose."""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable

from components.costs.cost_model import StepCostModel, joined, prefill_shape
from components.scheduler.determinism import chunk_tokens
from components.scheduler.kv_requests import LeaseBook
from components.scheduler.preemption import Preemptor
from components.scheduler.queues import Queues
from components.scheduler.sequence import Event, InFlight, Seq, State
from components.scheduler.speculation import Choice, Speculation
from schemas.config import SchedulerConfig, deterministic_chunk
from schemas.wire import NewSeq, Penalties, SamplingParams, SeqStep, StepPlan


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


class Planner:
    def __init__(self, cfg: SchedulerConfig, queues: Queues, leases: LeaseBook,
                 preemptor: Preemptor, block_size: int, max_model_len: int,
                 spec: Speculation | None = None, cost: StepCostModel | None = None) -> None:
        self.cfg = cfg
        self.spec = spec
        self.cost = cost if cost is not None else StepCostModel()
        self.last_spec: Choice | None = None      # the last step's speculation decision
        self.queues = queues
        self.tenants = queues.tenants
        self.leases = leases
        self.preemptor = preemptor
        self.block_size = block_size
        self.det_chunk = deterministic_chunk(cfg, block_size)   # determinism.py
        self.max_model_len = max_model_len
        self._step_ids = itertools.count(1)
        # the steps sent to the executor and not answered, oldest first:
        # step_id -> {seq_id: tokens computed for it}
        self.in_flight: dict[int, dict[int, int]] = {}
        self.steps = 0

    def answered(self, step_id: int) -> dict[int, int] | None:
        """The oldest step in flight answered: what it computes per seq id. None for any
        other step id (one from before a reset; results come in step order)."""
        if not self.in_flight or step_id != next(iter(self.in_flight)):
            return None
        return self.in_flight.pop(step_id)

    def schedule(self, now_ns: int = 0, budget: int | None = None) -> StepPlan | None:
        """Plan the next step, or None if nothing can run now. Call only with fewer than
        ``scheduler.async_depth`` steps in flight. ``now_ns`` (wall clock) stamps first
        scheduling, for queue time, and dates deadlines; ``budget`` overrides the step's
        token budget (stall-free chunking, chunking.py)."""
        assert len(self.in_flight) < max(self.cfg.async_depth, 1)    # 0: auto (loop.py)
        self.last_spec = None
        queues, tenants = self.queues, self.tenants
        self.preemptor.new_step()
        if tenants.fair or tenants.buckets:
            queues.fair_order(now_ns)
        self.preemptor.preempt_if_stuck()
        self.preemptor.rescue_urgent(now_ns)
        if budget is None:
            budget = self.cfg.max_num_batched_tokens
        bs, max_len = self.block_size, self.max_model_len
        chosen: list[tuple[Seq, int]] = []
        for seq in queues.running:                    # decode tokens first
            if (budget and seq.todo == 1 and seq.capacity(bs) >= seq.planned_tokens
                    and seq.may_plan_ahead(max_len)):
                chosen.append((seq, 1))
                budget -= 1
        # chunked prefill of running sequences; under VTC, those that rank after the head of
        # the queue (a less important class, or the same class of a tenant served more) go
        # after its new work (a flood's long prompts in progress do not hold back a lighter
        # tenant's next request, nor batch prompts an interactive one)
        prefilling = [s for s in queues.running if s.todo > 1 and s.may_plan_ahead(max_len)]
        later: list[Seq] = []
        if tenants.fair and queues.waiting and prefilling:
            head = self._rank(queues.waiting[0], now_ns)
            later = [s for s in prefilling if self._rank(s, now_ns) > head]
            prefilling = [s for s in prefilling if self._rank(s, now_ns) <= head]
        budget = self._prefill_chunks(prefilling, budget, chosen)
        claimed = queues.running_slots()
        leased = queues.leased_slots(claimed)
        over: list[set[str]] = []
        share = self._step_shares(budget, claimed, now_ns)
        taken: Counter[str] = Counter()               # new-work tokens per tenant this step
        started: list[int] = []                       # new work's places in chosen
        for seq in list(queues.waiting):              # new work, in fair order
            if not budget or len(queues.running) >= self.cfg.max_num_seqs:
                break
            if tenants.at_running_cap(seq, claimed):
                continue                              # only its tenant waits
            limit = budget if share is None else share.get(seq.tenant, 0) - taken[seq.tenant]
            if limit <= 0:
                continue                              # its tenant had its share this step
            if seq.state is not State.READY:
                if queues.holds_up_only_its_tenant(seq, leased, over):
                    continue
                break                                 # head of line
            queues.start(seq)
            seq.to(Event.SCHEDULE)
            claimed[seq.tenant] += seq.slots
            # VTC charges a request's input when it starts (what is cached is not computed)
            tenants.charge(seq.tenant, now_ns,
                           input_tokens=max(seq.prompt_len - seq.num_computed, 0))
            seq.first_scheduled_ns = seq.first_scheduled_ns or now_ns
            # a sequence back from the host tier holds only its computed blocks: it runs
            # once growth (asked below, as for any running sequence) is granted
            n = min(seq.remaining, budget, limit, seq.capacity(bs) - seq.num_computed)
            if seq.deterministic:                     # its chunk whole, or not yet
                whole = chunk_tokens(seq.num_computed, seq.remaining, self.det_chunk)
                room = seq.capacity(bs) - seq.num_computed
                n = whole if whole <= room and self._det_fits(
                    whole, min(budget, limit), chosen) else 0
            if n > 0:
                started.append(len(chosen))
                chosen.append((seq, n))
                budget = max(budget - n, 0)
                taken[seq.tenant] += n
        for i in started:                             # what the shares left, in order
            seq, n = chosen[i]
            if seq.deterministic:
                continue                              # its chunk is fixed
            more = min(seq.remaining - n, budget, seq.capacity(bs) - seq.num_computed - n)
            if more > 0:
                chosen[i] = (seq, n + more)
                budget -= more
        budget = self._prefill_chunks(later, budget, chosen)
        drafts = self._drafts(chosen, budget)
        self.leases.request_blocks(chosen, drafts)
        if not chosen:
            return None
        plan = self._plan(chosen, now_ns, drafts)
        self.in_flight[plan.step_id] = {seq.seq_id: n for seq, n in chosen}
        self.steps += 1
        return plan

    def _rank(self, seq: Seq, now_ns: int) -> tuple[int, float]:
        """Where ``seq``'s work stands in the fair order: its class (aged), then its
        tenant's counter."""
        return seq.aged_priority(now_ns), self.tenants.vtc.of(seq.tenant)

    def _step_shares(self, budget: int, claimed: Counter[str],
                     now_ns: int = 0) -> dict[str, int] | None:
        """Under VTC, tenants with new work ready whose first ready request is of the most
        important class among those (aged, as ``Queues.fair_order`` ranks them) and whose
        counters are within one request of the least served of them (the cost of that
        tenant's next prompt) are tied: each first gets its weighted share of what the step
        has left for new prompts, and what the shares leave then goes to the prompts
        started, in order. Without this, whichever tied tenant sorts first takes the whole
        step with one long prompt, and a tied tenant's short prompt waits a step more for
        its first token. Tenants served more than that, or whose work is of a less important
        class, wait, as the fair order has them. None: nobody is tied (or fcfs)."""
        if not self.tenants.fair:
            return None
        vtc = self.tenants.vtc
        heads: dict[str, Seq] = {}
        for s in self.queues.waiting:
            if (s.state is State.READY and s.tenant not in heads
                    and not self.tenants.at_running_cap(s, claimed)):
                heads[s.tenant] = s
        if len(heads) < 2:
            return None
        best = min(s.aged_priority(now_ns) for s in heads.values())
        heads = {t: s for t, s in heads.items() if s.aged_priority(now_ns) == best}
        if len(heads) < 2:
            return None
        least = min(heads, key=vtc.of)
        window = (max(heads[least].prompt_len - heads[least].num_computed, 0) * vtc.w_in / 2
                  / vtc.weight(least))
        tied = [t for t in heads if vtc.of(t) <= vtc.of(least) + window]
        if len(tied) < 2:
            return None
        total = sum(vtc.weight(t) for t in tied)
        return {t: max(int(budget * vtc.weight(t) / total), 1) for t in tied}

    def _prefill_chunks(self, seqs: list[Seq], budget: int,
                        chosen: list[tuple[Seq, int]]) -> int:
        """Each prefilling sequence's next chunk, from what the budget leaves. A
        deterministic one's chunk is fixed (determinism.py): planned whole or not at all.
        One that does not fit what is left is still planned whole when it would be the
        step's first prefill chunk and fits ``max_num_batched_tokens``: the stall-free cap
        (chunking.py) is exceeded for that step rather than the prompt left waiting on a
        budget its chunk never fits."""
        for seq in seqs:
            if seq.todo <= 1:
                continue
            room = seq.capacity(self.block_size) - seq.planned
            if seq.deterministic:
                n = chunk_tokens(seq.planned, seq.todo, self.det_chunk)
                if n <= room and self._det_fits(n, budget, chosen):
                    chosen.append((seq, n))
                    budget = max(budget - n, 0)
                continue
            if budget:
                n = min(seq.todo, budget, room)
                if n > 0:
                    chosen.append((seq, n))
                    budget -= n
        return budget

    def _det_fits(self, n: int, budget: int, chosen: list[tuple[Seq, int]]) -> bool:
        """May a deterministic chunk of ``n`` tokens join the step, ``budget`` left?
        Within it, or as the step's first prefill chunk within ``max_num_batched_tokens``
        (``_prefill_chunks``)."""
        if n <= budget:
            return True
        first = all(c <= 1 for _, c in chosen)
        return first and n <= self.cfg.max_num_batched_tokens - sum(c for _, c in chosen)

    def _drafts(self, chosen: list[tuple[Seq, int]], budget: int) -> dict[int, int]:
        """Speculation's k for this step's decode rows (speculation.py), from the budget
        the decodes and prefill chunks left: rows in no step in flight, past their fork,
        with blocks for the drafts and output left for them (``max_tokens``, the model's
        length)."""
        spec = self.spec
        if spec is None or not spec.on:
            return {}
        bs, max_len = self.block_size, self.max_model_len
        rows = []
        for seq, n in chosen:
            # a deterministic row never drafts: its output is what decoding alone gives,
            # bit for bit, and a verify is a step of another shape
            if (n == 1 and not seq.in_flight and seq.todo == 1 and not seq.deterministic
                    and (seq.n == 1 or seq.forked)):
                # its blocks hold the verify's positions (the decode's and k drafts'), and
                # its 1 + k tokens stay within the model's length
                room = min(seq.capacity(bs), max_len - 1) - seq.planned_tokens
                cap = seq.params.max_tokens
                if cap is not None:
                    room = min(room, cap - seq.num_output - 1)
                if room > 0:
                    rows.append((seq, seq.planned, room))
        if not rows:
            return {}
        tightest = min((s.tpot_slo_s for s, _, _ in rows if s.tpot_slo_s), default=None)
        shape = joined(*(prefill_shape(n, seq.planned) for seq, n in chosen))
        self.last_spec = spec.choose(rows, shape, self.cost, budget, tightest)
        return self.last_spec.k

    def _plan(self, chosen: list[tuple[Seq, int]], now_ns: int,
              drafts: dict[int, int] | None = None) -> StepPlan:
        step_id = next(self._step_ids)
        new_seqs, steps = [], []
        drafts = drafts or {}
        for seq, n in chosen:
            sample = seq.planned + n == seq.planned_tokens
            samples = seq.n if sample and seq.n > 1 and not seq.forked else 1
            k = drafts.get(seq.seq_id, 0)
            seq.in_flight.append(InFlight(step_id, n, int(sample), k))   # after ``sample``
            if not seq.known_to_executor:
                assert len(seq.in_flight) == 1, "a sequence new to the executor is in no step"
                p = seq.params
                seed = None if p.seed is None else p.seed + seq.index
                new_seqs.append(NewSeq(seq.seq_id, list(seq.token_ids), seq.prompt_len,
                                       seq.num_computed, list(seq.block_ids), p.temperature,
                                       p.top_p, p.top_k, seed,
                                       penalties_of(p, seq.eos_token_ids), p.logprobs,
                                       p.prompt_logprobs if seq.owes_prompt_logprobs
                                       else None, p.structured, p.output_offset,
                                       deterministic=p.deterministic))
                seq.known_to_executor = True
                steps.append(SeqStep(seq.seq_id, n, [], sample, samples, k))
            else:
                steps.append(SeqStep(seq.seq_id, n, seq.block_ids[seq.blocks_sent:], sample,
                                     samples, k))
            seq.blocks_sent = len(seq.block_ids)
        drop, copies = self.leases.take_plan_notes()
        return StepPlan(step_id, new_seqs, steps, drop, copies,
                        deterministic=any(seq.deterministic for seq, _ in chosen))
