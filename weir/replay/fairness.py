"""Per-tenant delivered service, charged the way the Virtual Token Counter (VTC) charges it,
and the fairness gap between tenants that are backlogged at the same time.

A request's service is its prompt tokens × 1, delivered at its first token, plus its output
tokens × 2, each at the moment it arrived; the sum is divided by the tenant's weight. A tenant is
*backlogged* from a request's arrival until that request's terminal event.

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
ARRIVE, SERVE, LEAVE = 0, 1, 2


class Event(NamedTuple):
    """Something that changes a tenant's backlog or counter at time ``t`` (seconds). The
    functions below take and return events as plain ``(t, kind, tenant, amount)`` tuples
    (``Events``): building two million named tuples costs seconds; this is their named form."""

    t: float
    kind: int               # ARRIVE | SERVE | LEAVE
    tenant: str
    amount: float = 0.0     # weighted service, for SERVE


Events = list[tuple[float, int, str, float]]


def terminal_time(rec: RequestRecord) -> float:
    """When the request stopped being outstanding: at arrival for a rejected one, else at its
    terminal event (or its last token, or when it was sent, where the record lacks one)."""
    if rec.terminal == REJECTED:
        return rec.arrival_s
    if rec.e2e_s is not None:
        end = rec.sent_s + rec.e2e_s
    else:
        end = max(rec.token_times, default=rec.sent_s)
    return max(end, rec.arrival_s)


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
        end = terminal_time(rec)
        if end > rec.arrival_s:
            events.append(Event(rec.arrival_s, ARRIVE, tenant))
            events.append(Event(end, LEAVE, tenant))
        if rec.ttft_s is not None and rec.prompt_tokens > 0:
            first = rec.sent_s + rec.ttft_s
            events.append(Event(first, SERVE, tenant, INPUT_COST * rec.prompt_tokens / weight))
        times = rec.token_times[:rec.output_tokens]
        token = OUTPUT_COST / weight
        events.extend([(t, SERVE, tenant, token) for t in times])
        rest = rec.output_tokens - len(times)
        if rest > 0:
            events.append(Event(end, SERVE, tenant, token * rest))
    events.sort()
    return events


def max_backlogged_gap(events: Iterable[tuple[float, int, str, float]]) -> float:
    """VTC's fairness measure over ``events`` (any order).

    At each instant: arrivals first (a tenant that was not backlogged is lifted to the floor
    taken *before* this instant's arrivals, so simultaneous arrivals do not lift each other),
    then service, then the measurement, then departures; a tenant whose request ends at ``t``
    has been served at ``t`` and is still compared at ``t``."""
    counter: dict[str, float] = defaultdict(float)
    open_: dict[str, int] = defaultdict(int)       # requests outstanding, per tenant
    active: set[str] = set()                        # tenants with open_ > 0
    last_left: float | None = None
    gap = 0.0
    leaving: list[str] = []

    def close_instant() -> None:                    # measure, then let this instant's leavers go
        nonlocal gap, last_left
        if len(active) >= 2:
            now = [counter[u] for u in active]
            gap = max(gap, max(now) - min(now))
        left = []
        for u in leaving:
            open_[u] -= 1
            if open_[u] == 0:
                active.discard(u)
                left.append(counter[u])
        if left:
            last_left = max(left)
        leaving.clear()

    instant = floor_at = None
    floor: float | None = None
    for t, kind, tenant, amount in sorted(events):  # within an instant: ARRIVE, SERVE, LEAVE
        if t != instant:
            if instant is not None:
                close_instant()
            instant = t
        if kind == SERVE:
            counter[tenant] += amount
        elif kind == ARRIVE:
            if floor_at != t:                       # taken once, before the first arrival
                floor = min(counter[u] for u in active) if active else last_left
                floor_at = t
            if open_[tenant] == 0:
                if floor is not None:
                    counter[tenant] = max(counter[tenant], floor)
                active.add(tenant)
            open_[tenant] += 1
        else:
            leaving.append(tenant)
    close_instant()
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
        if e[1] == SERVE:
            served.setdefault(e[2], []).append(e)
    curves = {}
    for u in sorted(served):
        times = [e[0] for e in served[u]]
        totals = [0.0, *accumulate(e[3] for e in served[u])]
        curves[u] = [(g, totals[bisect_right(times, g)]) for g in grid]
    return curves
