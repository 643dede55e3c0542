"""The scheduler's pure core: continuous batching under a uniform token budget.

NOTE: there is no prefill phase and no decode phase. Every step, each running
sequence advances ``num_computed`` toward ``num_tokens``. Decode tokens (one per
sequence that has caught up) are reserved first; prefill chunks fill what
remains of ``max_num_batched_tokens``, so a long prompt is prefilled over
several steps while others keep decoding.

KV blocks come from the kv_manager asynchronously. The core never waits: it
emits batched ``AllocRequest``/``FreeRequest`` ops, asks for growth
``lookahead_tokens`` ahead, and a sequence whose grant has not arrived simply
sits out a step. If growth is denied, the latest arrival is preempted
(recompute) and no new prefill is admitted while it waits.

Synchronous and torch-free; the service feeds it messages and sends what it returns.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from components.scheduler.sequence import Phase, Seq
from schemas.config import KvConfig, SchedulerConfig
from schemas.wire import (Admitted, AllocRequest, DetokParams, FreeRequest, KvGrant, KvOps,
                          NewSeq, RequestTiming, SeqStep, StepPlan, StepResult, TokenOut, Usage)


@dataclass
class Outcome:
    """What one input produced: detokenizer output, released requests, forgotten requests."""

    tokens: list[TokenOut] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)


class SchedulerCore:
    def __init__(self, cfg: SchedulerConfig, kv: KvConfig, max_model_len: int,
                 epoch: int = 1) -> None:
        self.cfg = cfg
        self.block_size = kv.block_size
        self.grow_blocks = kv.grow_blocks
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
        self.in_flight: dict[int, int] | None = None   # seq_id -> tokens, for the step in flight
        self.in_flight_step = 0                         # step_id of the plan in flight
        self._frees_emitted = 0    # FreeRequests so far; a denied lease retries after more
        self.preemptions = 0
        self.wasted_tokens = 0           # computed tokens thrown away by preemption (recompute)
        self.last_preempted: list[tuple[str, str, int]] = []   # (request, reason, wasted tokens)
        self.steps = 0

    # ------------------------------------------------------------------ inputs
    def add(self, req: Admitted) -> Seq:
        seq = Seq(next(self._ids), req.request_id, req.tenant, req.params,
                  len(req.prompt_token_ids), list(req.prompt_token_ids), list(req.block_hashes),
                  req.arrival_ns, frozenset(req.eos_token_ids))
        self.by_request[seq.request_id] = seq
        self.by_seq[seq.seq_id] = seq
        self.waiting.append(seq)
        return seq

    def cancel(self, request_id: str) -> Outcome:
        """Cancel (or stop) a request wherever it is; its blocks go back at once."""
        seq = self.by_request.get(request_id)
        out = Outcome()
        if seq is None:
            return out
        if seq.outputs_sent:
            out.forget.append(request_id)
        self._finish(seq, out)
        return out

    def on_grants(self, grants: list[KvGrant]) -> None:
        for g in grants:
            if g.epoch != self.epoch:
                continue
            seq = self.by_seq.get(g.seq_id)
            if seq is None or seq.phase is Phase.DONE:
                if g.ok:
                    self._frees.append(FreeRequest(g.seq_id, 0))
                    self._frees_emitted += 1
                self.by_seq.pop(g.seq_id, None)
                continue
            seq.pending_blocks = 0
            if not g.ok:
                if seq.block_ids:
                    seq.grow_denied = True
                else:
                    seq.alloc_denied = True
                continue
            if not seq.block_ids:
                seq.num_computed = g.num_cached_tokens
                seq.cached_tokens = g.num_cached_tokens
                seq.phase = Phase.READY
            seq.block_ids.extend(g.block_ids)
            seq.grow_denied = False

    def reset(self, kv_lost: bool) -> Outcome:
        """A peer lost its state (executor or kv_manager restarted): drop every sequence.
        Their blocks are freed unless the pool itself was lost. Starts a new epoch."""
        out = Outcome()
        for seq in list(self.by_request.values()):
            out.forget.append(seq.request_id)
            if kv_lost:
                seq.block_ids = []
            seq.num_computed = 0          # the executor's KV is gone (or void): cache nothing
            seq.known_to_executor = False
            self._finish(seq, out)
        if kv_lost:
            self._frees.clear()
            self._allocs.clear()
            self.epoch += 1
        self._drop.clear()
        self.by_seq.clear()
        self.in_flight = None
        return out

    # ------------------------------------------------------------------ planning
    def schedule(self, now_ns: int = 0) -> StepPlan | None:
        """Plan the next step, or None if nothing can run now. Call only when no step
        is in flight. ``now_ns`` (wall clock) stamps first scheduling, for queue time."""
        assert self.in_flight is None
        self.last_preempted = []
        self._preempt_if_stuck()
        budget = self.cfg.max_num_batched_tokens
        chosen: list[tuple[Seq, int]] = []
        for seq in self.running:                      # decode tokens first
            if budget and seq.remaining == 1 and seq.capacity(self.block_size) >= seq.num_tokens:
                chosen.append((seq, 1))
                budget -= 1
        for seq in self.running:                      # chunked prefill of running sequences
            if budget and seq.remaining > 1:
                n = min(seq.remaining, budget, seq.capacity(self.block_size) - seq.num_computed)
                if n > 0:
                    chosen.append((seq, n))
                    budget -= n
        preempted_waiting = any(s.preemptions and s.phase is not Phase.READY for s in self.waiting)
        while budget and self.waiting and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq.phase is not Phase.READY or (preempted_waiting and not seq.preemptions):
                break
            self.waiting.popleft()
            seq.phase = Phase.RUNNING
            seq.first_scheduled_ns = seq.first_scheduled_ns or now_ns
            self.running.append(seq)
            n = min(seq.remaining, budget)
            chosen.append((seq, n))
            budget -= n
        self._request_blocks(chosen)
        if not chosen:
            return None
        plan = self._plan(chosen)
        self.in_flight = {s.seq_id: n for s, n in chosen}
        self.in_flight_step = plan.step_id
        self.steps += 1
        return plan

    def _plan(self, chosen: list[tuple[Seq, int]]) -> StepPlan:
        new_seqs, steps = [], []
        for seq, n in chosen:
            sample = seq.num_computed + n == seq.num_tokens
            if not seq.known_to_executor:
                p = seq.params
                new_seqs.append(NewSeq(seq.seq_id, list(seq.token_ids), seq.prompt_len,
                                       seq.num_computed, list(seq.block_ids), p.temperature,
                                       p.top_p, p.top_k, p.seed))
                seq.known_to_executor = True
                steps.append(SeqStep(seq.seq_id, n, [], sample))
            else:
                steps.append(SeqStep(seq.seq_id, n, seq.block_ids[seq.blocks_sent:], sample))
            seq.blocks_sent = len(seq.block_ids)
        drop, self._drop = self._drop, []
        return StepPlan(next(self._step_ids), new_seqs, steps, drop)

    def _request_blocks(self, chosen: list[tuple[Seq, int]]) -> None:
        bs = self.block_size
        planned = {s.seq_id: n for s, n in chosen}
        for seq in self.running:                      # growth, asked ahead and in batches
            if seq.pending_blocks or seq.grow_denied:
                continue
            after = seq.num_computed + planned.get(seq.seq_id, 0)
            want = min(max(seq.num_tokens, after) + self.cfg.lookahead_tokens, self.max_model_len + 1)
            short = -(-want // bs) - len(seq.block_ids)
            if short > 0:
                n = max(short, self.grow_blocks)
                seq.pending_blocks = n
                self._allocs.append(AllocRequest(seq.seq_id, n))
        slots = self.cfg.max_num_seqs - len(self.running)
        for seq in self.waiting:                      # first leases, in arrival order
            if slots <= 0:
                break
            slots -= 1
            if seq.phase is Phase.READY or seq.pending_blocks:
                continue
            if seq.alloc_denied and seq.frees_at_request == self._frees_emitted:
                break                                 # nothing freed since the pool said no
            seq.alloc_denied = False
            n = -(-(seq.num_tokens + 1) // bs)
            seq.pending_blocks = n
            seq.frees_at_request = self._frees_emitted
            max_cached = (seq.num_tokens - 1) // bs
            self._allocs.append(AllocRequest(seq.seq_id, n, seq.tenant, seq.block_hashes,
                                             seq.token_ids[:len(seq.block_hashes) * bs], max_cached))

    def _preempt_if_stuck(self) -> None:
        """Free memory for sequences that cannot proceed. Ready-but-unscheduled sequences
        give their blocks back first; then the latest running arrival is preempted
        (recompute). A stuck sequence may be its own victim."""
        head = self.waiting[0] if self.waiting else None
        if head is not None and head.alloc_denied:
            for seq in [s for s in self.waiting if s.phase is Phase.READY]:
                self._preempt(seq, count=False)
        for seq in [s for s in self.running if s.grow_denied]:
            if seq.phase is not Phase.RUNNING:
                continue
            if seq.capacity(self.block_size) > seq.num_computed:
                seq.grow_denied = False          # can still make progress; ask again later
                continue
            ready = [s for s in self.waiting if s.phase is Phase.READY]
            victim = max(ready or self.running, key=lambda s: (s.arrival_ns, s.seq_id))
            self._preempt(victim, count=not ready)
            seq.grow_denied = False

    def _preempt(self, seq: Seq, count: bool = True) -> None:
        """Return a sequence's blocks (its computed full blocks stay cached) and send it
        back to wait under a fresh seq id; a running victim goes to the head of the queue."""
        self.last_preempted.append((seq.request_id, "kv_growth_denied" if count
                                    else "returned_unscheduled_blocks",
                                    seq.num_computed if count else 0))
        if count:
            self.preemptions += 1
            self.wasted_tokens += seq.num_computed
            seq.preemptions += 1
        if seq.phase is Phase.RUNNING:
            self.running.remove(seq)
            self.waiting.appendleft(seq)
        self._frees.append(FreeRequest(seq.seq_id, seq.num_computed))
        self._frees_emitted += 1
        if seq.known_to_executor:
            self._drop.append(seq.seq_id)
        del self.by_seq[seq.seq_id]                 # late grants for the old lease get freed
        seq.seq_id = next(self._ids)
        self.by_seq[seq.seq_id] = seq
        seq.phase = Phase.WAITING
        seq.num_computed = 0
        seq.block_ids = []
        seq.blocks_sent = 0
        seq.pending_blocks = 0
        seq.grow_denied = seq.alloc_denied = False
        seq.known_to_executor = False

    # ------------------------------------------------------------------ results
    def on_result(self, result: StepResult, now_ns: int = 0) -> Outcome:
        out = Outcome()
        if self.in_flight is None or result.step_id != self.in_flight_step:
            return out                                # a step planned before a reset
        in_flight, self.in_flight = self.in_flight, None
        for seq_id, n in in_flight.items():
            seq = self.by_seq.get(seq_id)
            if seq is not None and seq.phase is Phase.RUNNING:
                seq.num_computed += n
        for seq_id, token in zip(result.seq_ids, result.token_ids):
            seq = self.by_seq.get(seq_id)
            if seq is None or seq.phase is not Phase.RUNNING:
                continue
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            first = seq.outputs_sent == 0
            if first:
                seq.first_token_ns = now_ns
            seq.outputs_sent += 1
            p = seq.params
            params = (DetokParams(p.stop, p.skip_special_tokens, seq.prompt_len, seq.cached_tokens,
                                  max(seq.first_scheduled_ns - seq.arrival_ns, 0) / 1e9)
                      if first else None)
            if reason is None:
                out.tokens.append(TokenOut(seq.request_id, [token], params))
                continue
            usage = Usage(seq.prompt_len, seq.num_output, seq.cached_tokens)
            timing = RequestTiming(max(seq.first_scheduled_ns - seq.arrival_ns, 0) / 1e9,
                                   max(seq.first_token_ns - seq.first_scheduled_ns, 0) / 1e9,
                                   max(now_ns - seq.first_token_ns, 0) / 1e9)
            out.tokens.append(TokenOut(seq.request_id, [token], params, reason, usage, timing))
            self._finish(seq, out)
        return out

    def _stop_reason(self, seq: Seq, token: int) -> str | None:
        p = seq.params
        if (token in seq.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if ((p.max_tokens is not None and seq.num_output >= p.max_tokens)
                or seq.num_tokens >= self.max_model_len):
            return "length"
        return None

    def _finish(self, seq: Seq, out: Outcome) -> None:
        if seq.phase is Phase.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.phase = Phase.DONE
        if seq.block_ids:
            self._frees.append(FreeRequest(seq.seq_id, seq.num_computed))
            self._frees_emitted += 1
        if seq.known_to_executor:
            self._drop.append(seq.seq_id)
        del self.by_request[seq.request_id]
        if not seq.pending_blocks:
            del self.by_seq[seq.seq_id]
        out.released.append(seq.request_id)

    # ------------------------------------------------------------------ kv traffic
    def take_kv_ops(self) -> KvOps | None:
        if not (self._allocs or self._frees):
            return None
        ops = KvOps(self.epoch, self._frees, self._allocs)
        self._allocs, self._frees = [], []
        return ops

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)
