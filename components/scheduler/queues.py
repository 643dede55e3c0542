"""Who waits, who runs, and in what order new work starts: the waiting queue, the running
set, the index of sequences by request and by seq id, and the fair order.

Only this class adds a sequence to, or takes one out of, ``waiting``, ``running``,
``by_request`` and ``by_seq``; the other parts (planning, the lease book, the preemptor,
the output stage) move sequences through its methods and read its lists. What a tenant
may use (its counter, bucket, KV budget, running cap) it reads from ``Tenants``.

New work starts in fair order (``fairness = "vtc"``): sequences coming back from
preemption first, then by class (aged priority, ``Seq.aged_priority``), then within a class
by the tenant's virtual token counter, then arrival (``fair_order``)."""
from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque

from components.scheduler.sequence import TENANT_BUDGET, Seq, State, in_running
from components.scheduler.tenants import Tenants

_NEVER = 1 << 62                 # the deadline of a request that has none


class Queues:
    def __init__(self, tenants: Tenants, num_blocks: int) -> None:
        self.tenants = tenants
        self.num_blocks = num_blocks
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.by_request: dict[str, Seq] = {}
        self.by_seq: dict[int, Seq] = {}
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ moves
    def next_id(self) -> int:
        return next(self._ids)

    def admit(self, seq: Seq, now_ns: int) -> None:
        """A new request's first sequence joins the queue; ``now_ns`` dates a reorder."""
        self.by_request[seq.request_id] = seq
        self.by_seq[seq.seq_id] = seq
        backlogged = self.backlogged_tenants()
        # lifted, or of a more important class than work already waiting, it may start
        # before others: put it in its place before leases are asked
        reorder = self.tenants.fair and (seq.tenant not in backlogged
                                         or any(s.priority > seq.priority for s in self.waiting))
        self.waiting.append(seq)
        if seq.tenant not in backlogged:
            self.tenants.vtc.backlogged(seq.tenant, backlogged)
        if reorder:
            self.fair_order(now_ns)

    def start(self, seq: Seq) -> None:
        """A waiting sequence joins the running set (its state moved by the caller)."""
        if seq is self.waiting[0]:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)
        self.running.append(seq)

    def join(self, child: Seq) -> None:
        """A forked choice joins the running set."""
        self.by_seq[child.seq_id] = child
        self.running.append(child)

    def to_head(self, seq: Seq) -> None:
        """A running sequence goes back to the head of the queue (preempted, or its fork
        refused)."""
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def to_front(self, seq: Seq) -> None:
        """A waiting sequence moves to the head of the queue (rescued by urgency)."""
        self.waiting.remove(seq)
        self.waiting.appendleft(seq)

    def renumber(self, seq: Seq) -> None:
        """A fresh seq id for a sequence whose lease was given back (late grants for the
        old one are then freed as unknown)."""
        del self.by_seq[seq.seq_id]
        seq.seq_id = self.next_id()
        self.by_seq[seq.seq_id] = seq

    def leave(self, seq: Seq) -> None:
        """An ended sequence leaves the running set or the queue."""
        if in_running(seq):
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def forget(self, seq_id: int) -> None:
        self.by_seq.pop(seq_id, None)

    def release(self, request_id: str) -> None:
        del self.by_request[request_id]

    def clear_seqs(self) -> None:
        """After a reset ended every request: no seq id is known any more."""
        self.by_seq.clear()

    # ------------------------------------------------------------------ reads
    def backlogged_tenants(self) -> set[str]:
        """Tenants with work waiting to start, as VTC counts them: a tenant whose work is
        all running is not backlogged, so its next request is lifted (no banked credit)."""
        return {s.tenant for s in self.waiting}

    def running_slots(self) -> Counter[str]:
        """Running sequences per tenant, an unforked n > 1 request counting n."""
        slots: Counter[str] = Counter()
        for seq in self.running:
            slots[seq.tenant] += seq.slots
        return slots

    def leased_slots(self, claimed: Counter[str]) -> Counter[str]:
        """``claimed`` (running slots) plus the waiting sequences that hold or are asking a
        lease, per tenant."""
        leased = claimed.copy()
        for seq in self.waiting:
            if seq.state in (State.LEASING, State.READY, State.SWAPPING_IN):
                leased[seq.tenant] += seq.slots
        return leased

    def held_blocks(self) -> Counter[str]:
        """Device blocks each tenant's sequences hold (as the core knows them)."""
        held: Counter[str] = Counter()
        for seq in self.by_seq.values():
            if seq.holds_lease and seq.state not in (State.SWAPPED, State.SWAPPING_IN,
                                                     State.SWAP_REFUSED):
                held[seq.tenant] += len(seq.block_ids)
        return held

    def over_share(self) -> set[str]:
        """Tenants holding more device blocks than their weighted share of the pool, among
        the tenants with work running or waiting. A full pool holds up the queue for them
        only: they wait, the others go on (KV fairness)."""
        held = self.held_blocks()
        vtc = self.tenants.vtc
        active = {s.tenant for s in self.running} | {s.tenant for s in self.waiting}
        total = sum(vtc.weight(t) for t in active) or 1.0
        return {t for t in active if held[t] > self.num_blocks * vtc.weight(t) / total}

    def holds_up_only_its_tenant(self, seq: Seq, leased: Counter[str],
                                 over: list[set[str]]) -> bool:
        """A waiting sequence that is not ready holds up only its own tenant when what keeps
        it is the tenant's: its KV budget, its running cap (counting leases), or a full pool
        it holds more than its weighted share of. ``over`` caches ``over_share()`` (empty
        until first needed)."""
        if ((seq.state is State.REFUSED and seq.refusal == TENANT_BUDGET)
                or self.tenants.at_running_cap(seq, leased)):
            return True
        if seq.state in (State.REFUSED, State.SWAP_REFUSED):
            if not over:
                over.append(self.over_share())
            return seq.tenant in over[0]
        return False

    # ------------------------------------------------------------------ order
    def fair_order(self, now_ns: int) -> None:
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
        fair, vtc = self.tenants.fair, self.tenants.vtc
        head: list[Seq] = []
        fresh: dict[str, deque[Seq]] = {}
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

        def pick(tenant: str, seq: Seq, over: bool, counter: float
                 ) -> tuple[int, bool, float, int, int, str]:
            level = seq.aged_priority(now_ns) if fair else 0
            return level, over, counter, seq.arrival_ns, seq.seq_id, tenant

        picks = []
        for tenant, queue in fresh.items():
            counter = vtc.of(tenant) if fair else 0.0
            picks.append(pick(tenant, queue[0], self.tenants.over_rate(tenant, now_s), counter))
        heapq.heapify(picks)
        order = head
        while picks:
            _, over, counter, _, _, tenant = heapq.heappop(picks)
            queue = fresh[tenant]
            seq = queue.popleft()
            order.append(seq)
            if queue:
                if fair:
                    counter += (max(seq.prompt_len - seq.num_computed, 0) * vtc.w_in
                                / vtc.weight(tenant))
                heapq.heappush(picks, pick(tenant, queue[0], over, counter))
        self.waiting = deque(order)
