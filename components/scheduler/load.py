"""What the scheduler reports to admission a few times a second: its backlog, and the rates
the step-cost model measured, so admission can predict time to first token; the pool's free
and evictable blocks and what the decode steps measured, so it can reserve against the live
pool and keep the running streams within their TPOT. Shared by the scheduler service and
the replay simulator."""
from __future__ import annotations

import heapq
from typing import NamedTuple

from components.costs.cost_model import StepCostModel, decode_shape, prefill_shape, row_pairs
from components.scheduler.chunking import step_budget
from components.scheduler.core import Outcome, SchedulerCore
from components.scheduler.decode_window import DecodeWindow
from schemas.wire import DecodeRates, SchedulerLoad, TenantBacklog

LOAD_INTERVAL_S = 0.1
AWAITING_MAX = 256          # requests listed by age in a report (the oldest)


def released_outputs(out: Outcome) -> dict[str, int]:
    """Output tokens of each request that finished in ``out`` (every choice summed), for
    admission's expected-output estimate."""
    done: dict[str, int] = {}
    for t in out.tokens:
        if t.finish_reason is not None and t.usage is not None:
            done[t.request_id] = done.get(t.request_id, 0) + t.usage.completion_tokens
    return {rid: done[rid] for rid in out.released if rid in done}


def released_ttft(out: Outcome) -> dict[str, float]:
    """Arrival → first token of each request that finished in ``out``, for admission to
    check its TTFT predictions against."""
    return {t.request_id: t.timing.queue_s + t.timing.prefill_s for t in out.tokens
            if t.finish_reason is not None and t.timing is not None and t.index == 0
            and t.request_id in out.released}


def backlog_tokens(core: SchedulerCore) -> dict[str, float]:
    """The work the engine holds, in tokens, for the autoscaler (the router exports it,
    docs/deploy.md): ``backlog.prefill_tokens``, the prompt (and recomputed) tokens every
    sequence, waiting or running, has still to compute; ``backlog.decode_tokens``, the
    output tokens they may still sample at most (each choice up to its ``max_tokens``, else
    up to ``max_model_len``)."""
    prefill = decode = 0
    for s in (*core.waiting, *core.running):
        prefill += s.remaining
        cap = s.params.max_tokens
        room = core.max_model_len - s.num_tokens
        left = room if cap is None else min(cap - s.num_output, room)
        decode += max(left, 0) * s.slots
    return {"backlog.prefill_tokens": prefill, "backlog.decode_tokens": decode}


class PoolCounts(NamedTuple):
    """The kv_manager's pool as it last said (``KvGrants``); -1: not said yet."""

    free_blocks: int = -1
    evictable_blocks: int = -1


def load_report(core: SchedulerCore, cost: StepCostModel, budget: int,
                now_ns: int | None = None, window: DecodeWindow | None = None,
                pool: PoolCounts = PoolCounts(), slack: bool = False) -> SchedulerLoad:
    """The backlog (waiting prefill, and what running sequences have left to prefill, in
    tokens and in attention pairs), the cost model's rates (a full chunk's tokens at zero
    context, attention priced apart per pair, and a decode step of the running batch, and
    its decode rates), and per tenant its virtual counter and both parts of the backlog,
    each split by the class it ranks with (aged at ``now_ns``; as admitted without it) and
    the waiting part back from preemption apart, so admission can tell which of it the
    fair order computes before a new request of a given tenant and class.
    With ``now_ns`` (wall clock, as arrivals are stamped): how long each request without a
    first token has waited since it arrived. With ``window``: what the decode steps of its
    last seconds measured (expired to ``now_ns``). ``pool``: the kv_manager's counts.
    ``slack``: the scheduler chunks stall-free, so the report carries the step's prefill
    budget beside the decoding streams (chunking.step_budget), which a burst of new prompts
    waits behind at that pace."""
    # one pass over each queue (a deep queue is when admission needs this most, and the
    # replay simulator builds one every 0.1 s of virtual time)
    timed = now_ns is not None
    first: list[tuple[int, str]] = []       # (arrival, request) without a first token
    clock = now_ns or 0
    waiting: dict[str, int] = {}
    resumed: dict[str, int] = {}
    waiting_by: dict[str, dict[int, int]] = {}  # tenant -> aged class -> fresh prefill
    pairs = 0
    for s in core.waiting:
        left = s.remaining
        waiting[s.tenant] = waiting.get(s.tenant, 0) + left
        if s.resumes:
            resumed[s.tenant] = resumed.get(s.tenant, 0) + left
        else:
            by = waiting_by.setdefault(s.tenant, {})
            level = s.aged_priority(clock)
            by[level] = by.get(level, 0) + left
        pairs += row_pairs(left, s.num_computed)
        if timed and not s.first_token_ns:
            first.append((s.arrival_ns, s.request_id))
    running: dict[str, int] = {}
    running_by: dict[str, dict[int, int]] = {}
    context = 0
    for s in core.running:
        context += s.num_tokens
        left = s.remaining
        if left > 1:
            running[s.tenant] = running.get(s.tenant, 0) + left
            by = running_by.setdefault(s.tenant, {})
            level = s.aged_priority(clock)
            by[level] = by.get(level, 0) + left
            pairs += row_pairs(left, s.num_computed)
        if timed and not s.first_token_ns:
            first.append((s.arrival_ns, s.request_id))
    # backlogged: the tenants with work waiting, those the core does not lift on a new
    # request (Queues.backlogged_tenants(), without a second pass over the queue)
    tenants = {t: TenantBacklog(core.vtc.of(t), t in waiting, waiting.get(t, 0),
                                running.get(t, 0), resumed.get(t, 0), waiting_by.get(t, {}),
                                running_by.get(t, {}))
               for t in set(core.vtc.counters) | set(waiting) | set(running)}
    # priced in the plan the steps run: the batch-invariant one while a deterministic
    # request is held
    det = any(s.deterministic for s in core.running) or any(
        s.deterministic for s in core.waiting)
    chunk_s = cost.predict(prefill_shape(budget)._replace(pairs=0), det)
    n_running = len(core.running)
    decode_s = cost.predict(decode_shape(n_running or 1, context), det)
    awaiting = {rid: max(now_ns - arrival, 0) / 1e9
                for arrival, rid in heapq.nsmallest(AWAITING_MAX, first)}
    rates = cost.decode_rates()
    scale = cost.deterministic_factor() if det else 1.0
    if rates is not None and det:
        rates = tuple(r * scale for r in rates)
    if window is not None and now_ns is not None:
        window.expire(now_ns)
    return SchedulerLoad(n_running, len(core.waiting),
                         sum(waiting.values()) + sum(running.values()),
                         budget / chunk_s if chunk_s > 0 else 0.0, decode_s, tenants, awaiting,
                         cost.pair_s() * scale if chunk_s > 0 else 0.0, pairs,
                         pool.free_blocks, pool.evictable_blocks, context,
                         DecodeRates(*rates) if rates is not None else None,
                         window.measured_s() if window else 0.0,
                         window.error() if window else 1.0,
                         window.tpot_s() if window else {},
                         window.pure_steps if window else -1,
                         step_budget(core, cost, budget, now_ns=now_ns).tokens if slack else 0,
                         det, cost.deterministic_factor())
