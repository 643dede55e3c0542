"""The scheduler process: a thin async shell around ``SchedulerCore``.

One StepPlan is in flight at a time; every inbound message is applied to the
core, and whatever the core produced (KV ops, detokenizer output, releases,
the next plan) is sent before the next message is read.
"""
from __future__ import annotations

import time

import anyio
import structlog

from bus.component import Component
import msgspec

from components.scheduler.chunking import step_budget
from components.scheduler.core import Outcome, SchedulerCore
from components.scheduler.load import (LOAD_INTERVAL_S, load_report, released_outputs,
                                       released_ttft)
from components.scheduler.sequence import Phase
from components.scheduler.step_trace import StepTracer
from components.scheduler.usage import UsageStats
from schemas.wire import (Admitted, CancelRequest, EventBatch, ExecutorReady, Failed,
                          ForgetRequest, Holding, KvGrants, KvHello, KvManagerUp, Released,
                          SchedulerMsg, StepResult, StopRequest, TenantUsage,
                          TokenBatch)

log = structlog.get_logger("scheduler")


class SchedulerService(Component):
    name = "scheduler"

    async def setup(self) -> None:
        cfg = self.config
        self.core = SchedulerCore(cfg.scheduler, cfg.kv, cfg.engine.max_model_len,
                                  epoch=time.time_ns(),
                                  weights={t.name: t.weight for t in cfg.admission.tenants})
        self.kv_instance: int | None = None
        self.inbox_sock = self.inbox(SchedulerMsg)
        self.to_executor = self.push_to("executor")
        self.to_kv = self.push_to("kv_manager")
        self.to_detok = self.push_to("detokenizer")
        self.to_admission = self.push_to("admission")
        self.to_streamer = self.push_to("streamer")
        self.step_started = 0
        self.last_step_ms = 0.0
        self.trace = StepTracer(self.core, cfg.scheduler.max_num_batched_tokens)
        # recompute cost for preemption choices: the prefill time of those tokens
        self.core.recompute_s = lambda tokens: self.trace.cost.predict(tokens, tokens, 1)
        self.usage = UsageStats()
        self.step_log = open(cfg.scheduler.step_log, "a", buffering=1) \
            if cfg.scheduler.step_log else None           # line-buffered: a kill loses no step
        await self.to_kv.send(KvHello(self.core.epoch))

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._report_load)
            await self._serve()

    async def _report_load(self) -> None:
        """Tell admission about the backlog, so it can predict time to first token."""
        budget = self.config.scheduler.max_num_batched_tokens
        while True:
            await anyio.sleep(LOAD_INTERVAL_S)
            await self.to_admission.send(load_report(self.core, self.trace.cost, budget))

    async def _serve(self) -> None:
        while True:
            msg = await self.inbox_sock.recv()
            out = Outcome()
            match msg.body:
                case Admitted() as req:
                    if req.request_id not in self.core.by_request:    # a replay may repeat it
                        self.core.add(req)
                        self.trace.admitted(req.request_id, msg.envelope.traceparent)
                case StepResult(failed=True, step_id=step_id):
                    if self.core.in_flight is not None and step_id == self.core.in_flight_step:
                        log.error("step_failed", step_id=step_id)
                        out = await self._fail_all(kv_lost=False, reason="executor step failed")
                case StepResult() as res:
                    measured = (time.perf_counter_ns() - self.step_started) / 1e9
                    self.last_step_ms = measured * 1e3
                    if self.core.in_flight is not None and res.step_id == self.core.in_flight_step:
                        self.trace.finished_step(measured, res.elapsed_ns / 1e9)
                        if self.step_log is not None:
                            self._log_step(measured, res.elapsed_ns / 1e9)
                        self.usage.sampled(self.core, res.seq_ids)
                    out = self.core.on_result(res, time.time_ns())
                case KvGrants(grants=grants, free_blocks=free, free_cpu_blocks=free_cpu):
                    self.trace.free_blocks = free
                    self.core.on_grants(grants, free_cpu)
                case StopRequest(request_id=rid, index=index):
                    out = self.core.stop(rid, index)
                case CancelRequest(request_id=rid):
                    out = self.core.cancel(rid)
                case ExecutorReady(block_bytes=block_bytes, copy_bytes_per_s=bw):
                    self.core.on_executor(block_bytes, bw)
                    log.info("executor_ready", block_bytes=block_bytes,
                             copy_gb_per_s=round(bw / 1e9, 2))
                case KvManagerUp(instance=instance):
                    if self.kv_instance is not None and instance != self.kv_instance:
                        log.error("kv_manager_restarted")
                        out = await self._fail_all(kv_lost=True)
                        await self.to_kv.send(KvHello(self.core.epoch))
                    self.kv_instance = instance
            await self._emit(out)

    def _log_step(self, measured_s: float, executor_s: float) -> None:
        shape = self.trace.shape
        self.step_log.write(msgspec.json.encode({
            "tokens": shape.tokens, "context": shape.context, "seqs": shape.seqs,
            "pairs": shape.pairs, "measured_s": round(measured_s, 7),
            "executor_s": round(executor_s, 7)}).decode() + "\n")

    async def _fail_all(self, kv_lost: bool,
                        reason: str = "engine component restarted") -> Outcome:
        out = self.core.reset(kv_lost)
        if out.released:
            await self.to_streamer.send(EventBatch([Failed(rid, reason) for rid in out.released]))
        return out

    async def peer_restarted(self, name: str) -> None:
        # the executor's KV is gone; a new streamer knows none of our requests, so nobody
        # waits for their tokens
        if name in ("executor", "streamer"):
            await self._emit(await self._fail_all(kv_lost=False))
        elif name == "admission":                 # it lost its counts: here is what we hold
            await self.to_admission.send(Holding(
                [(rid, seq.tenant) for rid, seq in self.core.by_request.items()]))

    async def _emit(self, out: Outcome) -> None:
        core = self.core
        if out.tokens:
            self.trace.outputs(out.tokens)
            tokens = [t if t.params is None else msgspec.structs.replace(
                t, params=msgspec.structs.replace(
                    t.params, traceparent=self.trace.traceparents.get(t.request_id)))
                for t in out.tokens]
            await self.to_detok.send(TokenBatch(tokens))
        for rid in out.forget:
            await self.to_detok.send(ForgetRequest(rid))
        if out.released:
            self.trace.released(out.released)
            await self.to_admission.send(Released(out.released, released_outputs(out),
                                                  released_ttft(out)))
        if core.in_flight is None and core.has_work:
            budget = None
            if self.config.scheduler.chunking == "slack":
                budget = step_budget(core, self.trace.cost,
                                     self.config.scheduler.max_num_batched_tokens)
                self.trace.budget_choice = budget
            plan = core.schedule(time.time_ns(), budget.tokens if budget else None)
            for p in core.last_preempted:
                log.info("preemption", request_id=p.request_id, choice_index=p.index,
                         reason=p.reason, choice=p.choice, wasted_tokens=p.wasted_tokens,
                         recompute_ms=round(p.recompute_s * 1e3, 2),
                         swap_ms=round(min(p.swap_s, 1e9) * 1e3, 2))
            if plan is not None:
                self.step_started = time.perf_counter_ns()
                ops = core.take_kv_ops()
                if ops is not None:
                    await self.to_kv.send(ops)
                self.usage.planned(core, plan)
                await self.to_executor.send(plan, traceparent=self.trace.planned(plan))
        ops = core.take_kv_ops()
        if ops is not None:
            await self.to_kv.send(ops)

    def stats(self) -> dict[str, float]:
        c = self.core
        return {"running": len(c.running), "waiting": len(c.waiting), "steps": c.steps,
                "preemptions": c.preemptions, "wasted_tokens": c.wasted_tokens,
                "preemptions.recompute": c.preemptions_by_kind["recompute"],
                "preemptions.swap": c.preemptions_by_kind["swap"],
                "swapped_out_blocks": c.swapped_blocks,
                "swapped_seqs": sum(s.phase is Phase.SWAPPED for s in c.waiting),
                "last_step_ms": round(self.last_step_ms, 3),
                **self.usage.stats(c)}

    def tenant_usage(self) -> dict[str, TenantUsage]:
        return self.usage.tenants(self.core)
