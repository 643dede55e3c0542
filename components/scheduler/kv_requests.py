"""The lease book: the core's KV side. What it asks the kv_manager for (first leases with
prefix matching, growth ahead of need, swap-ins, forks, frees and swap-outs, sent as one
``KvOps`` by ``take_kv_ops``) and what it does with the answers; and what the executor's
next plan carries for the KV (the grants' block copies, the seq ids it is to forget).

It owns the pool's epoch, the ops not sent yet, the copies and drops not planned yet, and
the count of frees a refused lease waits on. It reads the queues; the preemptor's two moves
a grant may call for (a refused swap-out is recomputed, a refused fork computes its choice
from scratch) are passed to ``on_grants`` (``Victims``).

Every ask and every answer is a transition of the sequence's state (``sequence.py``). A
refused first lease is asked again only after something was freed since it was asked: the
pool as a whole for ``pool_full``, the same tenant for ``tenant_kv_budget``. A tenant at its
KV budget or its running cap does not hold up the queue: later tenants are asked for.

A lease is given back (``FreeRequest``, or a ``SwapOutRequest`` for a swap victim) as soon
as the core decides it, even while a step in flight (``scheduler.async_depth`` 2) still
names the sequence. That is safe because the executor runs its plans strictly in order:

- a block handed to another sequence (or copied into, by a later grant's copies) is first
  used by a plan made after that grant came back, so the executor runs it after every
  step in flight now, whose writes to the block are over by then;
- the blocks a free enters in the prefix cache are the full ones below ``num_computed``,
  which counts answered steps only; a step in flight writes at ``num_computed`` and past;
- a swap-out's copies (and a prefix demotion's) ride in a later plan and are done before
  its forward, after the steps in flight; the blocks they move hold the first
  ``num_computed`` tokens, already written by answered steps;
- the executor forgets the sequence through the next plan's ``drop``; until then only the
  steps in flight use its (stale) block table.

So a finished sequence's blocks reach the prefix cache in the step it ends, and a follow-up
turn sent right after its last token finds them."""
from __future__ import annotations

from collections import Counter
from typing import Protocol

from components.scheduler.determinism import cached_blocks
from components.scheduler.prices import Prices
from components.scheduler.queues import Queues
from components.scheduler.sequence import TENANT_BUDGET, Event, Seq, State
from schemas.config import SchedulerConfig, deterministic_chunk
from schemas.wire import (
    AllocRequest,
    BlockCopy,
    ForkRequest,
    FreeRequest,
    KvGrant,
    KvOps,
    SwapOutRequest,
)


class Victims(Protocol):
    """What a grant may need of the preemptor."""

    def recompute(self, seq: Seq, reason: str, count: bool) -> None: ...

    def fork_refused(self, seq: Seq) -> None: ...


class LeaseBook:
    def __init__(self, cfg: SchedulerConfig, queues: Queues, prices: Prices, block_size: int,
                 grow_blocks: int, max_model_len: int, epoch: int) -> None:
        self.cfg = cfg
        self.queues = queues
        self.prices = prices
        self.block_size = block_size
        self.grow_blocks = grow_blocks
        self.max_model_len = max_model_len
        self.epoch = epoch
        self.draft_room = 0        # speculation's max_k: growth keeps room for the drafts
        self.det_chunk = deterministic_chunk(cfg, block_size)
        self._allocs: list[AllocRequest] = []
        self._frees: list[FreeRequest] = []
        self._forks: list[ForkRequest] = []
        self._swap_outs: list[SwapOutRequest] = []
        self._swap_ins: list[int] = []
        self._copies: list[BlockCopy] = []
        self._drop: list[int] = []
        self._frees_emitted = 0    # FreeRequests so far; a refused lease retries after more
        self._tenant_frees: Counter[str] = Counter()    # the same, per tenant (budget refusals)

    # ------------------------------------------------------------------ answers
    def on_grants(self, grants: list[KvGrant], victims: Victims) -> None:
        by_seq = self.queues.by_seq
        for g in grants:
            if g.ok:
                self._copies.extend(g.copies)          # whoever they were for: the pool moved
            if g.epoch != self.epoch:
                continue
            seq = by_seq.get(g.seq_id)
            if seq is None or seq.ended:
                if g.ok or g.kind == "swap_out":        # a lease exists: give it back
                    # (an old seq id's tenant is not kept: it counts as every tenant's free)
                    self.free_lease(g.seq_id, 0, seq.tenant if seq is not None else "*")
                if seq is not None:
                    seq.to(Event.GRANT if g.ok else Event.REFUSE)     # CLOSING -> DONE
                self.queues.forget(g.seq_id)
                continue
            if not g.ok:
                seq.refusal = getattr(g, "reason", "") or "pool_full"
            match seq.state, g.ok:
                case State.FORKING, True:
                    seq.block_ids = list(g.block_ids)
                    seq.to(Event.GRANT)
                case State.FORKING, False:
                    victims.fork_refused(seq)
                case State.SWAPPING_OUT, True:          # its device blocks are free now
                    seq.to(Event.GRANT)
                    self.note_freed(seq.tenant)
                case State.SWAPPING_OUT, False:         # the host tier filled up: recompute
                    victims.recompute(seq, "swap_refused", count=True)
                case State.SWAPPING_IN, True:
                    seq.block_ids = list(g.block_ids)
                    seq.to(Event.GRANT)
                case State.LEASING, True:
                    seq.num_computed = g.num_cached_tokens
                    seq.cached_tokens = g.num_cached_tokens
                    seq.block_ids.extend(g.block_ids)
                    seq.to(Event.GRANT)
                case State.GROWING, True:
                    seq.block_ids.extend(g.block_ids)
                    seq.to(Event.GRANT)
                case _, False:                          # LEASING, SWAPPING_IN, GROWING
                    seq.to(Event.REFUSE)
                case state, _:
                    raise AssertionError(f"grant {g.kind} for seq {seq.seq_id} in {state}")

    # ------------------------------------------------------------------ asks
    def request_blocks(self, chosen: list[tuple[Seq, int]],
                       drafts: dict[int, int] | None = None) -> None:
        """Growth for running sequences (``drafts``: this step's k per speculating row,
        whose accepted drafts it may also advance by)."""
        bs = self.block_size
        planned = {s.seq_id: n + (drafts or {}).get(s.seq_id, 0) for s, n in chosen}
        for seq in self.queues.running:               # growth, asked ahead and in batches
            if seq.state is not State.RUNNING:        # asked already, refused, or forking
                continue
            # from where the steps in flight leave it (before ``chosen`` joins them)
            after = seq.planned + planned.get(seq.seq_id, 0)
            want = min(max(seq.planned_tokens, after) + self.cfg.lookahead_tokens
                       + self.draft_room,
                       self.max_model_len + 1)
            short = -(-want // bs) - len(seq.block_ids)
            if short > 0:
                seq.to(Event.ASK)
                self._allocs.append(AllocRequest(seq.seq_id, max(short, self.grow_blocks)))
        self.lease_waiting()

    def lease_waiting(self) -> None:
        """First leases and swap-ins for waiting sequences, in queue order, as many as there
        are running slots free. Called when planning and when a request arrives, so a
        request's lease is granted by the time the next step is planned."""
        bs = self.block_size
        queues, tenants = self.queues, self.queues.tenants
        slots = self.cfg.max_num_seqs - len(queues.running)
        claimed = queues.running_slots()
        over: set[str] | None = None
        for seq in queues.waiting:                    # first leases and swap-ins, in order
            if slots <= 0:
                break
            if tenants.at_running_cap(seq, claimed):
                continue                              # its tenant waits; others are asked for
            if seq.state in (State.REFUSED, State.SWAP_REFUSED):
                pool_frees, tenant_frees = seq.frees_at_request
                if seq.refusal == TENANT_BUDGET:
                    if tenant_frees == self._tenant_freed(seq.tenant):
                        continue                      # its tenant freed nothing since
                elif pool_frees == self._frees_emitted:
                    over = queues.over_share() if over is None else over
                    if seq.tenant in over:
                        continue                      # it holds more than its share: it waits
                    break                             # nothing freed since the pool said no
            slots -= 1                                # it holds, or is asked, a lease
            claimed[seq.tenant] += seq.slots
            if seq.state not in (State.WAITING, State.SWAPPED, State.REFUSED,
                                 State.SWAP_REFUSED):
                continue                              # ready, or asked already
            seq.frees_at_request = (self._frees_emitted, self._tenant_freed(seq.tenant))
            if seq.to(Event.ASK) is State.SWAPPING_IN:
                self._swap_ins.append(seq.seq_id)
                continue
            # a prompt owed prompt_logprobs is computed whole: no cached block is read; a
            # deterministic one's hit ends on a chunk boundary (determinism.py)
            max_cached, multiple = (seq.num_tokens - 1) // bs, 1
            if seq.deterministic:
                max_cached, multiple = cached_blocks(seq.num_tokens, self.det_chunk, bs)
            if seq.owes_prompt_logprobs:
                max_cached = 0
            self._allocs.append(AllocRequest(
                seq.seq_id, -(-(seq.num_tokens + 1) // bs), seq.tenant, seq.block_hashes,
                seq.token_ids[:len(seq.block_hashes) * bs], max_cached, seq.public_scope,
                seq.public_blocks, self.prices.promote_pays(), multiple))

    def fork(self, parent: Seq, child: Seq) -> None:
        """``child`` shares ``parent``'s computed blocks, copy-on-write."""
        self._forks.append(ForkRequest(parent.seq_id, child.seq_id, parent.num_computed))

    def swap_out(self, seq: Seq) -> None:
        """Send ``seq``'s computed blocks to the host tier now, steps in flight or not; its
        blocks count as freed when the grant comes."""
        self._swap_outs.append(SwapOutRequest(seq.seq_id, seq.num_computed))

    def free_lease(self, seq_id: int, num_computed: int, tenant: str = "") -> None:
        """Give ``seq_id``'s blocks back now, steps in flight or not (module docstring);
        its first ``num_computed`` tokens' full blocks enter the prefix cache."""
        self._frees.append(FreeRequest(seq_id, num_computed))
        self.note_freed(tenant)         # counted when sent: a refused lease asks again after

    def note_freed(self, tenant: str) -> None:
        """Device blocks were (or will be, before any later ask) given back: a refused lease
        may be asked again."""
        self._frees_emitted += 1
        if tenant:
            self._tenant_frees[tenant] += 1

    def _tenant_freed(self, tenant: str) -> int:
        return self._tenant_frees[tenant] + self._tenant_frees["*"]

    def drop(self, seq_id: int) -> None:
        """The executor is to forget ``seq_id`` (through the next plan)."""
        self._drop.append(seq_id)

    # ------------------------------------------------------------------ out
    def take_kv_ops(self) -> KvOps | None:
        if not (self._allocs or self._frees or self._forks or self._swap_outs or self._swap_ins):
            return None
        ops = KvOps(self.epoch, self._frees, self._allocs, self._forks, self._swap_outs,
                    self._swap_ins)
        self._allocs, self._frees, self._forks, self._swap_outs, self._swap_ins = [], [], [], [], []
        return ops

    def take_plan_notes(self) -> tuple[list[int], list[BlockCopy]]:
        """The seq ids the executor is to forget and the block copies it is to make, for
        the plan being made."""
        drop, self._drop = self._drop, []
        copies, self._copies = self._copies, []
        return drop, copies

    def reset(self, kv_lost: bool) -> None:
        """After a reset ended every sequence: the executor's memory is new (or void), so
        no copy is owed and no seq id needs forgetting; if the pool was lost nothing asked
        or given back reaches it, and a new epoch starts."""
        self._copies.clear()
        if kv_lost:
            self._frees.clear()
            self._allocs.clear()
            self._forks.clear()
            self._swap_outs.clear()
            self._swap_ins.clear()
            self.epoch += 1
        self._drop.clear()
