"""Per-tenant delivered service, charged the way the Virtual Token Counter (VTC) charges it,
and the fairness gap between tenants that are backlogged at the same time.

A request's service is its prompt tokens × 1 plus its output tokens × 2, divided by the
tenant's weight. The prompt is charged when the request is first scheduled, as VTC charges it
on admission to the batch (at its first token where the record has no queue time), each
output token at the moment it arrived.

A tenant is *backlogged* while it has work waiting to be served, as in VTC: a request counts
from when it was sent until it was first scheduled (``sent_s + queue_s``, the engine's queue
time), less its ingress (``ingress_s``: tokenization, the prefix-cache lookup and the hops
between processes, which no queue's order decides; on 2 cores under load these are where a
busy core makes a request wait before any queue holds it). Where the engine also reports
its prefill time (first scheduled to first token), the wait is placed where the engine had
it: it ends that long before the first token arrived and began the queued part of
``queue_s`` before that. A request the client sent late, or the engine took in late
(a busy client or a descheduled ingress), was not there to be scheduled, so the scheduler is
not charged for others served meanwhile: on 2 cores, a 0.3 s delay between a send and the
engine's arrival read as a 2.7x larger gap under VTC. Where a record has no queue time (HTTP
targets report none) its first token stands in; a request that never started (rejected
after waiting in admission's queue, cancelled, failed) waited until its terminal event. A
request that is running is service, not backlog: a tenant whose work is all running is not
backlogged, so it is never compared at an instant where the scheduler had nothing of it to
choose.

The gap follows VTC. Each tenant has a counter that accrues its weighted service. A tenant that
becomes backlogged is lifted to the smallest counter among the tenants already backlogged, or,
when none is, to the counter of the last tenant to stop being backlogged: idle time earns no
credit, and service received alone is no debt. The gap is the largest spread (max − min) of
counters among backlogged tenants, over every instant at which something happens.

Everything here is pure: records in, events out, numbers out."""
from __future__ import annotations

import math
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Sequence
from itertools import accumulate
from typing import NamedTuple

from weir.replay.types import REJECTED, RequestRecord

INPUT_COST, OUTPUT_COST = 1.0, 2.0

# event kinds, numbered in the order they are applied at one instant
ARRIVE, SERVE, LEAVE, ADMIT = 0, 1, 2, 3    # LEAVE: a request stops waiting (first scheduled);
                                            # ADMIT: its prompt, charged as it starts


class Event(NamedTuple):
    """Something that changes a tenant's backlog or counter at time ``t`` (seconds). The
    functions below take and return events as plain ``(t, kind, tenant, amount)`` tuples
    (``Events``): building two million named tuples costs seconds; this is their named form."""

    t: float
    kind: int               # ARRIVE | SERVE | LEAVE | ADMIT
    tenant: str
    amount: float = 0.0     # weighted service, for SERVE and ADMIT


Events = list[tuple[float, int, str, float]]


def terminal_time(rec: RequestRecord) -> float:
    """When the request stopped being outstanding: its terminal event (or its last token, or
    when it was sent, where the record lacks one). A request rejected at once ends when sent."""
    if rec.e2e_s is not None:
        end = rec.sent_s + rec.e2e_s
    elif rec.terminal == REJECTED:
        end = rec.sent_s
    else:
        end = max(rec.token_times, default=rec.sent_s)
    return max(end, rec.sent_s)


def backlog_span(rec: RequestRecord) -> tuple[float, float]:
    """When the request waited to be scheduled, ``(start, end)``, never before it was sent.
    With the engine's queue and prefill times and a first token, ``end`` is the first token
    less the prefill time (first scheduled, on the client's clock) and ``start`` is ``end``
    less the time a queue held it: the queue time less its ingress (the tokenizer, the
    cache lookup and the hops between processes, which no queue's order decides). With a
    queue time only, from the send plus its ingress until ``sent_s + queue_s``; else from
    the send until its first token, else its terminal event."""
    start = rec.sent_s
    if rec.queue_s is not None:
        ingress = min(rec.ingress_s or 0.0, rec.queue_s)
        if rec.prefill_s is not None and rec.ttft_s is not None:
            end = max(rec.sent_s + rec.ttft_s - rec.prefill_s, start)
            return max(end - (rec.queue_s - ingress), start), end
        return start + ingress, start + rec.queue_s
    end = rec.sent_s + rec.ttft_s if rec.ttft_s is not None else terminal_time(rec)
    return start, max(end, start)


def backlog_end(rec: RequestRecord) -> float:
    """When the request stopped waiting (first scheduled; ``backlog_span``)."""
    return backlog_span(rec)[1]


def backlog_intervals(records: Iterable[RequestRecord], tenant: str | None = None
                      ) -> list[tuple[float, float]]:
    """The times at which ``tenant`` (any tenant, with None) had a request waiting: the union
    of its requests' ``backlog_span``, merged and sorted."""
    spans = sorted(backlog_span(rec) for rec in records
                   if tenant is None or rec.tenant == tenant)
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def overlap_s(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Total time covered by both ``a`` and ``b`` (each a sorted list of disjoint intervals)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def service_events(records: Iterable[RequestRecord],
                   weights: dict[str, float] | None = None) -> Events:
    """The backlog and service events of ``records``, sorted (by time, then kind). Output tokens
    that have no arrival time of their own (n > 1, or missing gaps) are delivered at the
    terminal event."""
    weights = weights or {}
    events: Events = []
    for rec in records:
        tenant, weight = rec.tenant, weights.get(rec.tenant, 1.0)
        if not weight > 0:
            raise ValueError(f"tenant {tenant!r}: weight must be > 0, got {weight}")
        came, waited = backlog_span(rec)
        if waited > came:
            events.append(Event(came, ARRIVE, tenant))
            events.append(Event(waited, LEAVE, tenant))
        if rec.ttft_s is not None and rec.prompt_tokens > 0:
            prompt = INPUT_COST * rec.prompt_tokens / weight
            if rec.queue_s is not None:             # charged as it starts, like VTC
                events.append(Event(waited, ADMIT, tenant, prompt))
            else:                                   # delivered with its first token
                events.append(Event(rec.sent_s + rec.ttft_s, SERVE, tenant, prompt))
        times = rec.token_times[:rec.output_tokens]
        token = OUTPUT_COST / weight
        events.extend([(t, SERVE, tenant, token) for t in times])
        rest = rec.output_tokens - len(times)
        if rest > 0:
            events.append(Event(terminal_time(rec), SERVE, tenant, token * rest))
    # one instant is one time: a time reached by different sums (sent + queue, sent + ttft
    # + gaps) must compare equal, so times are kept to the nanosecond (the engines' clock)
    events = [(round(t, 9), kind, u, amount) for t, kind, u, amount in events]
    events.sort()
    return events


def max_backlogged_gap(events: Iterable[tuple[float, int, str, float]]) -> float:
    """VTC's fairness measure over ``events`` (any order).

    At each instant: arrivals first (a tenant that was not backlogged is lifted to the floor
    taken *before* this instant's arrivals, so simultaneous arrivals do not lift each other),
    then service delivered (``SERVE``: the work of the step that ends now), then the
    measurement, then departures, then the prompts charged as requests are first scheduled
    (``ADMIT``: the work of the step that starts now, measured at the next instant). So a
    tenant whose last waiting request is scheduled at ``t`` is compared at ``t`` with what the
    step that just ended gave everyone, and not against what the others start as it leaves.
    A tenant that becomes backlogged when none is is lifted to the current counter of the
    last tenant to leave."""
    counter: dict[str, float] = defaultdict(float)
    open_: dict[str, int] = defaultdict(int)       # requests waiting, per tenant
    active: set[str] = set()                        # tenants with open_ > 0: backlogged
    last_left: list[str] = []                       # who stopped being backlogged last
    left_at: float | None = None
    gap = 0.0

    def measure() -> None:
        nonlocal gap
        if len(active) >= 2:
            now = [counter[u] for u in active]
            gap = max(gap, max(now) - min(now))

    instant: float | None = None
    measured = floor_taken = False
    floor: float | None = None
    for t, kind, tenant, amount in sorted(events):  # within an instant: by kind
        if t != instant:
            if instant is not None and not measured:
                measure()
            instant, measured, floor_taken = t, False, False
        if kind == ARRIVE:
            if not floor_taken:                     # taken once, before the first arrival
                floor = (min(counter[u] for u in active) if active else
                         max((counter[u] for u in last_left), default=None))
                floor_taken = True
            if open_[tenant] == 0:
                if floor is not None:
                    counter[tenant] = max(counter[tenant], floor)
                active.add(tenant)
            open_[tenant] += 1
        elif kind == SERVE:
            counter[tenant] += amount
        else:
            if not measured:
                measure()
                measured = True
            if kind == LEAVE:
                open_[tenant] -= 1
                if open_[tenant] == 0:
                    active.discard(tenant)
                    if left_at != t:
                        last_left, left_at = [], t
                    last_left.append(tenant)
            else:                                   # ADMIT
                counter[tenant] += amount
    if instant is not None and not measured:
        measure()
    return gap


def time_grid(start: float, end: float, step: float) -> list[float]:
    """``start``, ``start + step``, … strictly below ``end``, then ``end`` itself."""
    if not step > 0:
        raise ValueError(f"grid step must be > 0, got {step}")
    n = max(0, math.ceil((end - start) / step - 1e-9))
    return [start + k * step for k in range(n)] + [end]


def service_curves(events: Iterable[tuple[float, int, str, float]], tenants: Sequence[str],
                   grid: Sequence[float]) -> dict[str, list[tuple[float, float]]]:
    """Each tenant's cumulative weighted service at every grid time (service at ``t`` counts
    at grid times ≥ ``t``). Tenants that received nothing get a flat zero curve."""
    served: dict[str, Events] = {u: [] for u in tenants}
    for e in sorted(events):
        if e[1] in (SERVE, ADMIT):
            served.setdefault(e[2], []).append(e)
    curves = {}
    for u in sorted(served):
        times = [e[0] for e in served[u]]
        totals = [0.0, *accumulate(e[3] for e in served[u])]
        curves[u] = [(g, totals[bisect_right(times, g)]) for g in grid]
    return curves
