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
from components.admission.policy import AdmissionPolicy
from schemas.wire import (Accepted, AdmissionMsg, Admitted, CacheAnswer, CacheQuery,
                          CancelRequest, EventBatch, Holding, Rejected, Released, SchedulerLoad,
                          Tokenized)

log = structlog.get_logger("admission")
_TRACER = trace.get_tracer("weir.admission")


class AdmissionService(Component):
    name = "admission"

    async def setup(self) -> None:
        self.policy = AdmissionPolicy(self.config)
        self.pending: dict[str, tuple[Tokenized, str | None, float]] = {}   # awaiting cache info
        self.inbox_sock = self.inbox(AdmissionMsg)
        self.to_scheduler = self.push_to("scheduler")
        self.to_streamer = self.push_to("streamer")
        self.to_kv = self.push_to("kv_manager")

    def _decision_attributes(self, req: Tokenized, rejected: Rejected | None,
                             cached: int | None) -> dict:
        policy = self.policy
        prompt = len(req.prompt_token_ids)
        ttft = policy.predicted_ttft_s(prompt - (cached or 0))
        tenant = policy.tenants.get(req.tenant)
        bs = self.config.kv.block_size
        return {
            "weir.request_id": req.request_id,
            "weir.tenant": req.tenant, "weir.service_class": "standard",
            "weir.admission.decision": "reject" if rejected else "accept",
            "weir.admission.reason": rejected.reason if rejected else "within_caps",
            "weir.admission.retry_after_s": (rejected.retry_after_s or 0.0) if rejected else 0.0,
            "gen_ai.usage.input_tokens": prompt,
            "weir.admission.cached_prompt_tokens": cached if cached is not None else -1,
            "weir.admission.uncached_prompt_tokens": prompt - (cached or 0),
            "gen_ai.request.max_tokens": req.params.max_tokens or -1,
            "weir.admission.kv_blocks_requested": -(-(len(req.prompt_token_ids) + 1) // bs),
            "weir.admission.policy": self.config.admission.policy,
            "weir.tenant.outstanding": policy.per_tenant[req.tenant],
            "weir.tenant.max_outstanding": tenant.max_outstanding if tenant else 0,
            "weir.engine.outstanding": len(policy.outstanding),
            "weir.engine.max_outstanding": self.config.admission.max_outstanding,
            "weir.admission.predicted_ttft_ms": round(ttft * 1e3, 2) if ttft is not None else -1.0,
            "weir.admission.deadline_ms": req.deadline_ms if req.deadline_ms is not None else -1,
            "weir.scheduler.queued_prefill_tokens": policy.load.queued_prefill_tokens,
        }

    async def _admit(self, req: Tokenized, traceparent: str | None, cached: int | None) -> None:
        """Decide, trace the decision, and pass the request on (or reject it).
        ``cached`` is the kv_manager's count of already-cached prompt tokens (None: unknown)."""
        rejected = self.policy.decide(req, time.monotonic())
        with _TRACER.start_as_current_span(
                "admission.decide", context=tracing.context_from(traceparent),
                attributes=self._decision_attributes(req, rejected, cached)):
            log.info("admission", request_id=req.request_id,
                     decision=rejected.reason if rejected else "accepted")
        if rejected is not None:
            await self.to_streamer.send(EventBatch([rejected]))
            return
        self.policy.admitted(req.request_id, req.tenant)
        await self.to_scheduler.send(Admitted(
            req.request_id, req.tenant, req.prompt_token_ids, req.block_hashes, req.params,
            req.arrival_ns, req.eos_token_ids, req.deadline_ms, req.priority, req.public_scope,
            req.public_blocks), traceparent=traceparent)
        await self.to_streamer.send(EventBatch(
            [Accepted(req.request_id, len(req.prompt_token_ids), cached or 0)]))

    async def _expire_cache_queries(self) -> None:
        """Never let a request wait on a lost answer (e.g. the kv_manager restarted)."""
        while True:
            await anyio.sleep(0.1)
            now = time.monotonic()
            for rid in [r for r, (_, _, t) in self.pending.items() if now - t > 0.5]:
                req, traceparent, _ = self.pending.pop(rid)
                log.warning("cache_query_timeout", request_id=rid)
                await self._admit(req, traceparent, None)

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._expire_cache_queries)
            await self._serve()

    async def _serve(self) -> None:
        while True:
            msg = await self.inbox_sock.recv()
            match msg.body:
                case Tokenized() as req if (req.request_id in self.pending
                                            or req.request_id in self.policy.outstanding):
                    pass             # the streamer replayed it after a restart: already here
                case Tokenized() as req:
                    if self.config.kv.enable_prefix_cache and req.block_hashes:
                        self.pending[req.request_id] = (req, msg.envelope.traceparent,
                                                        time.monotonic())
                        bs = self.config.kv.block_size
                        await self.to_kv.send(CacheQuery(
                            req.request_id, req.tenant, req.block_hashes,
                            req.prompt_token_ids[:len(req.block_hashes) * bs],
                            (len(req.prompt_token_ids) - 1) // bs, req.public_scope,
                            req.public_blocks))
                    else:
                        await self._admit(req, msg.envelope.traceparent, 0)
                case CacheAnswer(request_id=rid, cached_tokens=cached):
                    if (pending := self.pending.pop(rid, None)) is not None:
                        await self._admit(pending[0], pending[1], cached)
                case CancelRequest() as cancel:
                    if self.pending.pop(cancel.request_id, None) is not None:
                        continue                      # never admitted; the streamer answered
                    if cancel.request_id in self.policy.outstanding:
                        await self.to_scheduler.send(cancel)
                case SchedulerLoad() as load:
                    self.policy.load = load
                case Holding(requests=held):          # after our restart: resume the counts
                    self.policy.holding(held)
                case Released(request_ids=ids):
                    self.policy.released(ids, time.monotonic())

    async def peer_restarted(self, name: str) -> None:
        if name == "scheduler":                        # it dropped everything it held
            self.policy.forget_all()

    def stats(self) -> dict[str, float]:
        return {"outstanding": len(self.policy.outstanding),
                **{f"decisions.{k}": v for k, v in self.policy.decisions.items()}}
