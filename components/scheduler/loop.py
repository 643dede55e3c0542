"""The scheduler service's logic, without the I/O: one inbound message in, the messages to
send out, in order.

The service (service.py) only receives, calls ``handle``, and sends; the randomized
whole-loop test drives this same object. One StepPlan is in flight at a time; after every
message, whatever the core produced is sent (detokenizer output, releases, KV ops, the next
plan), and a new step is planned as soon as none is in flight. The step-cost model lives in
the core: each finished step's measured time teaches it, and the stall-free budget
(chunking.py), urgency preemption and the load report read it.

``Send`` destinations are the peers' names; ``STEP_DONE`` is a local note (the finished
step's measured times, for the service's span and step log) placed where it happened."""
from __future__ import annotations

from typing import NamedTuple

import structlog

from components.scheduler.chunking import StepBudget, step_budget
from components.scheduler.core import Outcome, SchedulerCore
from components.scheduler.cost_model import StepShape, plan_shape
from components.scheduler.load import released_outputs, released_ttft
from components.scheduler.usage import UsageStats
from schemas.config import WeirConfig
from schemas.wire import (Admitted, CancelRequest, EventBatch, ExecutorReady, Failed,
                          ForgetRequest, Holding, KvGrants, KvHello, KvManagerUp, Released,
                          StepPlan, StepResult, StopRequest, TokenBatch)

log = structlog.get_logger("scheduler")

STEP_DONE = "step_done"


class StepDone(NamedTuple):
    shape: StepShape
    predicted_s: float
    measured_s: float          # plan sent -> result received, as the scheduler saw it
    executor_s: float          # the executor's own time for the step


class Send(NamedTuple):
    to: str                    # "executor" | "kv_manager" | "detokenizer" | "admission" |
    msg: object                # "streamer" | STEP_DONE


class SchedulerLoop:
    def __init__(self, config: WeirConfig, epoch: int) -> None:
        self.cfg = config.scheduler
        self.core = SchedulerCore(config.scheduler, config.kv, config.engine.max_model_len,
                                  epoch=epoch, tenants=config.admission.tenants)
        self.usage = UsageStats()
        self.kv_instance: int | None = None
        self.free_blocks = -1                   # as the kv_manager last said
        self.step_started_ns = 0                # monotonic clock, when the plan was made
        self.shape = StepShape(0, 0, 0, 0)      # the step in flight
        self.predicted_s = 0.0
        self.budget: StepBudget | None = None   # the stall-free choice for the step in flight
        self.last_step_s = 0.0

    def hello(self) -> KvHello:
        return KvHello(self.core.epoch)

    # ------------------------------------------------------------------ inputs
    def handle(self, body: object, now_ns: int, mono_ns: int) -> list[Send]:
        """Apply one message; ``now_ns`` is the wall clock (deadlines, request timing),
        ``mono_ns`` a monotonic clock (step times)."""
        core, sends, out = self.core, [], Outcome()
        match body:
            case Admitted() as req:
                if req.request_id not in core.by_request:       # a replay may repeat it
                    core.add(req)
            case StepResult(failed=True, step_id=step_id):
                if core.in_flight is not None and step_id == core.in_flight_step:
                    log.error("step_failed", step_id=step_id)
                    out = self._fail_all(sends, kv_lost=False, reason="executor step failed")
            case StepResult() as res:
                if core.in_flight is not None and res.step_id == core.in_flight_step:
                    measured = (mono_ns - self.step_started_ns) / 1e9
                    self.last_step_s = measured
                    core.cost.observe(*self.shape[:3], measured)
                    sends.append(Send(STEP_DONE, StepDone(self.shape, self.predicted_s,
                                                          measured, res.elapsed_ns / 1e9)))
                    self.usage.sampled(core, res.seq_ids)
                out = core.on_result(res, now_ns)
            case KvGrants(grants=grants, free_blocks=free, free_cpu_blocks=free_cpu):
                self.free_blocks = free
                core.on_grants(grants, free_cpu)
            case StopRequest(request_id=rid, index=index):
                out = core.stop(rid, index)
            case CancelRequest(request_id=rid):
                out = core.cancel(rid)
            case ExecutorReady(block_bytes=block_bytes, copy_bytes_per_s=bw):
                core.on_executor(block_bytes, bw)
            case KvManagerUp(instance=instance):
                if self.kv_instance is not None and instance != self.kv_instance:
                    log.error("kv_manager_restarted")
                    out = self._fail_all(sends, kv_lost=True)
                    sends.append(Send("kv_manager", self.hello()))
                self.kv_instance = instance
        self._emit(out, sends, now_ns, mono_ns)
        return sends

    def peer_restarted(self, name: str, now_ns: int, mono_ns: int) -> list[Send]:
        sends: list[Send] = []
        # the executor's KV is gone; a new streamer knows none of our requests, so nobody
        # waits for their tokens
        if name in ("executor", "streamer"):
            self._emit(self._fail_all(sends, kv_lost=False), sends, now_ns, mono_ns)
        elif name == "admission":                 # it lost its counts: here is what we hold
            sends.append(Send("admission", Holding(
                [(rid, seq.tenant) for rid, seq in self.core.by_request.items()])))
        return sends

    def _fail_all(self, sends: list[Send], kv_lost: bool,
                  reason: str = "engine component restarted") -> Outcome:
        out = self.core.reset(kv_lost)
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
        if core.in_flight is None and core.has_work:
            plan = self._next_plan(now_ns)
            if plan is not None:
                self.step_started_ns = mono_ns
                if (ops := core.take_kv_ops()) is not None:
                    sends.append(Send("kv_manager", ops))
                sends.append(Send("executor", plan))
        if (ops := core.take_kv_ops()) is not None:
            sends.append(Send("kv_manager", ops))

    def _next_plan(self, now_ns: int) -> StepPlan | None:
        core, budget = self.core, None
        if self.cfg.chunking == "slack":
            budget = step_budget(core, core.cost, self.cfg.max_num_batched_tokens)
        plan = core.schedule(now_ns, budget.tokens if budget else None)
        if plan is not None:
            self.budget = budget
            self.shape = plan_shape(plan, lambda seq_id: core.by_seq[seq_id].num_computed)
            self.predicted_s = core.cost.predict(*self.shape[:3])
            self.usage.planned(core, plan)
        return plan
