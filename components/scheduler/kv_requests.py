"""The core's KV side: what it asks the kv_manager for (first leases with prefix matching,
growth ahead of need, swap-ins, forks) and what it does with the answers.

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
from typing import TYPE_CHECKING

from components.scheduler.sequence import Event, Seq, State
from schemas.wire import AllocRequest, FreeRequest, KvGrant

if TYPE_CHECKING:
    from components.scheduler.core import SchedulerCore

TENANT_BUDGET = "tenant_kv_budget"      # the kv_manager's reason for a budget refusal


class KvRequests:
    def on_grants(self: SchedulerCore, grants: list[KvGrant], free_cpu_blocks: int = -1) -> None:
        if free_cpu_blocks >= 0:
            self.cpu_free = free_cpu_blocks
        for g in grants:
            if g.ok:
                self._copies.extend(g.copies)          # whoever they were for: the pool moved
            if g.epoch != self.epoch:
                continue
            seq = self.by_seq.get(g.seq_id)
            if seq is None or seq.ended:
                if g.ok or g.kind == "swap_out":        # a lease exists: give it back
                    # (an old seq id's tenant is not kept: it counts as every tenant's free)
                    self._free_lease(g.seq_id, 0, seq.tenant if seq is not None else "*")
                if seq is not None:
                    seq.to(Event.GRANT if g.ok else Event.REFUSE)     # CLOSING -> DONE
                self.by_seq.pop(g.seq_id, None)
                continue
            if not g.ok:
                seq.refusal = getattr(g, "reason", "") or "pool_full"
            match seq.state, g.ok:
                case State.FORKING, True:
                    seq.block_ids = list(g.block_ids)
                    seq.to(Event.GRANT)
                case State.FORKING, False:
                    self._fork_refused(seq)
                case State.SWAPPING_OUT, True:          # its device blocks are free now
                    seq.to(Event.GRANT)
                    self._note_freed(seq.tenant)
                case State.SWAPPING_OUT, False:         # the host tier filled up: recompute
                    self._recompute(seq, "swap_refused", count=True)
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

    def _fork_refused(self: SchedulerCore, seq: Seq) -> None:
        """No block for the copy-on-write: compute this choice from scratch when there is
        room."""
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        seq.to(Event.REFUSE)
        seq.num_computed = 0
        seq.preemptions += 1
        self._record(seq, "fork_denied", "recompute", 0, 0.0, 0.0)

    def _request_blocks(self: SchedulerCore, chosen: list[tuple[Seq, int]]) -> None:
        bs = self.block_size
        planned = {s.seq_id: n for s, n in chosen}
        for seq in self.running:                      # growth, asked ahead and in batches
            if seq.state is not State.RUNNING:        # asked already, refused, or forking
                continue
            # from where the steps in flight leave it (before ``chosen`` joins them)
            after = seq.planned + planned.get(seq.seq_id, 0)
            want = min(max(seq.planned_tokens, after) + self.cfg.lookahead_tokens,
                       self.max_model_len + 1)
            short = -(-want // bs) - len(seq.block_ids)
            if short > 0:
                seq.to(Event.ASK)
                self._allocs.append(AllocRequest(seq.seq_id, max(short, self.grow_blocks)))
        self._lease_waiting()

    def _lease_waiting(self: SchedulerCore) -> None:
        """First leases and swap-ins for waiting sequences, in queue order, as many as there
        are running slots free. Called when planning and when a request arrives, so a
        request's lease is granted by the time the next step is planned."""
        bs = self.block_size
        slots = self.cfg.max_num_seqs - len(self.running)
        claimed = self.running_slots()
        over: set[str] | None = None
        for seq in self.waiting:                      # first leases and swap-ins, in order
            if slots <= 0:
                break
            if self._at_running_cap(seq, claimed):
                continue                              # its tenant waits; others are asked for
            if seq.state in (State.REFUSED, State.SWAP_REFUSED):
                pool_frees, tenant_frees = seq.frees_at_request
                if seq.refusal == TENANT_BUDGET:
                    if tenant_frees == self._tenant_freed(seq.tenant):
                        continue                      # its tenant freed nothing since
                elif pool_frees == self._frees_emitted:
                    over = self.over_share() if over is None else over
                    if seq.tenant in over:
                        continue                      # it holds more than its share: it waits
                    break                             # nothing freed since the pool said no
            slots -= 1                                # it holds, or is asked, a lease
            claimed[seq.tenant] += seq.slots
            if seq.state not in (State.WAITING, State.SWAPPED, State.REFUSED,
                                 State.SWAP_REFUSED):
                continue                              # ready, or asked already
            seq.frees_at_request = (self._frees_emitted, self._tenant_freed(seq.tenant))
            seq.to(Event.ASK)
            if seq.state is State.SWAPPING_IN:
                self._swap_ins.append(seq.seq_id)
                continue
            # a prompt owed prompt_logprobs is computed whole: no cached block is read
            max_cached = 0 if seq.owes_prompt_logprobs else (seq.num_tokens - 1) // bs
            self._allocs.append(AllocRequest(
                seq.seq_id, -(-(seq.num_tokens + 1) // bs), seq.tenant, seq.block_hashes,
                seq.token_ids[:len(seq.block_hashes) * bs], max_cached, seq.public_scope,
                seq.public_blocks, self._promote_pays()))

    def _at_running_cap(self: SchedulerCore, seq: Seq, claimed: Counter[str]) -> bool:
        """Would starting ``seq`` take its tenant past its running-sequence cap? A tenant
        with nothing running may always start one request (n > cap would never run)."""
        cap = self.max_running.get(seq.tenant)
        return bool(cap) and claimed[seq.tenant] > 0 and claimed[seq.tenant] + seq.slots > cap

    def _free_lease(self: SchedulerCore, seq_id: int, num_computed: int, tenant: str = "") -> None:
        """Give ``seq_id``'s blocks back now, steps in flight or not (module docstring);
        its first ``num_computed`` tokens' full blocks enter the prefix cache."""
        self._frees.append(FreeRequest(seq_id, num_computed))
        self._note_freed(tenant)        # counted when sent: a refused lease asks again after

    def _note_freed(self: SchedulerCore, tenant: str) -> None:
        """Device blocks were (or will be, before any later ask) given back: a refused lease
        may be asked again."""
        self._frees_emitted += 1
        if tenant:
            self._tenant_frees[tenant] += 1

    def _tenant_freed(self: SchedulerCore, tenant: str) -> int:
        return self._tenant_frees[tenant] + self._tenant_frees["*"]

    def _promote_pays(self: SchedulerCore) -> bool:
        """Is copying a host-tier prefix block back cheaper than recomputing its tokens?
        Until both are measured, assume so (a copy is a memcpy; recompute is a forward)."""
        recompute_s = self.recompute_s(self.block_size)
        if self.copy_bytes_per_s <= 0 or recompute_s <= 0:
            return True
        return self.block_bytes / self.copy_bytes_per_s < recompute_s
