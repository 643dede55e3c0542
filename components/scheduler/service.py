"""The scheduler process: a thin async shell around ``SchedulerLoop`` (loop.py).

Every inbound message is handed to the loop, which applies it to the core and returns what
to send, in order; the shell ends the spans of the steps it saw answered (``loop.finished``)
and writes them to the optional step log, then sends, telling OpenTelemetry
(step_trace.py) what it sends.
"""
from __future__ import annotations

import time

import anyio
import msgspec
import structlog

from bus.component import Component
from components.scheduler.load import LOAD_INTERVAL_S, backlog_tokens
from components.scheduler.loop import SchedulerLoop, Send, StepDone
from components.scheduler.sequence import ON_HOST
from components.scheduler.step_trace import StepTracer
from schemas.wire import (
    Admitted,
    ExecutorReady,
    KvHello,
    Released,
    SchedulerMsg,
    StepPlan,
    TenantUsage,
    TokenBatch,
)

log = structlog.get_logger("scheduler")


class SchedulerService(Component):
    name = "scheduler"

    async def setup(self) -> None:
        cfg = self.config
        self.loop = SchedulerLoop(cfg, epoch=time.time_ns())
        self.core = self.loop.core
        self.inbox_sock = self.inbox(SchedulerMsg)
        self.peers = {"executor": self.push_to("executor"),
                      "kv_manager": self.push_to("kv_manager"),
                      "detokenizer": self.push_to("detokenizer"),
                      "admission": self.push_to("admission"), "streamer": self.push_to("streamer")}
        self.trace = StepTracer(self.loop, cfg.scheduler.max_num_batched_tokens)
        self.step_log = open(cfg.scheduler.step_log, "a", buffering=1) \
            if cfg.scheduler.step_log else None           # line-buffered: a kill loses no step
        await self.peers["kv_manager"].send(KvHello(self.core.epoch))

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._report_load)
            await self._serve()

    async def _report_load(self) -> None:
        """Tell admission about the backlog, so it can predict time to first token."""
        while True:
            await anyio.sleep(LOAD_INTERVAL_S)
            await self.peers["admission"].send(self.loop.load(time.time_ns()))

    async def _serve(self) -> None:
        while True:
            msg = await self.inbox_sock.recv()
            body = msg.body
            if isinstance(body, Admitted):
                self.trace.admitted(body.request_id, msg.envelope.traceparent)
            elif isinstance(body, ExecutorReady):
                log.info("executor_ready", block_bytes=body.block_bytes,
                         copy_gb_per_s=round(body.copy_bytes_per_s / 1e9, 2),
                         step_costs=len(body.step_costs))
            await self._send(self.loop.handle(body, time.time_ns(), time.perf_counter_ns()))
            if isinstance(body, ExecutorReady):   # admission's rates now, not in 100 ms
                await self.peers["admission"].send(self.loop.load(time.time_ns()))

    async def peer_restarted(self, name: str) -> None:
        await self._send(self.loop.peer_restarted(name, time.time_ns(), time.perf_counter_ns()))

    async def _send(self, sends: list[Send]) -> None:
        for done in self.loop.finished:         # local notes of the same call, not sent
            self.trace.finished_step(done)
            if self.step_log is not None:
                self._log_step(done)
        for to, msg in sends:
            match msg:
                case StepPlan() as plan:
                    step = self.loop.steps.get(plan.step_id)
                    for p in step.preempted if step is not None else ():
                        log.info("preemption", request_id=p.request_id, choice_index=p.index,
                                 reason=p.reason, choice=p.choice, wasted_tokens=p.wasted_tokens,
                                 recompute_ms=round(p.recompute_s * 1e3, 2),
                                 swap_ms=round(min(p.swap_s, 1e9) * 1e3, 2))
                    await self.peers[to].send(plan, traceparent=self.trace.planned(plan))
                case TokenBatch(items=tokens):
                    self.trace.outputs(tokens)
                    await self.peers[to].send(TokenBatch([
                        t if t.params is None else msgspec.structs.replace(
                            t, params=msgspec.structs.replace(
                                t.params, traceparent=self.trace.traceparents.get(t.request_id)))
                        for t in tokens]))
                case Released(request_ids=rids):
                    self.trace.released(rids)
                    await self.peers[to].send(msg)
                case _:
                    await self.peers[to].send(msg)

    def _log_step(self, done: StepDone) -> None:
        shape = done.shape
        self.step_log.write(msgspec.json.encode({
            "tokens": shape.tokens, "context": shape.context, "seqs": shape.seqs,
            "pairs": shape.pairs, "measured_s": round(done.measured_s, 7),
            "executor_s": round(done.executor_s, 7), "t": round(time.time(), 3)}).decode() + "\n")

    def stats(self) -> dict[str, float]:
        c = self.core
        return {"running": len(c.running), "waiting": len(c.waiting), "steps": c.steps,
                "preemptions": c.preemptions, "wasted_tokens": c.wasted_tokens,
                "discarded_samples": c.discarded_samples,
                "preemptions.recompute": c.preemptions_by_kind["recompute"],
                "preemptions.swap": c.preemptions_by_kind["swap"],
                "swapped_out_blocks": c.swapped_blocks,
                "swapped_seqs": sum(s.state in ON_HOST for s in c.waiting),
                "last_step_ms": round(self.loop.last_step_s * 1e3, 3),
                "deadline_dropped": self.loop.dropped_late,
                "deadline_finished": self.loop.finished_at_deadline,
                "config_version": self.loop.config_version,
                **backlog_tokens(c),
                **c.spec_stats(),
                **self.loop.usage.stats(c)}

    def tenant_usage(self) -> dict[str, TenantUsage]:
        return self.loop.usage.tenants(self.core)
