"""Admission's TTFT prediction for a new request: a model of the scheduler's backlog (what
it prefills before the request starts, at its measured rates) plus a bias learned from
the TTFTs requests then saw. Pure and clock-free, like the policy that owns it."""
from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass

from components.costs.cost_model import row_pairs
from components.tenancy.fairness import VirtualCounters
from schemas.config import WeirConfig
from schemas.wire import SchedulerLoad

# how far one observed miss moves the learned bias, up and down (see ``observed``)
BIAS_UP, BIAS_DOWN = 0.2, 0.02
# the bias's floor: the 90th percentile of the misses of the last RECENT admitted requests,
# a request still without its first token counting with what it has overrun so far; a miss
# known for RECENT_S seconds no longer counts (it describes what has passed)
RECENT, RECENT_MIN, RECENT_S = 20, 10, 3.0
_NEVER = 1 << 62        # no deadline sorts after every deadline (the scheduler's order)


@dataclass
class _Recent:
    """A recently admitted request, as the bias floor sees it."""

    predicted_s: float                   # the backlog model's TTFT when it was admitted
    miss_s: float | None = None          # observed − predicted, or overrun so far (waiting)
    known_at: float | None = None        # when the miss became final (its first token, or
    #                                      its release without one)


class TtftModel:
    """``predicted_s`` is the backlog model's TTFT (None until the scheduler's first report:
    its rates come from the executor's startup measurement, then from measured steps);
    ``bias_s`` is what admission adds to it. The policy tells it what it
    admits (``admitted``), what ends (``ended``, ``observed``) and every scheduler report
    (``on_load``)."""

    def __init__(self, config: WeirConfig, vtc: VirtualCounters) -> None:
        self.budget = config.scheduler.max_num_batched_tokens
        self.fairness = config.scheduler.fairness
        self.vtc = vtc                        # the tenants' weights, as the scheduler's VTC
        self.load = SchedulerLoad(0, 0, 0, 0.0, 0.0)
        self.unreported_tokens = 0        # prefill admitted since the scheduler's last report
        self.unreported_pairs = 0         # its attention pairs
        self._unreported: Counter[tuple[str, int]] = Counter()   # the same, by tenant and class
        # ... and each such prompt with its TTFT deadline (wall-clock ns, 0: none), in the
        # order the scheduler starts a tenant's work of one class: the earlier deadline first
        self._unreported_due: list[tuple[str, int, int, int]] = []   # tenant, class, due, tokens
        self.learned_s = 0.0              # observed − predicted TTFT, smoothed (``observed``)
        self.floor_s = 0.0                # a lower bound of recent misses (``on_load``)
        self._recent: dict[str, _Recent] = {}           # the last RECENT admitted
        self._recent_order: deque[str] = deque()
        self._observed = False            # a TTFT was observed since the last load report

    @property
    def bias_s(self) -> float:
        """What is added to the backlog model's TTFT: the learned bias, or more while recent
        requests are overrunning their predictions by more."""
        return max(self.learned_s, self.floor_s)

    def predicted_s(self, uncached_tokens: int, tenant: str | None = None,
                    cached_tokens: int = 0, priority: int | None = None,
                    deadline_ns: int = 0, deterministic: bool = False) -> float | None:
        """Prefill work ahead (``prefill_ahead``: what the scheduler computes before this
        request of ``tenant`` and class ``priority``, due by ``deadline_ns``, starts) plus
        this prompt's uncached
        tokens, at the reported
        prefill rate, plus one decode step for the current batch, plus the attention of
        all that prefill: the prompt's own pairs (its ``uncached_tokens`` after its
        ``cached_tokens``) and the backlog's, in proportion to the share of it ahead. None
        while the scheduler has no rates (before its first report). A ``deterministic``
        request makes the steps run the batch-invariant plan: at the report's factor over
        its rates where they are the fast plan's."""
        load = self.load
        if load.prefill_tokens_per_s <= 0:
            return None
        scale = self._det_scale(deterministic)
        before = self.prefill_ahead(tenant, priority, deadline_ns)
        ahead = before + uncached_tokens
        # each step decodes every running sequence and prefills what is left of the budget
        # (stall-free chunking's, while streams decode: ``SchedulerLoad.prefill_budget``):
        # a prefill token costs its own time plus its share of the step's decode work
        budget = load.prefill_budget if 0 < load.prefill_budget < self.budget else self.budget
        per_step = max(budget - load.running, 1)
        step_s = load.decode_step_s + per_step / load.prefill_tokens_per_s
        steps = ahead / per_step
        base = steps * step_s if steps >= 1 else \
            ahead / load.prefill_tokens_per_s + load.decode_step_s
        if load.attention_s_per_pair <= 0:
            return base * scale
        return scale * (base + load.attention_s_per_pair * (
            self.pairs_ahead(before) + row_pairs(uncached_tokens, cached_tokens)))

    def _det_scale(self, deterministic: bool) -> float:
        load = self.load
        return load.deterministic_factor if deterministic and not load.deterministic else 1.0

    def alone_s(self, uncached_tokens: int, cached_tokens: int = 0,
                deterministic: bool = False) -> float | None:
        """This prompt's own prefill on an idle engine, at the reported rates (its tokens
        and its attention pairs, nothing ahead of it); None before the first report."""
        load = self.load
        if load.prefill_tokens_per_s <= 0:
            return None
        return self._det_scale(deterministic) * (uncached_tokens / load.prefill_tokens_per_s
                                                 + max(load.attention_s_per_pair, 0.0)
                                                 * row_pairs(uncached_tokens, cached_tokens))

    def pairs_ahead(self, tokens: int) -> float:
        """The attention pairs of ``tokens`` of the backlog (reported and unreported): all
        of its pairs for all of it, else its pairs per token (the backlog's prompts are
        not split by position in the report)."""
        total = self.load.queued_prefill_tokens + self.unreported_tokens
        if total <= 0 or tokens <= 0:
            return 0.0
        pairs = self.load.queued_prefill_pairs + self.unreported_pairs
        return pairs if tokens >= total else pairs * tokens / total

    def prefill_ahead(self, tenant: str | None, priority: int | None = None,
                      deadline_ns: int = 0) -> int:
        """The prefill the scheduler computes before a new request of ``tenant`` whose
        class has ``priority`` and whose first token is due by ``deadline_ns`` (wall clock,
        0: none) starts. It includes what admission let in since the scheduler's last
        report, which that report could not count (as waiting, at its tenant and class).
        Of the tenant's own such prompts of the request's class, those due later than it
        are not ahead: the scheduler starts a tenant's work of one class earliest deadline
        first (``Queues.fair_order``), so a long prompt admitted with a stretched
        deadline a moment before a burst of short ones starts after them. (Its reported
        waiting work is counted whole: the report does not split it by deadline.)

        ``scheduler.fairness = "fcfs"`` (or no tenant, or a report without the per-tenant
        split): all of it, the scheduler's whole backlog, as the scheduler serves arrivals
        in order. ``"vtc"``: the scheduler's order (``Queues.fair_order``). Work back
        from preemption starts first: all of it is ahead. Fresh work starts by class first:
        every tenant's work of a more important class (aged, as the report ranks it) is
        ahead, none of a less important one. Within the request's class, VTC: new work
        starts from the tenant with the lowest virtual counter, each start charges its
        prompt to its tenant (÷ its weight), and a tenant the scheduler does not count as
        backlogged (VTC: nothing waiting) is lifted to the lowest counter among those it
        does. Let ``T`` be where the tenant's counter stands when this request is picked:
        its counter (lifted) plus its own waiting prefill of this class or a more
        important one ÷ its weight. Ahead of the request are that own prefill (a tenant's
        work starts in class order, then arrival), and of each other tenant ``u`` of this
        class what VTC starts before its counter reaches ``T``: ``(T − c_u) × w_u`` tokens,
        at most all it waits with, ``c_u`` counting its more important work, which starts
        first and charges it. A tenant tied with ``T`` (as a light tenant lifted to a
        flood's counter is) puts nothing ahead: the scheduler splits the step's new prompts
        between tied tenants. Counting every waiting tenant with ``c_u <= T`` in full would
        price that light tenant behind the whole flood.

        Prompts in progress rank as new work does, by (class, counter): while this request
        heads the queue, those of a more important class, and those of its class whose
        tenant's counter is ``<= T``, are computed before it each step; the others go after
        its new work. So a batch flood, waiting or in progress, puts nothing ahead of an
        interactive request until it has aged into the interactive class.

        Without ``priority``, or for a tenant the report does not split by class (an older
        scheduler), the work is ranked as one class with the request's.

        An estimate: it leaves out the output charges that move the counters while requests
        wait, the token rates (a tenant past its rate starts after the others), aging while
        the request waits, the rounding to whole requests, the steps already planned and
        the changes since the report (up to 100 ms old)."""
        load = self.load
        fifo = load.queued_prefill_tokens + self.unreported_tokens
        if tenant is None or self.fairness != "vtc" or (load.waiting and not load.tenants):
            return fifo
        backlog = load.tenants
        p = 0 if priority is None else priority
        waiting: dict[str, dict[int, int]] = {}
        running: dict[str, dict[int, int]] = {}
        resumed = 0
        for u, b in backlog.items():
            fresh = b.queued_prefill_tokens - b.resumed_prefill_tokens
            split = priority is not None and sum(b.queued_by_class.values()) == fresh \
                and sum(b.running_by_class.values()) == b.running_prefill_tokens
            waiting[u] = dict(b.queued_by_class) if split else {p: fresh}
            running[u] = b.running_by_class if split else {p: b.running_prefill_tokens}
            resumed += b.resumed_prefill_tokens
        for (u, level), n in self._unreported.items():
            level = p if priority is None else level
            waiting.setdefault(u, {})
            waiting[u][level] = waiting[u].get(level, 0) + n
        if deadline_ns and priority is not None:
            later = sum(n for u, level, due, n in self._unreported_due
                        if u == tenant and level == p and (due or _NEVER) > deadline_ns)
            if later:
                waiting[tenant][p] -= later
        backlogged = {u for u, b in backlog.items() if b.backlogged} | \
            {u for u, _ in self._unreported}

        def counter(u: str) -> float:
            b = backlog.get(u)
            return b.counter if b is not None else 0.0

        w_in = self.vtc.w_in
        at = counter(tenant)
        if tenant not in backlogged:           # lifted when it becomes backlogged
            at = max(at, min((counter(u) for u in backlogged), default=at))
        own = sum(n for level, n in waiting.get(tenant, {}).items() if level <= p)
        at += own * w_in / self.vtc.weight(tenant)
        # a report's split covers its whole backlog; anything it did not attribute counts
        ahead = max(load.queued_prefill_tokens - sum(b.queued_prefill_tokens
                                                     + b.running_prefill_tokens
                                                     for b in backlog.values()), 0)
        ahead += resumed + own
        others = 0.0
        for u, levels in waiting.items():
            if u == tenant:
                continue
            before = sum(n for level, n in levels.items() if level < p)
            ahead += before
            c_u = counter(u) + before * w_in / self.vtc.weight(u)
            if levels.get(p, 0) and c_u < at:
                others += min(levels[p], (at - c_u) * self.vtc.weight(u) / w_in)
        for u, levels in running.items():
            served = counter(u) <= at
            ahead += sum(n for level, n in levels.items() if level < p or (level == p and served))
        return ahead + math.ceil(others)

    def on_load(self, load: SchedulerLoad, now: float | None = None) -> None:
        """The scheduler's backlog report (every 100 ms): it now counts what was admitted
        before it.

        It also lists how long each request without a first token has waited. The learned
        bias hears of a miss only at its first token, a whole TTFT after the conditions
        that caused it: at the start of a burst every request admitted in that time would
        miss alike. So the bias has a floor, read from the last ``RECENT`` admitted
        requests: the 90th percentile of their misses, where a request still waiting counts
        with what it has overrun so far (a lower bound of its miss, so the floor is a lower
        bound of that percentile). It falls again as soon as recent requests meet their
        predictions, and a final miss stops counting ``RECENT_S`` after it became known
        (``now``), so a floor raised by a burst cannot outlive it when nothing new is
        admitted.

        Nor can it outlive the backlog: a report of a drained engine (nothing running,
        waiting or awaiting a first token, nothing admitted since the last report) drops
        every final miss at once. Those misses were the backlog's; a floor kept after it
        has drained refused every request for RECENT_S (on two cores, 1.5 s added to a
        0.12 s prediction: 3 s of a flood refused at 40 requests/s by an idle engine, the
        flood's goodput 1.8 requests/s where the engine serves 8-12)."""
        drained = (load.running == 0 and load.waiting == 0 and load.queued_prefill_tokens == 0
                   and not load.awaiting_first_s and self.unreported_tokens == 0)
        self.load = load
        self.unreported_tokens = 0
        self.unreported_pairs = 0
        self._unreported.clear()
        self._unreported_due.clear()
        if drained:
            for rid in [r for r, e in self._recent.items() if e.known_at is not None]:
                del self._recent[rid]
            self._recent_order = deque(r for r in self._recent_order if r in self._recent)
        for rid, waited in load.awaiting_first_s.items():
            entry = self._recent.get(rid)
            if entry is not None and entry.known_at is None:
                entry.miss_s = waited - entry.predicted_s
        misses = sorted((e.miss_s for e in self._recent.values() if e.miss_s is not None
                         and (now is None or e.known_at is None
                              or now - e.known_at <= RECENT_S)), reverse=True)
        self.floor_s = max(misses[math.ceil(len(misses) / 10) - 1], 0.0) \
            if len(misses) >= RECENT_MIN else 0.0
        # the correction fades toward 1 (half-life ~1.4 s of reports) unless observations
        # keep it up: a factor learned in a burst must not refuse everything after it
        if not self._observed:
            self.learned_s *= 0.95
        self._observed = False

    def admitted(self, request_id: str, tenant: str, uncached_tokens: int,
                 predicted_s: float | None, cached_tokens: int = 0, priority: int = 0,
                 deadline_ns: int = 0) -> None:
        """A request of class ``priority``, due by ``deadline_ns`` (0: none), admitted with
        ``predicted_s`` (the backlog model's TTFT, None before the rates are measured): its
        prefill (``uncached_tokens`` after ``cached_tokens``) is ahead of later requests its
        class ranks before (of its own tenant's, those due no earlier) until the next
        report counts it, and its miss counts toward the floor."""
        self.unreported_tokens += uncached_tokens
        self.unreported_pairs += row_pairs(uncached_tokens, cached_tokens)
        self._unreported[tenant, priority] += uncached_tokens
        self._unreported_due.append((tenant, priority, deadline_ns, uncached_tokens))
        if predicted_s is None:
            return
        self._recent[request_id] = _Recent(predicted_s)
        self._recent_order.append(request_id)
        if len(self._recent_order) > RECENT:
            self._recent.pop(self._recent_order.popleft(), None)

    def ended(self, request_id: str, now: float, ttft_s: float | None,
              predicted_s: float | None) -> None:
        """A request let go at ``now``, with the TTFT the engine saw (arrival → first token;
        None without one) against its prediction. The learned bias is an upper expectile of
        the misses (observed − predicted; it fades when nothing is observed): the model
        sees only the scheduler's backlog, not the time a request spends in the other
        processes, nor CPU contention between them."""
        entry = self._recent.get(request_id)
        if entry is not None and entry.known_at is None:
            entry.known_at = now             # ended; a first token below corrects its miss
        if ttft_s is None or predicted_s is None:
            return
        # an upper expectile of the misses, not their mean: a miss above the bias moves it
        # 10x as far as one below, so the bias settles near the 90th percentile of the
        # error and ~95% of the admitted meet the deadline
        miss = ttft_s - predicted_s
        if entry is not None:
            entry.miss_s = miss
        rate = BIAS_UP if miss > self.learned_s else BIAS_DOWN
        self.learned_s = max(self.learned_s + rate * (miss - self.learned_s), 0.0)
        self._observed = True

    def forget_all(self) -> None:
        """The scheduler restarted: no admitted request's miss is pending any more."""
        self._recent.clear()
        self._recent_order.clear()
