"""What the scheduler tells OpenTelemetry: per-request queue / prefill-chunk / decode spans
in each request's trace, and one ``scheduler.step`` span per step on the engine's own trace,
linked to every request in the step, carrying the step's decisions as attributes. With
steps overlapped (``scheduler.async_depth`` 2) two steps' spans may be open at once."""
from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span

from bus import tracing
from components.scheduler.loop import SchedulerLoop, StepDone
from schemas.wire import StepPlan, TokenOut

_TRACER = trace.get_tracer("weir.scheduler")


class StepTracer:
    def __init__(self, loop: SchedulerLoop, token_budget: int) -> None:
        self.loop = loop
        self.core = getattr(loop, "core", None)
        self.budget = token_budget
        self.traceparents: dict[str, str | None] = {}   # request → root span, for other processes
        self._contexts: dict[str, Context | None] = {}  # the same, parsed once
        self._queue: dict[str, Span] = {}
        self._decode: dict[str, Span] = {}
        self._prefill: dict[int, list[Span]] = {}   # step id -> its prefill chunk spans
        self._steps: dict[int, Span] = {}           # step id -> its scheduler.step span

    def _ctx(self, rid: str) -> Context | None:
        return self._contexts.get(rid)

    def admitted(self, rid: str, traceparent: str | None) -> None:
        self.traceparents[rid] = traceparent
        self._contexts[rid] = tracing.context_from(traceparent)
        self._queue[rid] = _TRACER.start_span("queue", context=self._ctx(rid))

    def planned(self, plan: StepPlan) -> str | None:
        """Open the step's spans; returns the step span's traceparent for the executor."""
        rids, tokens, chunks, links = [], [], [], []
        num_decode = 0
        step = self.loop.steps.get(plan.step_id)
        if step is None:                 # discarded already (a reset while it was sent)
            return None
        prefill = self._prefill.setdefault(plan.step_id, [])
        for st, (rid, start, prompt_len) in zip(plan.steps, step.rows):
            rids.append(rid)
            tokens.append(st.num_tokens)
            if (q := self._queue.pop(rid, None)) is not None:
                q.end()
            decode = st.num_tokens == 1 and start >= prompt_len
            num_decode += decode
            if not decode:
                chunks.append(st.num_tokens)
                prefill.append(_TRACER.start_span("prefill", context=self._ctx(rid), attributes={
                    "weir.step.id": plan.step_id, "weir.prefill.chunk_tokens": st.num_tokens,
                    "weir.prefill.start_token": start,
                    "weir.prefill.prompt_tokens": prompt_len}))
            if (ctx := self._ctx(rid)) is not None:
                links.append(Link(trace.get_current_span(ctx).get_span_context()))
        used = sum(tokens)
        choice = step.budget
        span = self._steps[plan.step_id] = _TRACER.start_span(
            "scheduler.step", context=Context(), links=links[:256], attributes={
            "weir.step.id": plan.step_id, "weir.config.version": self.loop.config_version,
            "weir.step.num_decode": num_decode,
            "weir.step.num_prefill": len(tokens) - num_decode,
            "weir.step.request_ids": rids, "weir.step.seq_tokens": tokens,
            "weir.step.token_budget": choice.tokens if choice else self.budget,
            "weir.step.budget_reason": choice.reason if choice else "fixed",
            "weir.step.tightest_tpot_ms": round(choice.tightest_tpot_s * 1e3, 2)
            if choice and choice.tightest_tpot_s else -1.0,
            "weir.step.tokens_used": used,
            "weir.step.chunk_sizes": chunks, "weir.step.context_tokens": step.shape.context,
            "weir.step.predicted_ms": round(step.predicted_s * 1e3, 3),
            "weir.step.in_flight_before": step.in_flight_before,
            "weir.step.free_kv_blocks": self.loop.free_blocks,
            "weir.step.running": len(self.core.running),
            "weir.step.waiting": len(self.core.waiting),
            "weir.step.preemptions": len(step.preempted)})
        if (spec := step.speculation) is not None:
            span.set_attributes({
                "weir.spec.k": [spec.k.get(st.seq_id, 0) for st in plan.steps],
                "weir.spec.reason": spec.reason,
                "weir.spec.acceptance": [round(spec.acceptance.get(st.seq_id, -1.0), 3)
                                         for st in plan.steps],
                "weir.spec.budget_left": spec.budget_left,
                "weir.spec.predicted_base_ms": round(spec.base_s * 1e3, 3),
                "weir.spec.predicted_ms": round(spec.with_drafts_s * 1e3, 3),
                "weir.spec.expected_tokens": round(spec.expected_tokens, 3)})
        for p in step.preempted:
            span.add_event("preemption", {
                "weir.victim": p.request_id, "weir.victim.choice_index": p.index,
                "weir.reason": p.reason, "weir.choice": p.choice,
                "weir.wasted_tokens": p.wasted_tokens,
                "weir.estimate.recompute_ms": round(p.recompute_s * 1e3, 3),
                "weir.estimate.swap_ms": round(min(p.swap_s, 1e9) * 1e3, 3)})
        for u in step.urgency:
            span.add_event("urgency", {
                "weir.request": u.request_id, "weir.victim": u.victim,
                "weir.preempted": u.preempted, "weir.reason": u.reason,
                "weir.estimate.intervention_ms": round(u.intervention_s * 1e3, 3),
                "weir.estimate.lateness_avoided_ms": round(u.lateness_avoided_s * 1e3, 3)})
        return tracing.traceparent_of(span)

    def finished_step(self, done: StepDone) -> None:
        # steps answer in order: an older step still open was discarded by a reset
        for step_id in [s for s in self._steps if s < done.step_id]:
            self._end(step_id, {"weir.step.discarded": True})
        attrs = {"weir.step.measured_ms": round(done.measured_s * 1e3, 3),
                 "weir.step.executor_ms": round(done.executor_s * 1e3, 3)}
        if done.drafts:                  # per speculating row: drafted and accepted
            attrs["weir.spec.drafted"] = [d for _, d, _ in done.drafts]
            attrs["weir.spec.accepted"] = [a for _, _, a in done.drafts]
            attrs["weir.spec.rows"] = [sid for sid, _, _ in done.drafts]
        self._end(done.step_id, attrs)

    def _end(self, step_id: int, attributes: dict) -> None:
        for span in self._prefill.pop(step_id, ()):
            span.end()
        if (span := self._steps.pop(step_id, None)) is not None:
            span.set_attributes(attributes)
            span.end()

    def outputs(self, items: list[TokenOut]) -> None:
        for item in items:
            rid = item.request_id
            if item.params is not None and rid not in self._decode:
                self._decode[rid] = _TRACER.start_span("decode", context=self._ctx(rid))
            if item.finish_reason is not None and (span := self._decode.pop(rid, None)):
                span.set_attributes({"gen_ai.usage.output_tokens": item.usage.completion_tokens,
                                     "gen_ai.response.finish_reasons": (item.finish_reason,)})
                span.end()

    def released(self, rids: list[str]) -> None:
        for rid in rids:
            for spans in (self._queue, self._decode):
                if (span := spans.pop(rid, None)) is not None:
                    span.set_attribute("weir.ended", "released")
                    span.end()
            self.traceparents.pop(rid, None)
            self._contexts.pop(rid, None)
