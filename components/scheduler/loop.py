"""The scheduler service's logic, without the I/O: one inbound message in, the messages to
send out, in order.

The service (service.py) only receives, calls ``handle``, and sends; the randomized
whole-loop test drives this same object. After every message, whatever the core produced
is sent (detokenizer output, releases, KV ops), then new steps are planned and sent while
fewer than ``scheduler.async_depth`` are in flight. With depth 2 step N+1 is planned and
sent while step N runs, so the executor, which runs its inbox in order, starts N+1 as soon
as N is done instead of idling through the round trip and the planning; with depth 1 each
step waits for the previous one's result. The step-cost model lives in the core: each
finished step's measured time teaches it, and the stall-free budget (chunking.py), urgency
preemption and the load report read it. A step's own time is measured from when the
executor could start it, the later of its plan being sent and the previous result arriving,
to its result arriving.

``Send`` destinations are the peers' names, and every ``Send`` is a network send. Local
notes travel apart: ``finished`` holds the steps answered during the last call (each one's
measured times, for the service's span and step log), which the service reads before it
sends what that call returned."""
from __future__ import annotations

from typing import NamedTuple

import msgspec
import structlog

from components.costs.cost_model import StepShape, plan_shape
from components.scheduler.chunking import StepBudget, step_budget
from components.scheduler.core import SchedulerCore
from components.scheduler.decode_window import DecodeWindow, decode_classes
from components.scheduler.late import LateDrops
from components.scheduler.load import PoolCounts, load_report, released_outputs, released_ttft
from components.scheduler.output import Outcome
from components.scheduler.preemption import Preemption, UrgencyDecision
from components.scheduler.speculation import Choice
from components.scheduler.usage import UsageStats
from kernels.machine import usable_cores, usable_cpus
from schemas.client import STRUCTURED_OUTPUT_ERROR
from schemas.config import WeirConfig
from schemas.wire import (
    Admitted,
    CancelRequest,
    EventBatch,
    ExecutorReady,
    Failed,
    ForgetRequest,
    HeldRequest,
    Holding,
    KvGrants,
    KvHello,
    KvManagerUp,
    PolicyChange,
    Released,
    SchedulerLoad,
    StepPlan,
    StepResult,
    StopRequest,
    TokenBatch,
)

log = structlog.get_logger("scheduler")


class StepDone(NamedTuple):
    """A step answered: a local note for the service's span and step log, never sent."""

    shape: StepShape
    predicted_s: float
    measured_s: float          # max(plan sent, previous result received) -> result received
    executor_s: float          # the executor's own time for the step
    step_id: int = 0
    drafts: list[tuple[int, int, int]] = []    # (seq id, drafted, accepted) per verify


class PlannedStep(NamedTuple):
    """What the loop keeps of a step in flight, for its cost sample, its trace and log
    (taken when it is planned: a second plan in the same message changes the core)."""

    sent_ns: int               # monotonic clock, when the plan was sent
    shape: StepShape
    predicted_s: float
    budget: StepBudget | None  # the stall-free choice it was planned under
    rows: list[tuple[str, int, int]]   # per plan.steps: request id, start position, prompt
    in_flight_before: int      # steps already in flight when it was planned
    preempted: list[Preemption]
    urgency: list[UrgencyDecision]
    decode_classes: frozenset[str] = frozenset()   # the classes of the sequences it decodes
    plan: StepPlan | None = None           # speculating: its shape is taken again from the
    starts: dict[int, int] | None = None   # drafts the executor verified (``plan_shape``)
    speculation: Choice | None = None      # the planner's k per row and why
    deterministic: bool = False            # it runs the batch-invariant kernel plan


class Send(NamedTuple):
    to: str                    # "executor" | "kv_manager" | "detokenizer" | "admission" |
    msg: object                # "streamer"


def async_depth(config: WeirConfig, cpus: int | None = None,
                cores: int | None = None) -> int:
    """``scheduler.async_depth``, with 0 (auto) resolved: overlap only when the executor's
    torch threads (``engine.num_threads``, else one per core: ``usable_cores``) leave free a
    CPU of those this process may use (``usable_cpus``; an SMT sibling counts).
    Planning beside a forward that uses every core preempts one of its OpenMP threads, and
    the whole parallel region waits for it: on 2 cores, 64 x 128/64 bf16 at rate inf, depth
    2 gave 391 output tok/s against 411 at depth 1 (medians of 3; executor busy 10.2 s
    against 9.4 s for the same 68 steps)."""
    if config.scheduler.async_depth:
        return config.scheduler.async_depth
    cpus = usable_cpus() if cpus is None else cpus
    threads = config.engine.num_threads or (usable_cores() if cores is None else cores)
    return 2 if threads < cpus else 1


class SchedulerLoop:
    def __init__(self, config: WeirConfig, epoch: int) -> None:
        self.cfg = msgspec.structs.replace(config.scheduler, async_depth=async_depth(config))
        self.core = SchedulerCore(self.cfg, config.kv, config.engine.max_model_len,
                                  epoch=epoch, tenants=config.admission.tenants,
                                  speculative=config.speculative)
        self.usage = UsageStats()
        self.kv_instance: int | None = None
        self.free_blocks = -1                   # as the kv_manager last said
        self.evictable_blocks = -1
        self.decodes = DecodeWindow()           # the last seconds' decode steps (load report)
        self.steps: dict[int, PlannedStep] = {}  # the steps in flight, oldest first
        self.last_result_ns = 0                 # monotonic clock, when a result last came
        self.last_step_s = 0.0
        self.late = LateDrops()                 # admitted work past its TTFT or e2e bound
        self.finished: list[StepDone] = []      # the steps answered during the last call
        self.config_version = 0                 # the live config's (PolicyChange); 0: the TOML

    @property
    def dropped_late(self) -> int:
        return self.late.dropped

    @property
    def finished_at_deadline(self) -> int:
        return self.late.finished

    def hello(self) -> KvHello:
        return KvHello(self.core.epoch)

    def load(self, now_ns: int) -> SchedulerLoad:
        """The load report to admission at wall-clock ``now_ns`` (load.py)."""
        return load_report(self.core, self.core.cost, self.cfg.max_num_batched_tokens,
                           now_ns, self.decodes,
                           PoolCounts(self.free_blocks, self.evictable_blocks),
                           slack=self.cfg.chunking == "slack")

    # ------------------------------------------------------------------ inputs
    def handle(self, body: object, now_ns: int, mono_ns: int) -> list[Send]:
        """Apply one message; ``now_ns`` is the wall clock (deadlines, request timing),
        ``mono_ns`` a monotonic clock (step times). The steps it saw answered are in
        ``finished`` until the next call."""
        core, sends, out = self.core, [], Outcome()
        self.finished = []
        match body:
            case Admitted() as req:
                if req.request_id not in core.by_request:       # a replay may repeat it
                    self.late.watch(req, core.add(req, now_ns))
            case StepResult() as res:
                out = self._on_result(res, sends, now_ns, mono_ns)
            case KvGrants(grants=grants, free_blocks=free, free_cpu_blocks=free_cpu,
                          evictable_blocks=evictable):
                self.free_blocks, self.evictable_blocks = free, evictable
                core.on_grants(grants, free_cpu)
            case StopRequest(request_id=rid, index=index):
                out = core.stop(rid, index)
            case CancelRequest(request_id=rid):
                out = core.cancel(rid)
            case ExecutorReady(block_bytes=block_bytes, copy_bytes_per_s=bw,
                               step_costs=step_costs):
                core.on_executor(block_bytes, bw, step_costs)
            case PolicyChange(version=version, sections=sections):
                # between two plans: the next step is planned by the new version
                self.cfg = msgspec.structs.replace(sections.scheduler,
                                                   async_depth=self.cfg.async_depth)
                core.reconfigure(self.cfg, sections.admission.tenants, sections.speculative)
                self.config_version = version
            case KvManagerUp(instance=instance):
                if self.kv_instance is not None and instance != self.kv_instance:
                    log.error("kv_manager_restarted")
                    out = self._fail_all(sends, kv_lost=True)
                    sends.append(Send("kv_manager", self.hello()))
                self.kv_instance = instance
        if self.late.due(now_ns):
            dropped = self._drop_late(now_ns, sends)
            out.tokens += dropped.tokens
            out.released += dropped.released
            out.forget += dropped.forget
        self._emit(out, sends, now_ns, mono_ns)
        return sends

    def _drop_late(self, now_ns: int, sends: list[Send]) -> Outcome:
        """End the late work due by ``now_ns`` (late.py): ``deadline_expired``, which the
        streamer tells its clients, or (decoding at its end-to-end bound) finish reason
        ``deadline``, whose last outputs go to the detokenizer with the rest."""
        out, dropped = self.late.drop(self.core, now_ns)
        for d in dropped:
            log.info("deadline_dropped" if d.rejected else "deadline_finished",
                     request_id=d.request_id, where=d.where, bound=d.bound,
                     late_ms=round(d.overdue_ms, 1))
        if rejected := [d.rejected for d in dropped if d.rejected is not None]:
            sends.append(Send("streamer", EventBatch(rejected)))
        return out

    def _on_result(self, res: StepResult, sends: list[Send], now_ns: int,
                   mono_ns: int) -> Outcome:
        core = self.core
        started = max(self.steps[res.step_id].sent_ns, self.last_result_ns) \
            if res.step_id in self.steps else 0
        self.last_result_ns = mono_ns           # the executor is free from here on
        if res.step_id not in core.in_flight:
            return Outcome()                    # planned before a reset
        if res.failed:
            log.error("step_failed", step_id=res.step_id)
            return self._fail_all(sends, kv_lost=False, reason="executor step failed")
        if res.step_id != next(iter(core.in_flight)):
            # the executor answers in order: an earlier step's result was lost
            log.error("step_result_out_of_order", step_id=res.step_id)
            return self._fail_all(sends, kv_lost=False, reason="executor step lost")
        step = self.steps.pop(res.step_id)
        measured = (mono_ns - started) / 1e9
        self.last_step_s = measured
        shape = step.shape
        if step.plan is not None and step.starts is not None:      # what was verified
            shape = plan_shape(step.plan, step.starts.__getitem__,
                               {sid: d for sid, d, _ in res.drafts})
        target_s = measured
        if res.drafts:                          # the target's step, apart from drafting
            core.spec.drafting_took(res.draft_ns / 1e9, sum(d for _, d, _ in res.drafts))
            target_s = max(measured - res.draft_ns / 1e9, 1e-6)
        core.cost.observe(shape, target_s, deterministic=step.deterministic)
        self.decodes.step(now_ns, measured, step.predicted_s, step.decode_classes,
                          pure=shape.tokens == shape.seqs)
        self.finished.append(StepDone(shape, step.predicted_s, measured,
                                      res.elapsed_ns / 1e9, res.step_id, res.drafts))
        self.usage.sampled(core, res.seq_ids)
        failed = self._fail_structured(res.structured_errors, sends)
        out = core.on_result(res, now_ns)
        out.released += failed.released
        out.forget += failed.forget
        return out

    def _fail_structured(self, errors: list[tuple[int, str]], sends: list[Send]) -> Outcome:
        """Fail the requests whose structured output went past llguidance's limits (every
        choice: one of them cannot be finished), before the step's samples are taken, so
        theirs is not emitted. Without this the executor's EOS-only mask ended them
        ``stop`` with text outside their language."""
        out = Outcome()
        for seq_id, why in errors:
            seq = self.core.by_seq.get(seq_id)
            if seq is None or seq.ended or seq.request_id not in self.core.by_request:
                continue                        # ended since (an earlier step's error)
            log.warning("structured_output_failed", request_id=seq.request_id)
            cancelled = self.core.cancel(seq.request_id)
            out.released += cancelled.released
            out.forget += cancelled.forget
            sends.append(Send("streamer", EventBatch(
                [Failed(seq.request_id, f"{STRUCTURED_OUTPUT_ERROR}: {why}")])))
        return out

    def peer_restarted(self, name: str, now_ns: int, mono_ns: int) -> list[Send]:
        sends: list[Send] = []
        self.finished = []
        # the executor's KV is gone; a new streamer knows none of our requests, so nobody
        # waits for their tokens
        if name in ("executor", "streamer"):
            self._emit(self._fail_all(sends, kv_lost=False), sends, now_ns, mono_ns)
        elif name == "admission":                 # it lost its ledger: here is what we hold
            # each request's entry as admission made it (Admitted.held); one admitted
            # without (the simulator's, a test's) counts its tenant and n, no blocks
            sends.append(Send("admission", Holding(
                [seq.held or HeldRequest(rid, seq.tenant, "", seq.params.n, 0)
                 for rid, seq in self.core.by_request.items()])))
        return sends

    def _fail_all(self, sends: list[Send], kv_lost: bool,
                  reason: str = "engine component restarted") -> Outcome:
        out = self.core.reset(kv_lost)
        self.steps.clear()                      # their results, if any come, are ignored
        if out.released:
            sends.append(Send("streamer", EventBatch([Failed(rid, reason)
                                                      for rid in out.released])))
        return out

    # ------------------------------------------------------------------ outputs
    def _emit(self, out: Outcome, sends: list[Send], now_ns: int, mono_ns: int) -> None:
        core = self.core
        if out.tokens:
            sends.append(Send("detokenizer", TokenBatch(out.tokens)))
        for rid in out.forget:
            sends.append(Send("detokenizer", ForgetRequest(rid)))
        if out.released:
            sends.append(Send("admission", Released(out.released, released_outputs(out),
                                                    released_ttft(out))))
        while len(core.in_flight) < self.cfg.async_depth and core.has_work:
            plan = self._next_plan(now_ns, mono_ns)
            if plan is None:
                break
            if (ops := core.take_kv_ops()) is not None:
                sends.append(Send("kv_manager", ops))
            sends.append(Send("executor", plan))
        if (ops := core.take_kv_ops()) is not None:
            sends.append(Send("kv_manager", ops))

    def _next_plan(self, now_ns: int, mono_ns: int) -> StepPlan | None:
        core, budget = self.core, None
        if self.cfg.chunking == "slack":
            budget = step_budget(core, core.cost, self.cfg.max_num_batched_tokens,
                                 now_ns=now_ns)
        before = len(core.in_flight)
        plan = core.schedule(now_ns, budget.tokens if budget else None)
        if plan is not None:
            # each sequence's position before this step: after the steps in flight before it
            seqs = [core.by_seq[st.seq_id] for st in plan.steps]
            starts = {st.seq_id: seq.planned - st.num_tokens for st, seq in zip(plan.steps, seqs)}
            shape = plan_shape(plan, starts.__getitem__)
            spec = core.planner.last_spec
            speculating = any(st.draft_k for st in plan.steps)
            self.steps[plan.step_id] = PlannedStep(
                mono_ns, shape, core.cost.predict(shape, plan.deterministic), budget,
                [(seq.request_id, starts[seq.seq_id], seq.prompt_len) for seq in seqs], before,
                core.last_preempted, core.last_urgency, decode_classes(
                    (st.num_tokens, starts[st.seq_id], seq.prompt_len,
                     (seq.group[0] if seq.group else seq).service_class)
                    for st, seq in zip(plan.steps, seqs)),
                plan if speculating else None, starts if speculating else None, spec,
                plan.deterministic)
            self.usage.planned(core, plan)
        return plan
