"""The admission process: asks the kv_manager how much of each prompt is cached, applies the
admission policy (``policy.AdmissionPolicy``, shared with ``weir simulate``), traces every
decision, and passes the request on or rejects it early with a reason and a retry-after."""
from __future__ import annotations

import time

import anyio
import structlog
from opentelemetry import trace

from bus import tracing
from bus.component import Component
from components.admission.decision import Decision, Kind
from components.admission.policy import AdmissionPolicy
from components.admission.request_log import RequestLog, log_path
from components.admission.rollout import Rollout
from schemas.wire import (
    Accepted,
    AdmissionMsg,
    CacheAnswer,
    CacheQuery,
    CancelRequest,
    EventBatch,
    Holding,
    PolicyChange,
    Released,
    SchedulerLoad,
    Tokenized,
)

log = structlog.get_logger("admission")
_TRACER = trace.get_tracer("weir.admission")


class AdmissionService(Component):
    name = "admission"
    config_version = 0                # the live config's version (PolicyChange); 0: the TOML
    config_sha256 = ""
    request_log: RequestLog | None = None    # the recorded request log (request_log.py)

    async def setup(self) -> None:
        self.policy = AdmissionPolicy(self.config)
        self.pending: dict[str, tuple[Tokenized, str | None, float]] = {}   # awaiting cache info
        self.traceparents: dict[str, tuple[str | None, int | None]] = {}    # queued requests
        # the two timers below run only while they have something to do: set on the first
        # queued request / cache query (an idle engine's admission woke 60 times a second)
        self._wake_queue, self._wake_pending = anyio.Event(), anyio.Event()
        self.inbox_sock = self.inbox(AdmissionMsg)
        self.to_scheduler = self.push_to("scheduler")
        self.to_streamer = self.push_to("streamer")
        self.to_kv = self.push_to("kv_manager")
        self.request_log = self._request_log()

    def _request_log(self) -> RequestLog | None:
        """The recorded request log (``request_log.py``; ``telemetry.request_log``)."""
        t, kv = self.config.telemetry, self.config.kv
        path = log_path(self.config)
        if path is None:
            return None
        return RequestLog(path, kv.block_size,
                          max_bytes=round(t.request_log_max_mib * 2**20),
                          remember=max(65536, kv.num_blocks + kv.num_cpu_blocks))

    def _decision_attributes(self, req: Tokenized, d: Decision, cached: int | None) -> dict:
        policy, ledger, est = self.policy, self.policy.ledger, d.estimate
        tenant = policy.tenants.get(req.tenant)
        bucket = policy.token_bucket(req.tenant)
        return {
            "weir.request_id": req.request_id,
            "weir.tenant": req.tenant, "weir.service_class": d.service_class,
            "weir.admission.policy": policy.kind,
            "weir.config.version": self.config_version,
            "weir.admission.decision": d.kind, "weir.admission.reason": d.reason,
            "weir.admission.retry_after_s": (d.rejected.retry_after_s or 0.0)
            if d.rejected else 0.0,
            "weir.admission.priority": d.priority,
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
            "weir.admission.cached_prompt_tokens": cached if cached is not None else -1,
            "weir.admission.uncached_prompt_tokens": est.uncached_tokens,
            "weir.admission.expected_output_tokens": est.expected_output,
            "gen_ai.request.max_tokens": req.params.max_tokens or -1,
            "weir.admission.max_tokens": d.max_tokens or -1,
            "weir.admission.kv_blocks_requested": est.kv_blocks,
            "weir.admission.predicted_ttft_ms": round(est.predicted_ttft_s * 1e3, 2)
            if est.predicted_ttft_s is not None else -1.0,
            "weir.admission.ttft_bias_ms": round(policy.ttft.bias_s * 1e3, 2),
            # the deadline decided on (the request's own, else its class's), and the
            # client's own alone (what a replay of this traffic sends again)
            "weir.admission.deadline_ms": round(est.deadline_ms) if est.deadline_ms is not None
            else -1,
            "weir.request.deadline_ms": req.header.ttft_deadline_ms
            if req.header.ttft_deadline_ms is not None
            else -1,
            # the end-to-end bound in force (the client's clamped to its class's e2e_slo_ms),
            # and the client's own; -1: none
            "weir.admission.e2e_deadline_ms": round(est.e2e_deadline_ms)
            if est.e2e_deadline_ms is not None else -1,
            "weir.request.e2e_deadline_ms": req.header.e2e_deadline_ms
            if req.header.e2e_deadline_ms is not None else -1,
            "weir.admission.queue_position": policy.queue_position(req.request_id),
            "weir.admission.queued": policy.queued,
            "weir.tenant.outstanding": ledger.tenant_requests(req.tenant),
            "weir.tenant.max_outstanding": tenant.max_outstanding if tenant else 0,
            "weir.tenant.kv_blocks_reserved": ledger.tenant_blocks(req.tenant),
            "weir.tenant.kv_blocks_budget": tenant.kv_blocks if tenant else 0,
            "weir.tenant.running_seqs": ledger.tenant_seqs(req.tenant),
            "weir.tenant.token_bucket": round(bucket.level, 1) if bucket else -1.0,
            "weir.engine.outstanding": len(ledger),
            "weir.engine.max_outstanding": self.config.admission.max_outstanding,
            "weir.engine.kv_blocks_reserved": ledger.reserved_blocks,
            "weir.scheduler.queued_prefill_tokens": policy.ttft.load.queued_prefill_tokens,
            "weir.scheduler.prefill_tokens_per_s": round(
                policy.ttft.load.prefill_tokens_per_s, 1),
            "weir.scheduler.decode_step_ms": round(policy.ttft.load.decode_step_s * 1e3, 2),
            "weir.admission.unreported_prefill_tokens": policy.ttft.unreported_tokens,
            **self._live_attributes(d),
        }

    @staticmethod
    def _trial_attributes(trial: Rollout, req: Tokenized, d: Decision,
                          shadow: Decision | None) -> dict:
        """A candidate on trial (``rollout.py``): what it would have decided (shadow), or
        which side decided (canary: a canary decision's version is the trial's)."""
        out: dict = {"weir.rollout.mode": trial.mode, "weir.rollout.version": trial.version}
        if shadow is not None:
            trial.compare(shadow, d)
            out.update({"weir.shadow.decision": shadow.kind, "weir.shadow.reason": shadow.reason,
                        "weir.shadow.service_class": shadow.service_class,
                        "weir.shadow.agrees": shadow.kind == d.kind})
        elif trial.takes(req.tenant):
            out.update({"weir.rollout.arm": "canary", "weir.config.version": trial.version})
        else:
            out["weir.rollout.arm"] = "baseline"
        return out

    def _live_attributes(self, d: Decision) -> dict:
        """The live engine the decision saw (``live.py``): the pool's counts and the room a
        reservation had by it (-1: not reported yet), and the decode horizon: the step
        predicted with the request (-1: not checked), the measured decode step, and the
        measured TPOT of each class running."""
        ledger, live = self.policy.ledger, self.policy.live
        load, room = live.load, live.kv_room(ledger.reserved_blocks)
        step = d.estimate.decode_step_s
        return {
            "weir.kv.free_blocks": load.kv_free_blocks,
            "weir.kv.evictable_blocks": load.kv_evictable_blocks,
            "weir.admission.kv_live_room_blocks": room if room is not None else -1,
            "weir.admission.predicted_decode_step_ms":
                round(step * 1e3, 2) if step is not None else -1.0,
            "weir.scheduler.decode_measured_ms": round(load.decode_measured_s * 1e3, 2),
            "weir.scheduler.running_seqs": load.running,
            "weir.admission.admitted_seqs": sum(ledger.class_seqs.values()),
            **{f"weir.scheduler.tpot_ms.{c}": round(v * 1e3, 2)
               for c, v in load.tpot_s.items()},
        }

    async def _admit(self, req: Tokenized, traceparent: str | None, cached: int | None,
                     best_case: int | None = None) -> None:
        """Decide, trace the decision, and pass the request on, hold it, or reject it.
        ``cached`` is the kv_manager's count of already-cached prompt tokens (None: unknown).
        ``best_case``: not looked up, decided as if that many were cached (see
        ``AdmissionPolicy.beyond_deadline``)."""
        now, known = time.monotonic(), best_case if best_case is not None else cached or 0
        trial = self.policy.trial
        shadow = trial.shadow(req, known, now) if trial and trial.mode == "shadow" else None
        d = self.policy.decide(req, known, now)
        if self.request_log is not None:
            self.request_log.expected(req.request_id, d.estimate.expected_output)
            if d.kind == Kind.REJECT:
                self.request_log.end(req.request_id)
        attributes = self._decision_attributes(req, d, cached)
        if trial is not None:
            attributes.update(self._trial_attributes(trial, req, d, shadow))
        attributes["weir.admission.cache_lookup"] = (
            "skipped_beyond_deadline" if best_case is not None
            else "none" if not (self.config.kv.enable_prefix_cache and req.block_hashes)
            else "done" if cached is not None else "timed_out")
        with _TRACER.start_as_current_span(
                "admission.decide", context=tracing.context_from(traceparent),
                attributes=attributes):
            log.info("admission", request_id=req.request_id, decision=d.kind, reason=d.reason,
                     service_class=d.service_class)
        if d.kind == Kind.REJECT:
            await self.to_streamer.send(EventBatch([d.rejected]))
        elif d.kind == Kind.QUEUE:
            self.traceparents[req.request_id] = (traceparent, cached)
            self._wake_queue.set()
        else:
            await self._start(req, d, traceparent, cached, 0.0)

    async def _start(self, req: Tokenized, d: Decision, traceparent: str | None,
                     cached: int | None, queued_s: float) -> None:
        admitted = self.policy.admitted(req, d, queued_s)
        await self.to_scheduler.send(admitted, traceparent=traceparent)
        await self.to_streamer.send(EventBatch([Accepted(
            req.request_id, len(req.prompt_token_ids), cached or 0, d.service_class,
            d.max_tokens, d.kind == Kind.DEGRADE, round(queued_s, 4),
            admitted.header.ttft_deadline_ms if admitted.drop_late else None,
            admitted.header.e2e_deadline_ms)]))

    async def _drain_queue(self) -> None:
        """Release what now fits, expire what waited too long."""
        now = time.monotonic()
        expired = self.policy.expire(now)
        for rej in expired:
            self.traceparents.pop(rej.request_id, None)
            if self.request_log is not None:
                self.request_log.end(rej.request_id)
        if expired:
            await self.to_streamer.send(EventBatch(expired))
        for req, d, waited in self.policy.release(now):
            traceparent, cached = self.traceparents.pop(req.request_id, (None, 0))
            with _TRACER.start_as_current_span(
                    "admission.release", context=tracing.context_from(traceparent),
                    attributes={"weir.request_id": req.request_id,
                                "weir.service_class": d.service_class,
                                "weir.admission.queued_ms": round(waited * 1e3, 2)}):
                pass
            await self._start(req, d, traceparent, cached, waited)

    async def _tick(self) -> None:
        """Every 20 ms while requests are queued; asleep while none is."""
        while True:
            await self._wake_queue.wait()
            await anyio.sleep(0.02)
            if self.policy.queued:
                await self._drain_queue()
            if not self.policy.queued:
                self._wake_queue = anyio.Event()

    async def _expire_cache_queries(self) -> None:
        """Never let a request wait on a lost answer (e.g. the kv_manager restarted).
        Every 0.1 s while cache queries are out; asleep while none is."""
        while True:
            await self._wake_pending.wait()
            await anyio.sleep(0.1)
            if not self.pending:
                self._wake_pending = anyio.Event()
                continue
            now = time.monotonic()
            for rid in [r for r, (_, _, t) in self.pending.items() if now - t > 0.5]:
                req, traceparent, _ = self.pending.pop(rid)
                log.warning("cache_query_timeout", request_id=rid)
                await self._admit(req, traceparent, None)

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._expire_cache_queries)
            tg.start_soon(self._tick)
            await self._serve()

    async def _serve(self) -> None:
        while True:
            msg = await self.inbox_sock.recv()
            match msg.body:
                case Tokenized() as req if (req.request_id in self.pending
                                            or req.request_id in self.policy.ledger
                                            or req.request_id in self.traceparents):
                    pass             # the streamer replayed it after a restart: already here
                case Tokenized() as req:
                    if self.request_log is not None:
                        self.request_log.arrived(req)
                    bs = self.config.kv.block_size
                    best = min(len(req.block_hashes) * bs, len(req.prompt_token_ids) - 1)
                    if not (self.config.kv.enable_prefix_cache and req.block_hashes):
                        await self._admit(req, msg.envelope.traceparent, 0)
                    elif self.policy.beyond_deadline(req, best):
                        await self._admit(req, msg.envelope.traceparent, None, best)
                    else:
                        self.pending[req.request_id] = (req, msg.envelope.traceparent,
                                                        time.monotonic())
                        self._wake_pending.set()
                        await self.to_kv.send(CacheQuery(
                            req.request_id, req.tenant, req.block_hashes,
                            req.prompt_token_ids[:len(req.block_hashes) * bs],
                            (len(req.prompt_token_ids) - 1) // bs, req.public_scope,
                            req.public_blocks))
                case CacheAnswer(request_id=rid, cached_tokens=cached):
                    if (pending := self.pending.pop(rid, None)) is not None:
                        await self._admit(pending[0], pending[1], cached)
                case CancelRequest() as cancel:
                    if self.request_log is not None:
                        self.request_log.cancelled(cancel.request_id)
                    if self.pending.pop(cancel.request_id, None) is not None:
                        self._logged_end(cancel.request_id)
                        continue                      # never admitted; the streamer answered
                    if self.policy.cancel(cancel.request_id):
                        self.traceparents.pop(cancel.request_id, None)
                        self._logged_end(cancel.request_id)
                        continue                      # queued here: gone, the engine never saw it
                    if cancel.request_id in self.policy.ledger:
                        await self.to_scheduler.send(cancel)
                case SchedulerLoad() as load:
                    if verdict := self.policy.on_load(load, time.monotonic()):
                        log.warning("admission_ledger_mismatch", verdict=verdict,
                                    outstanding=len(self.policy.ledger),
                                    reserved_kv_blocks=self.policy.ledger.reserved_blocks,
                                    pool_used_blocks=self.policy.live.used_blocks)
                    if self.policy.queued:
                        await self._drain_queue()
                case PolicyChange() as change:
                    self.apply_policy(change)
                case Holding(requests=held):          # after our restart: resume the ledger
                    self.policy.holding(held)
                case Released(request_ids=ids, output_tokens=outputs, ttft_s=ttft):
                    self.policy.released(ids, time.monotonic(), outputs, ttft)
                    for rid in ids:
                        self._logged_end(rid, outputs.get(rid))
                    if self.policy.queued:
                        await self._drain_queue()

    def apply_policy(self, change: PolicyChange) -> None:
        """A live config version: between two decisions (one message at a time), so the
        next decision, and its span's ``weir.config.version``, is the new version's."""
        self.config = change.sections.onto(self.config)
        self.policy.reconfigure(self.config)
        self.config_version, self.config_sha256 = change.version, change.sha256
        trial = change.trial
        self.policy.try_candidate(None if trial is None else trial.sections.onto(self.config),
                                  trial.version if trial else 0, trial.sha256 if trial else "")
        log.info("config_version", version=change.version, policy=self.policy.kind)
        if trial is not None:
            rollout = trial.sections.rollout
            with _TRACER.start_as_current_span("admission.rollout", attributes={
                    "weir.config.version": change.version,
                    "weir.rollout.version": trial.version, "weir.rollout.mode": rollout.mode,
                    "weir.rollout.share": rollout.share if rollout.mode == "canary" else 0.0,
                    "weir.rollout.policy": trial.sections.admission.policy}):
                log.info("rollout_" + ("shadowing" if rollout.mode == "shadow" else "canary"),
                         version=trial.version, settled=change.version,
                         share=rollout.share if rollout.mode == "canary" else None,
                         policy=trial.sections.admission.policy)

    def _logged_end(self, request_id: str, output_tokens: int | None = None) -> None:
        if self.request_log is not None:
            self.request_log.end(request_id, output_tokens)

    async def peer_restarted(self, name: str) -> None:
        if name == "scheduler":                        # it dropped everything it held
            for rid in list(self.policy.ledger.entries):
                self._logged_end(rid)
            self.policy.forget_all()

    def info(self) -> dict[str, str]:
        return {"admission": self.config.admission.describe(),
                "config_version": str(self.config_version),
                "config_sha256": self.config_sha256}

    def stats(self) -> dict[str, float]:
        log_ = self.request_log
        return {**self.policy.stats(time.monotonic()), "config_version": self.config_version,
                **({"request_log.written": log_.written, "request_log.errors": log_.errors}
                   if log_ is not None else {})}
