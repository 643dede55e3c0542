"""What the scheduler reports to admission a few times a second: its backlog, and the rates
the step-cost model measured, so admission can predict time to first token. Shared by the
scheduler service and the replay simulator."""
from __future__ import annotations

from components.scheduler.core import Outcome, SchedulerCore
from components.scheduler.cost_model import StepCostModel
from schemas.wire import SchedulerLoad

LOAD_INTERVAL_S = 0.1


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


def load_report(core: SchedulerCore, cost: StepCostModel, budget: int) -> SchedulerLoad:
    queued = sum(s.remaining for s in core.waiting) + sum(
        s.remaining for s in core.running if s.remaining > 1)
    chunk_s = cost.predict(budget, 0, 1)
    running = len(core.running)
    decode_s = cost.predict(running or 1, sum(s.num_tokens for s in core.running), running or 1)
    return SchedulerLoad(running, len(core.waiting), queued,
                         budget / chunk_s if chunk_s > 0 else 0.0, decode_s)
