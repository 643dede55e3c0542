"""The scheduler's pure core: continuous batching under a uniform token budget.

NOTE: there is no prefill phase and no decode phase. Every step, each running
sequence advances ``num_computed`` toward ``num_tokens``. Decode tokens (one per
sequence that has caught up) are reserved first; prefill chunks fill what
remains of ``max_num_batched_tokens``, so a long prompt is prefilled over
several steps while others keep decoding.

KV blocks come from the kv_manager asynchronously. The core never waits: it
emits batched ``AllocRequest``/``FreeRequest`` ops, asks for growth
``lookahead_tokens`` ahead, and a sequence whose grant has not arrived simply
sits out a step. If growth is denied, a victim is preempted — the least important
priority, then the latest arrival — either by recompute (its blocks are freed; its
computed prompt blocks stay in the prefix cache) or by swapping its blocks to the
executor's host tier, whichever the cost estimate says is cheaper; no new prefill is
admitted while a preempted sequence waits.

Parallel sampling (n > 1): the prompt is prefilled once; its last row is sampled n times
and the sequence forks into n choices that share the prompt's blocks (copy-on-write in
the kv_manager). Block copies the kv_manager asks for (copy-on-write, swap, prefix
demotion and promotion) ride to the executor on the next StepPlan, in order.

Synchronous and torch-free; the service feeds it messages and sends what it returns.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from components.scheduler.fairness import VirtualCounters
from components.scheduler.sequence import Phase, Seq
from schemas.config import KvConfig, SchedulerConfig
from schemas.wire import (Admitted, AllocRequest, BlockCopy, DetokParams, ForkRequest,
                          FreeRequest, KvGrant, KvOps, NewSeq, RequestTiming, SeqStep, StepPlan,
                          StepResult, SwapOutRequest, TokenOut, Usage)


@dataclass
class Outcome:
    """What one input produced: detokenizer output, released requests, forgotten requests."""

    tokens: list[TokenOut] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Preemption:
    """One preemption, as recorded for traces and stats."""

    request_id: str
    index: int
    reason: str            # "kv_growth_denied" | "returned_unscheduled_blocks" | "fork_denied" | ...
    choice: str            # "recompute" | "swap"
    wasted_tokens: int     # computed tokens that will be computed again
    recompute_s: float     # the estimates the choice was made on
    swap_s: float


class SchedulerCore:
    def __init__(self, cfg: SchedulerConfig, kv: KvConfig, max_model_len: int,
                 epoch: int = 1, weights: dict[str, float] | None = None) -> None:
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
        self._forks: list[ForkRequest] = []
        self._swap_outs: list[SwapOutRequest] = []
        self._swap_ins: list[int] = []
        self._copies: list[BlockCopy] = []
        self.preemption_mode = kv.preemption_mode
        self.cpu_free = kv.num_cpu_blocks       # host-tier blocks free, as last reported
        self.block_bytes = 0                    # set when the executor reports in
        self.copy_bytes_per_s = 0.0
        self.recompute_s: Callable[[int], float] = lambda tokens: 0.0   # prefill estimate
        self.preemptions = 0
        self.preemptions_by_kind: Counter[str] = Counter()
        self.wasted_tokens = 0           # computed tokens thrown away by preemption (recompute)
        self.swapped_blocks = 0          # blocks sent to the host tier by preemption
        self.last_preempted: list[Preemption] = []
        self.steps = 0
        self.vtc = VirtualCounters(weights)
        self.fair = cfg.fairness == "vtc"

    # ------------------------------------------------------------------ inputs
    def _backlogged_tenants(self) -> set[str]:
        return {s.tenant for s in self.waiting} | {s.tenant for s in self.running}

    def add(self, req: Admitted) -> Seq:
        seq = Seq(next(self._ids), req.request_id, req.tenant, req.params,
                  len(req.prompt_token_ids), list(req.prompt_token_ids), list(req.block_hashes),
                  req.arrival_ns, frozenset(req.eos_token_ids), priority=req.priority,
                  tpot_slo_s=req.tpot_slo_ms / 1e3 if req.tpot_slo_ms else None,
                  public_scope=req.public_scope, public_blocks=req.public_blocks)
        seq.group.append(seq)
        self.by_request[seq.request_id] = seq
        self.by_seq[seq.seq_id] = seq
        backlogged = self._backlogged_tenants()
        if seq.tenant not in backlogged:
            self.vtc.backlogged(seq.tenant, backlogged)
        self.waiting.append(seq)
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
            if s.phase is not Phase.DONE:
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
            if s.index == index and s.phase is not Phase.DONE:
                self._finish(s, out)
        return out

    def on_executor(self, block_bytes: int, copy_bytes_per_s: float) -> None:
        """The executor reported what moving a block to and from its host tier costs."""
        self.block_bytes, self.copy_bytes_per_s = block_bytes, copy_bytes_per_s

    def on_grants(self, grants: list[KvGrant], free_cpu_blocks: int = -1) -> None:
        if free_cpu_blocks >= 0:
            self.cpu_free = free_cpu_blocks
        for g in grants:
            if g.ok:
                self._copies.extend(g.copies)          # whoever they were for: the pool moved
            if g.epoch != self.epoch:
                continue
            seq = self.by_seq.get(g.seq_id)
            if seq is None or seq.phase is Phase.DONE:
                if g.ok or g.kind == "swap_out":        # a lease exists: give it back
                    self._free_lease(g.seq_id, 0)
                self.by_seq.pop(g.seq_id, None)
                continue
            seq.pending_blocks = 0
            if g.kind == "fork":
                self._forked(seq, g)
            elif g.kind == "swap_out":
                if not g.ok:                           # the host tier filled up: recompute
                    seq.has_lease = True
                    self._recompute(seq, "swap_refused", count=True)
            elif g.kind == "swap_in":
                if g.ok:
                    seq.block_ids = list(g.block_ids)
                    seq.phase = Phase.READY
                else:
                    seq.alloc_denied = True
            elif not g.ok:
                if seq.block_ids:
                    seq.grow_denied = True
                else:
                    seq.alloc_denied = True
            else:
                if not seq.block_ids:
                    seq.num_computed = g.num_cached_tokens
                    seq.cached_tokens = g.num_cached_tokens
                    seq.phase = Phase.READY
                    seq.has_lease = True
                seq.block_ids.extend(g.block_ids)
                seq.grow_denied = False

    def _forked(self, seq: Seq, g: KvGrant) -> None:
        if g.ok:
            seq.block_ids = list(g.block_ids)
            seq.has_lease = True
            return
        # no block for the copy-on-write: compute this choice from scratch when there is room
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        seq.phase = Phase.WAITING
        seq.num_computed = 0
        seq.preemptions += 1
        self._record(seq, "fork_denied", "recompute", 0, 0.0, 0.0)

    def reset(self, kv_lost: bool) -> Outcome:
        """A peer lost its state (executor or kv_manager restarted): drop every sequence.
        Their blocks are freed unless the pool itself was lost. Starts a new epoch."""
        out = Outcome()
        for parent in list(self.by_request.values()):
            out.forget.append(parent.request_id)
            for seq in list(parent.group):
                if seq.phase is Phase.DONE:
                    continue
                if kv_lost:
                    seq.block_ids = []
                    seq.has_lease = False
                seq.num_computed = 0      # the executor's KV is gone (or void): cache nothing
                seq.known_to_executor = False
                self._finish(seq, out)
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
        self.in_flight = None
        return out

    # ------------------------------------------------------------------ planning
    def schedule(self, now_ns: int = 0, budget: int | None = None) -> StepPlan | None:
        """Plan the next step, or None if nothing can run now. Call only when no step
        is in flight. ``now_ns`` (wall clock) stamps first scheduling, for queue time;
        ``budget`` overrides the step's token budget (stall-free chunking, chunking.py)."""
        assert self.in_flight is None
        self.last_preempted = []
        if self.fair:
            self._fair_order()
        self._preempt_if_stuck()
        if budget is None:
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
            # a sequence back from the host tier holds only its computed blocks: it runs
            # once growth (asked below, as for any running sequence) is granted
            n = min(seq.remaining, budget, seq.capacity(self.block_size) - seq.num_computed)
            if n > 0:
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

    def _fair_order(self) -> None:
        """New work in virtual-counter order: sequences that were preempted (or swapped)
        keep the head, in their order; the rest go by their tenant's counter, then arrival.
        Stable, so one tenant's requests keep their arrival order."""
        if len(self.waiting) < 2:
            return
        back = [s for s in self.waiting if s.preemptions or s.phase is Phase.SWAPPED]
        fresh = [s for s in self.waiting if not (s.preemptions or s.phase is Phase.SWAPPED)]
        fresh.sort(key=lambda s: (self.vtc.of(s.tenant), s.arrival_ns, s.seq_id))
        self.waiting = deque(back + fresh)

    def _plan(self, chosen: list[tuple[Seq, int]]) -> StepPlan:
        new_seqs, steps = [], []
        for seq, n in chosen:
            self.vtc.charge(seq.tenant, input_tokens=max(min(n, seq.prompt_len
                                                             - seq.num_computed), 0))
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
            seq.frees_at_request = self._frees_emitted
            if seq.phase is Phase.SWAPPED:
                seq.pending_blocks = 1
                self._swap_ins.append(seq.seq_id)
                continue
            n = -(-(seq.num_tokens + 1) // bs)
            seq.pending_blocks = n
            max_cached = (seq.num_tokens - 1) // bs
            self._allocs.append(AllocRequest(
                seq.seq_id, n, seq.tenant, seq.block_hashes,
                seq.token_ids[:len(seq.block_hashes) * bs], max_cached, seq.public_scope,
                seq.public_blocks, self._promote_pays()))

    def _preempt_if_stuck(self) -> None:
        """Free memory for sequences that cannot proceed. Ready-but-unscheduled sequences
        give their blocks back first; then a running victim is preempted by policy: the
        least important priority, then the latest arrival. A stuck sequence may be its
        own victim."""
        head = self.waiting[0] if self.waiting else None
        if head is not None and head.alloc_denied:
            for seq in [s for s in self.waiting if s.phase is Phase.READY]:
                self._give_back(seq)
        for seq in [s for s in self.running if s.grow_denied]:
            if seq.phase is not Phase.RUNNING:
                continue
            if seq.capacity(self.block_size) > seq.num_computed:
                seq.grow_denied = False          # can still make progress; ask again later
                continue
            ready = [s for s in self.waiting if s.phase is Phase.READY]
            if ready:
                self._give_back(max(ready, key=lambda s: (s.arrival_ns, s.seq_id)))
            else:
                self._preempt(max(self.running,
                                  key=lambda s: (s.priority, s.arrival_ns, s.seq_id)))
            seq.grow_denied = False

    def _give_back(self, seq: Seq) -> None:
        """A ready sequence returns its blocks. One resumed from the host tier holds real
        work, so it is preempted like a running victim; a fresh one loses nothing."""
        if seq.num_computed > seq.cached_tokens:
            self._preempt(seq, "returned_unscheduled_blocks")
        else:
            self._recompute(seq, "returned_unscheduled_blocks", count=False)

    def _costs(self, seq: Seq) -> tuple[float, float]:
        """Estimated seconds to recompute ``seq``'s computed tokens, and to swap its blocks
        out and back in (bytes / measured host-copy bandwidth, both ways)."""
        blocks = -(-seq.num_computed // self.block_size)
        swap_s = (2 * blocks * self.block_bytes / self.copy_bytes_per_s
                  if self.copy_bytes_per_s > 0 else math.inf)
        return self.recompute_s(seq.num_computed), swap_s

    def _promote_pays(self) -> bool:
        """Is copying a host-tier prefix block back cheaper than recomputing its tokens?
        Until both are measured, assume so (a copy is a memcpy; recompute is a forward)."""
        recompute_s = self.recompute_s(self.block_size)
        if self.copy_bytes_per_s <= 0 or recompute_s <= 0:
            return True
        return self.block_bytes / self.copy_bytes_per_s < recompute_s

    def _preempt(self, seq: Seq, reason: str = "kv_growth_denied") -> None:
        recompute_s, swap_s = self._costs(seq)
        blocks = -(-seq.num_computed // self.block_size)
        can_swap = (self.preemption_mode != "recompute" and seq.num_computed > 0
                    and seq.has_lease and not seq.pending_blocks and blocks <= self.cpu_free
                    and swap_s < math.inf)
        if can_swap and (self.preemption_mode == "swap" or swap_s < recompute_s):
            self._swap_out(seq, reason, blocks, recompute_s, swap_s)
        else:
            self._recompute(seq, reason, count=True, costs=(recompute_s, swap_s))

    def _record(self, seq: Seq, reason: str, choice: str, wasted: int, recompute_s: float,
                swap_s: float) -> None:
        self.last_preempted.append(Preemption(seq.request_id, seq.index, reason, choice, wasted,
                                              recompute_s, swap_s))
        self.preemptions += 1
        self.preemptions_by_kind[choice] += 1
        self.wasted_tokens += wasted

    def _swap_out(self, seq: Seq, reason: str, blocks: int, recompute_s: float,
                  swap_s: float) -> None:
        """Send a victim's computed blocks to the host tier; it keeps its seq id, progress
        and lease, and waits at the head of the queue to be swapped back in."""
        self._record(seq, reason, "swap", 0, recompute_s, swap_s)
        seq.preemptions += 1
        self.swapped_blocks += blocks
        self.cpu_free -= blocks
        if seq.phase is Phase.RUNNING:
            self.running.remove(seq)
            self.waiting.appendleft(seq)
        self._swap_outs.append(SwapOutRequest(seq.seq_id, seq.num_computed))
        if seq.known_to_executor:
            self._drop.append(seq.seq_id)
        seq.phase = Phase.SWAPPED
        seq.block_ids = []
        seq.blocks_sent = 0
        seq.pending_blocks = 1
        seq.grow_denied = seq.alloc_denied = False
        seq.known_to_executor = False

    def _recompute(self, seq: Seq, reason: str, count: bool,
                   costs: tuple[float, float] = (0.0, 0.0)) -> None:
        """Return a sequence's blocks (its computed full blocks stay cached) and send it
        back to wait under a fresh seq id; a running victim goes to the head of the queue."""
        if count:
            self._record(seq, reason, "recompute", seq.num_computed, *costs)
            seq.preemptions += 1
        else:
            self.last_preempted.append(Preemption(seq.request_id, seq.index, reason, "recompute",
                                                  0, *costs))
        if seq.phase is Phase.RUNNING:
            self.running.remove(seq)
            self.waiting.appendleft(seq)
        self._free_lease(seq.seq_id, seq.num_computed)
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
        seq.has_lease = False
        seq.grow_denied = seq.alloc_denied = False
        seq.known_to_executor = False

    def _free_lease(self, seq_id: int, num_computed: int) -> None:
        self._frees.append(FreeRequest(seq_id, num_computed))
        self._frees_emitted += 1

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
        sampled: dict[int, list[int]] = {}
        for seq_id, token in zip(result.seq_ids, result.token_ids):
            sampled.setdefault(seq_id, []).append(token)
        for seq_id, tokens in sampled.items():
            seq = self.by_seq.get(seq_id)
            if seq is None or seq.phase is not Phase.RUNNING:
                continue
            self.vtc.charge(seq.tenant, output_tokens=len(tokens))
            if seq.n > 1 and not seq.forked:
                seq.forked = True
                for index, token in enumerate(tokens[1:seq.n], start=1):
                    self._fork(seq, index, token, now_ns, out)
            seq.token_ids.append(tokens[0])
            self._emit_token(seq, tokens[0], now_ns, out)
        return out

    def _fork(self, parent: Seq, index: int, token: int, now_ns: int, out: Outcome) -> None:
        """Choice ``index`` of an n > 1 request: the parent's computed prompt plus its own
        first token, sharing the parent's blocks once the kv_manager grants the fork."""
        child = Seq(next(self._ids), parent.request_id, parent.tenant, parent.params,
                    parent.prompt_len, parent.token_ids + [token], parent.block_hashes,
                    parent.arrival_ns, parent.eos_token_ids, phase=Phase.RUNNING,
                    num_computed=parent.num_computed, cached_tokens=parent.cached_tokens,
                    first_scheduled_ns=parent.first_scheduled_ns, index=index,
                    priority=parent.priority, tpot_slo_s=parent.tpot_slo_s,
                    public_scope=parent.public_scope,
                    public_blocks=parent.public_blocks, forked=True, group=parent.group)
        parent.group.append(child)
        self.by_seq[child.seq_id] = child
        self.running.append(child)
        child.pending_blocks = 1
        self._forks.append(ForkRequest(parent.seq_id, child.seq_id, parent.num_computed))
        self._emit_token(child, token, now_ns, out)

    def _emit_token(self, seq: Seq, token: int, now_ns: int, out: Outcome) -> None:
        reason = self._stop_reason(seq, token)
        first = seq.outputs_sent == 0
        if first:
            seq.first_token_ns = now_ns
        seq.outputs_sent += 1
        p = seq.params
        params = (DetokParams(p.stop, p.skip_special_tokens, seq.prompt_len, seq.cached_tokens,
                              max(seq.first_scheduled_ns - seq.arrival_ns, 0) / 1e9, None, p.n)
                  if first else None)
        if reason is None:
            out.tokens.append(TokenOut(seq.request_id, [token], params, index=seq.index))
            return
        usage = Usage(seq.prompt_len, seq.num_output, seq.cached_tokens)
        timing = RequestTiming(max(seq.first_scheduled_ns - seq.arrival_ns, 0) / 1e9,
                               max(seq.first_token_ns - seq.first_scheduled_ns, 0) / 1e9,
                               max(now_ns - seq.first_token_ns, 0) / 1e9,
                               sum(s.preemptions for s in seq.group))
        out.tokens.append(TokenOut(seq.request_id, [token], params, reason, usage, timing,
                                   seq.index))
        self._finish(seq, out)

    def _stop_reason(self, seq: Seq, token: int) -> str | None:
        p = seq.params
        if (token in seq.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if ((p.max_tokens is not None and seq.num_output >= p.max_tokens)
                or seq.num_tokens >= self.max_model_len):
            return "length"
        return None

    def _finish(self, seq: Seq, out: Outcome) -> None:
        """End one choice; the request is released when its last choice ends."""
        if seq.phase is Phase.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.phase = Phase.DONE
        if seq.has_lease or seq.block_ids:
            self._free_lease(seq.seq_id, seq.num_computed)
        if seq.known_to_executor:
            self._drop.append(seq.seq_id)
        if not seq.pending_blocks:
            del self.by_seq[seq.seq_id]
        if all(s.phase is Phase.DONE for s in seq.group):
            del self.by_request[seq.request_id]
            out.released.append(seq.request_id)

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
