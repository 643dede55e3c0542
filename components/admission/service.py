"""The admission process: validates requests, enforces bounded queue caps per tenant
and overall, and rejects early with a reason and a retry-after estimate.
Deeper policy (deadlines, degrade, fairness) builds on this."""
from __future__ import annotations

import time
from collections import Counter

import anyio
import structlog
from opentelemetry import trace

from bus import tracing

from bus.component import Component
from components.admission.retry import DrainRate
from components.admission.validate import check_length, check_params
from schemas.wire import (Accepted, AdmissionMsg, Admitted, CacheAnswer, CacheQuery,
                          CancelRequest, EventBatch, Holding, Rejected, Released, SchedulerLoad,
                          Tokenized)

log = structlog.get_logger("admission")
_TRACER = trace.get_tracer("weir.admission")


class AdmissionService(Component):
    name = "admission"

    async def setup(self) -> None:
        self.tenants = {t.name: t for t in self.config.admission.tenants}
        self.outstanding: dict[str, str] = {}         # request_id -> tenant
        self.per_tenant: Counter[str] = Counter()
        self.releases = DrainRate()
        self.decisions: Counter[str] = Counter()
        self.load = SchedulerLoad(0, 0, 0, 0.0, 0.0)
        self.pending: dict[str, tuple[Tokenized, str | None, float]] = {}   # awaiting cache info
        self.inbox_sock = self.inbox(AdmissionMsg)
        self.to_scheduler = self.push_to("scheduler")
        self.to_streamer = self.push_to("streamer")
        self.to_kv = self.push_to("kv_manager")

    def retry_after(self, backlog: int) -> float:
        """Seconds until ``backlog`` requests would drain at the recently observed rate."""
        return self.releases.retry_after(backlog, time.monotonic())

    def decide(self, req: Tokenized) -> Rejected | None:
        rid = req.request_id
        tenant = self.tenants.get(req.tenant)
        if tenant is None:
            return Rejected(rid, "unknown_tenant", f"unknown tenant {req.tenant!r}")
        if (why := check_params(req.params)) is not None:
            return Rejected(rid, "invalid_request", why)
        if req.params.n > self.config.scheduler.max_num_seqs:
            return Rejected(rid, "invalid_request", f"n ({req.params.n}) exceeds the engine's "
                            f"max_num_seqs ({self.config.scheduler.max_num_seqs})")
        if (bad := check_length(len(req.prompt_token_ids), req.params.max_tokens,
                                self.config.engine.max_model_len)) is not None:
            return Rejected(rid, bad[0], bad[1])
        cap = self.config.admission.max_outstanding
        if len(self.outstanding) >= cap:
            return Rejected(rid, "overloaded", f"the engine holds {cap} requests, its cap",
                            self.retry_after(len(self.outstanding) - cap + 1))
        if self.per_tenant[req.tenant] >= tenant.max_outstanding:
            return Rejected(rid, "tenant_over_budget",
                            f"tenant holds {tenant.max_outstanding} requests, its cap",
                            self.retry_after(self.per_tenant[req.tenant] - tenant.max_outstanding + 1))
        return None

    def predicted_ttft_s(self, prompt_tokens: int) -> float | None:
        """Backlog plus this prompt at the measured prefill rate, plus one step; None
        while the scheduler has not measured enough steps."""
        load = self.load
        if load.prefill_tokens_per_s <= 0:
            return None
        return (load.queued_prefill_tokens + prompt_tokens) / load.prefill_tokens_per_s \
            + load.decode_step_s

    def _decision_attributes(self, req: Tokenized, rejected: Rejected | None,
                             cached: int | None) -> dict:
        prompt = len(req.prompt_token_ids)
        ttft = self.predicted_ttft_s(prompt - (cached or 0))
        tenant = self.tenants.get(req.tenant)
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
            "weir.tenant.outstanding": self.per_tenant[req.tenant],
            "weir.tenant.max_outstanding": tenant.max_outstanding if tenant else 0,
            "weir.engine.outstanding": len(self.outstanding),
            "weir.engine.max_outstanding": self.config.admission.max_outstanding,
            "weir.admission.predicted_ttft_ms": round(ttft * 1e3, 2) if ttft is not None else -1.0,
            "weir.admission.deadline_ms": req.deadline_ms if req.deadline_ms is not None else -1,
            "weir.scheduler.queued_prefill_tokens": self.load.queued_prefill_tokens,
        }

    async def _admit(self, req: Tokenized, traceparent: str | None, cached: int | None) -> None:
        """Decide, trace the decision, and pass the request on (or reject it).
        ``cached`` is the kv_manager's count of already-cached prompt tokens (None: unknown)."""
        rejected = self.decide(req)
        self.decisions[rejected.reason if rejected else "accepted"] += 1
        with _TRACER.start_as_current_span(
                "admission.decide", context=tracing.context_from(traceparent),
                attributes=self._decision_attributes(req, rejected, cached)):
            log.info("admission", request_id=req.request_id,
                     decision=rejected.reason if rejected else "accepted")
        if rejected is not None:
            await self.to_streamer.send(EventBatch([rejected]))
            return
        self.outstanding[req.request_id] = req.tenant
        self.per_tenant[req.tenant] += 1
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
                                            or req.request_id in self.outstanding):
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
                    if cancel.request_id in self.outstanding:
                        await self.to_scheduler.send(cancel)
                case SchedulerLoad() as load:
                    self.load = load
                case Holding(requests=held):          # after our restart: resume the counts
                    for rid, tenant in held:
                        if rid not in self.outstanding:
                            self.outstanding[rid] = tenant
                            self.per_tenant[tenant] += 1
                case Released(request_ids=ids):
                    now = time.monotonic()
                    for rid in ids:
                        tenant = self.outstanding.pop(rid, None)
                        if tenant is not None:
                            self.per_tenant[tenant] -= 1
                            self.releases.ended(now)

    async def peer_restarted(self, name: str) -> None:
        if name == "scheduler":                        # it dropped everything it held
            self.outstanding.clear()
            self.per_tenant.clear()

    def stats(self) -> dict[str, float]:
        return {"outstanding": len(self.outstanding),
                **{f"decisions.{k}": v for k, v in self.decisions.items()}}
