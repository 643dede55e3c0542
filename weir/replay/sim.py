"""``weir simulate``: the engine's real policies against a virtual clock.

Admission is the production ``AdmissionPolicy``, scheduling the production
``SchedulerCore``, KV the production ``BlockPool`` (through the kv_manager's own
``apply_ops``). Only the executor is simulated: a step takes the time the cost profile
predicts for its shape, and samples a fixed token. The processes' messages are delivered at
once, in the order the services send them: admission asks the pool what is cached, decides,
hands the request to the core (the message the admission service sends); the core's KV ops
are applied and their grants returned before it plans again; after each message the
scheduler would get, its late work is dropped as the scheduler loop drops it
(``components.scheduler.late``); the scheduler's load report reaches admission every
100 ms, as live.

Speculative decoding (a ``[speculative]`` section with a method other than "off"): the
scheduler chooses each decode row's k as live; the simulated executor's draft source always
proposes all k, and each verify keeps a geometric number of them: every draft is accepted
with the row's class's true rate (``speculative.class_priors``, else ``acceptance_prior``,
unless ``acceptance``, class -> rate with "*" for the rest, says otherwise) until the first
one rejected, drawn from ``seed``. The step takes the time the profile predicts with the k
draft tokens of each speculating row computed. The core's
step-cost model starts from the profile's coefficients (``cost_prior``, on by default with
speculation: the prior a live executor measures at startup; a compute price is what k is
chosen from), then learns from the simulated steps as live.

Deterministic: the same trace, config, profile and seed give the same records.

Besides the records, a run's ``meta`` says how the engine spent the virtual time: ``busy_s``
(a step in flight), ``idle_intervals`` (``(start_s, end_s)`` with none: nothing could run) and
``max_step_s`` (the longest step), ``max_step_seqs`` (the most sequences in one step),
``deadline_dropped`` (late work the scheduler dropped), ``deadline_finished`` (requests it
ended decoding at their end-to-end bound), and carries the config's tenant ``weights``.
"""
from __future__ import annotations

import heapq
import random
import time
import zlib
from collections.abc import Callable

from components.admission.decision import Decision, Kind
from components.admission.policy import AdmissionPolicy
from components.costs.cost_model import plan_shape
from components.kv_manager.ops import apply_ops
from components.kv_manager.pool import BlockPool
from components.kv_manager.service import tenant_budgets
from components.scheduler.chunking import step_budget
from components.scheduler.core import Outcome, SchedulerCore
from components.scheduler.decode_window import DecodeWindow, decode_classes
from components.scheduler.late import LateDrops
from components.scheduler.load import (
    LOAD_INTERVAL_S,
    PoolCounts,
    load_report,
    released_outputs,
    released_ttft,
)
from schemas.config import WeirConfig
from schemas.validate import check_params
from schemas.wire import RequestHeader, SamplingParams, StepPlan, StepResult, Tokenized, deadline_ns
from weir.replay.profile import CostProfile
from weir.replay.types import (
    CANCELLED,
    COMPLETED,
    FAILED,
    REJECTED,
    RequestRecord,
    RunResult,
    Scaling,
    TimelinePoint,
    TraceRequest,
)

SAMPLED_TOKEN = 1          # what the simulated executor "samples"; never an eos (ignore_eos)
_NS = 1_000_000_000
_ARRIVAL, _CANCEL, _STEP_DONE, _SAMPLE = 0, 1, 2, 3
_LOAD_NS = round(LOAD_INTERVAL_S * _NS)


class Simulator:
    """One config over one trace. ``tokens(req)`` gives a request's prompt ids and
    ``hashes(ids, tenant)`` their block hashes, as the tokenizer would."""

    def __init__(self, config: WeirConfig, profile: CostProfile, *, label: str = "",
                 tokens: Callable[[TraceRequest], list[int]],
                 hashes: Callable[[list[int], str], list[int]],
                 timeline_points: int = 400, seed: int = 0,
                 acceptance: dict[str, float] | None = None,
                 cost_prior: bool | None = None) -> None:
        self.config, self.profile, self.label = config, profile, label
        self.tokens, self.hashes = tokens, hashes
        kv = config.kv
        self.policy = AdmissionPolicy(config)
        self.core = SchedulerCore(config.scheduler, kv, config.engine.max_model_len, epoch=1,
                                  tenants=config.admission.tenants,
                                  speculative=config.speculative)
        self.pool = BlockPool(kv.num_blocks, kv.block_size, kv.enable_prefix_cache,
                              kv.num_cpu_blocks, kv.watermark_blocks, emit_events=False,
                              tenant_blocks=tenant_budgets(config.admission))
        self.cost = self.core.cost                   # the scheduler's own, learning as live
        spec = config.speculative
        if cost_prior if cost_prior is not None else spec.on:
            self.cost.set_prior(profile.coef)        # the executor's startup probe, as live
        # speculation's true acceptance per class (default: the configured priors) and the
        # draws of each verify's accepted drafts
        self._acceptance = dict(spec.class_priors) | dict(acceptance or {})
        self._default_acceptance = self._acceptance.pop("*", spec.acceptance_prior)
        self._rng = random.Random(seed)
        self.decodes = DecodeWindow()                # its decode steps, for the load report
        self.late = LateDrops()                      # the scheduler's late drop, as live
        self.timeline_points = timeline_points
        self.records: dict[str, RequestRecord] = {}
        self.last_token_ns: dict[str, int] = {}
        self.now = 0
        self._events: list[tuple[int, int, int, object]] = []
        self._order = 0
        self._step: tuple[StepResult, object, float, frozenset[str]] | None = None
        self._load_tick = -1
        self.timeline: list[TimelinePoint] = []
        self.busy_ns = 0                             # virtual time with a step in flight
        self.max_step_ns = 0
        self.max_step_seqs = 0
        self.idle: list[tuple[float, float]] = []    # (start_s, end_s) with no step in flight
        self._idle_since: int | None = 0

    # ------------------------------------------------------------------ driver
    def run(self, requests: list[TraceRequest], scaling: Scaling = Scaling()) -> RunResult:
        started = time.perf_counter()
        for req in requests:
            self._push(round(req.arrival_s * _NS), _ARRIVAL, req)
        last_arrival = max((r.arrival_s for r in requests), default=0.0)
        self._sample_every = max(round(last_arrival * _NS / self.timeline_points), _NS // 10)
        self._push(0, _SAMPLE, None)
        pending_arrivals = len(requests)
        while self._events:
            t, _, kind, data = heapq.heappop(self._events)
            self.now = t
            if kind == _ARRIVAL:
                pending_arrivals -= 1
                self._arrive(data)
            elif kind == _STEP_DONE:
                self._finish_step()
            elif kind == _CANCEL:
                if self.policy.cancel(data):             # still queued in admission
                    rec = self.records[data]
                    rec.terminal, rec.e2e_s = CANCELLED, self.now / _NS - rec.sent_s
                else:
                    seq = self.core.by_request.get(data)
                    if seq is not None and seq.first_scheduled_ns:   # started, no token yet
                        self.records[data].queue_s = max(
                            seq.first_scheduled_ns - seq.arrival_ns, 0) / _NS
                    self._emit(self.core.cancel(data), CANCELLED)
                    self._drop_late()
            elif kind == _SAMPLE:
                self._drain_queue()                      # admission's 20 ms tick, coarser
                self._sample()
                if pending_arrivals or self.core.has_work:
                    self._push(t + self._sample_every, _SAMPLE, None)
                continue
            self._drain_queue()
            self._pump()
        self._close_idle(self.now)
        for rec in self.records.values():      # nothing left to happen, yet not finished
            if rec.e2e_s is None:
                rec.terminal, rec.reason = FAILED, "stalled: the engine could never run it"
        records = sorted(self.records.values(), key=lambda r: r.index)
        ends = [r.sent_s + (r.e2e_s or 0.0) for r in records]
        first = min((r.arrival_s for r in records), default=0.0)
        return RunResult(
            label=self.label, mode="simulated", records=records, timeline=self.timeline,
            scaling=scaling, duration_s=max(ends, default=0.0) - first,
            meta={"wasted_tokens": self.core.wasted_tokens,
                  "preemptions": self.core.preemptions, "steps": self.core.steps,
                  "deadline_dropped": self.late.dropped,
                  "deadline_finished": self.late.finished,
                  "profile": self.profile.describe(), "machine": self.profile.machine,
                  "policy": self.config.admission.policy,
                  "weights": {t.name: t.weight for t in self.config.admission.tenants},
                  "busy_s": self.busy_ns / _NS, "max_step_s": self.max_step_ns / _NS,
                  "max_step_seqs": self.max_step_seqs,
                  "idle_intervals": self.idle,
                  "speculation": self.core.spec_stats(),
                  "sim_wall_s": round(time.perf_counter() - started, 3)})

    def _push(self, t: int, kind: int, data: object) -> None:
        self._order += 1
        heapq.heappush(self._events, (t, self._order, kind, data))

    # ------------------------------------------------------------------ admission
    def _arrive(self, req: TraceRequest) -> None:
        rid = f"r{req.index}"
        tenant = req.tenant or "default"
        ids = self.tokens(req)
        out = req.max_tokens if req.max_tokens is not None else (req.output_tokens or 1)
        params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True, n=req.n)
        hashes = self.hashes(ids, tenant) if self.config.kv.enable_prefix_cache else []
        header = RequestHeader(rid, tenant, params, self.now, asked_class=req.service_class,
                               ttft_deadline_ns=deadline_ns(self.now, req.deadline_ms))
        tok = Tokenized(header, ids, hashes)
        arrival = self.now / _NS
        rec = RequestRecord(index=req.index, request_id=rid, tenant=tenant,
                            service_class=req.service_class or "default",
                            session_id=req.session_id, arrival_s=arrival, sent_s=arrival,
                            prompt_tokens=len(ids), deadline_ms=req.deadline_ms, n=req.n)
        self.records[rid] = rec
        self._refresh_load()
        if check_params(params) is not None:    # the streamer's edge check, as live
            rec.decision, rec.reason = Kind.REJECT, "invalid_request"
            rec.terminal, rec.e2e_s = REJECTED, 0.0
            return
        bs = self.config.kv.block_size
        cached = self.pool.cached_tokens(tenant, hashes, ids[:len(hashes) * bs],
                                         (len(ids) - 1) // bs) if hashes else 0
        d = self.policy.decide(tok, cached, arrival)     # cached: admission's CacheQuery
        rec.decision, rec.reason = d.kind, d.reason
        rec.service_class = d.service_class or rec.service_class
        if req.cancel_after_s is not None:
            self._push(self.now + round(req.cancel_after_s * _NS), _CANCEL, rid)
        if d.kind == Kind.REJECT:
            rec.terminal, rec.e2e_s = REJECTED, 0.0
        elif d.kind != Kind.QUEUE:
            self._start(tok, d)

    def _start(self, tok: Tokenized, d: Decision, waited_s: float = 0.0) -> None:
        """Hand an admitted request to the scheduler: the message the admission service
        sends (``AdmissionPolicy.admitted``), taken in as the scheduler loop takes it.
        Its queue time (arrival → first scheduled) comes with its first token."""
        req = self.policy.admitted(tok, d, waited_s)
        self.late.watch(req, self.core.add(req))
        self._drop_late()

    def _drop_late(self) -> None:
        """After each message the scheduler would get (an admitted request, a step's
        result, a cancel), end its late work as the scheduler loop does (late.py): a
        request whose class drops late work and that has no first token by its deadline,
        or any with none by its end-to-end bound, ends ``deadline_expired``, its KV freed
        and nothing planned for it again. Its record is what a live replay records of a
        ``Rejected`` after ``Accepted``: a rejection with that reason, ended when it was
        dropped. One decoding at its end-to-end bound completes, finish reason
        ``deadline``."""
        if not self.late.due(self.now):
            return
        out, dropped = self.late.drop(self.core, self.now)
        self._emit(out, REJECTED)
        for d in dropped:
            rec = self.records[d.request_id]
            if d.rejected is None:
                rec.terminal = COMPLETED
            else:
                rec.decision, rec.reason = "reject", d.rejected.reason

    def _drain_queue(self) -> None:
        """Admission's queue: expire what waited too long, release what now fits."""
        if not self.policy.queued:
            return
        now_s = self.now / _NS
        for rej in self.policy.expire(now_s):
            rec = self.records[rej.request_id]
            rec.terminal, rec.reason, rec.decision = REJECTED, rej.reason, "reject"
            rec.e2e_s = now_s - rec.sent_s
        for tok, d, waited in self.policy.release(now_s):
            self._start(tok, d, waited)

    def _refresh_load(self) -> None:
        """Admission sees the scheduler's load report of the last 100 ms tick, as live; it
        is computed when admission next needs it rather than at every tick."""
        tick = self.now - self.now % _LOAD_NS
        if tick != self._load_tick:
            self._load_tick = tick
            self.policy.on_load(load_report(
                self.core, self.cost, self.config.scheduler.max_num_batched_tokens, self.now,
                self.decodes, PoolCounts(self.pool.num_free, self.pool.num_evictable),
                slack=self.config.scheduler.chunking == "slack"),
                self.now / _NS)

    # ------------------------------------------------------------------ scheduler + kv
    def _settle_kv(self) -> bool:
        """Deliver the core's KV ops to the pool and the grants back; True if any."""
        moved = False
        while (ops := self.core.take_kv_ops()) is not None:
            moved = True
            grants = apply_ops(self.pool, ops)
            if grants:
                self.core.on_grants(grants, self.pool.num_cpu_free)
        return moved

    def _pump(self) -> None:
        """Plan a step if none is in flight, as the service does after every message."""
        core = self.core
        for _ in range(4):                  # a plan, or grants that let the next try plan
            if core.in_flight or not core.has_work:
                break
            budget = None
            if self.config.scheduler.chunking == "slack":
                budget = step_budget(core, self.cost,
                                     self.config.scheduler.max_num_batched_tokens,
                                     now_ns=self.now).tokens
            plan = core.schedule(self.now, budget)
            if plan is not None:
                self._start_step(plan)
                self._settle_kv()
                break
            if not self._settle_kv():
                break
        self._settle_kv()

    def _start_step(self, plan: StepPlan) -> None:
        by_seq = self.core.by_seq
        shape = plan_shape(plan, lambda seq_id: by_seq[seq_id].num_computed)
        seconds = max(self.profile.predict(shape), 1e-6)
        rows = [(st.num_tokens, by_seq[st.seq_id]) for st in plan.steps]
        classes = decode_classes((tokens, seq.num_computed, seq.prompt_len,
                                  (seq.group[0] if seq.group else seq).service_class)
                                 for tokens, seq in rows)
        seq_ids: list[int] = []
        drafts: list[tuple[int, int, int]] = []
        for st in plan.steps:
            if st.sample and st.draft_k:        # a verify: its accepted drafts, then its own
                accepted = self._accepted(by_seq[st.seq_id].service_class, st.draft_k)
                drafts.append((st.seq_id, st.draft_k, accepted))
                seq_ids.extend([st.seq_id] * (1 + accepted))
            elif st.sample:
                seq_ids.extend([st.seq_id] * st.num_samples)
        ns = round(seconds * _NS)
        self._step = (StepResult(plan.step_id, seq_ids, [SAMPLED_TOKEN] * len(seq_ids), ns,
                                 drafts=drafts),
                      shape, self.cost.predict(shape), classes)
        self._close_idle(self.now)
        self.busy_ns += ns
        self.max_step_ns = max(self.max_step_ns, ns)
        self.max_step_seqs = max(self.max_step_seqs, shape.seqs)
        self._push(self.now + ns, _STEP_DONE, None)

    def acceptance(self, service_class: str) -> float:
        """The true chance that a draft of ``service_class`` is accepted."""
        return self._acceptance.get(service_class, self._default_acceptance)

    def _accepted(self, service_class: str, k: int) -> int:
        """How many of ``k`` drafts a verify keeps: each accepted with the class's rate, up
        to the first rejected."""
        a, p = 0, self.acceptance(service_class)
        while a < k and self._rng.random() < p:
            a += 1
        return a

    def _close_idle(self, now: int) -> None:
        if self._idle_since is not None and now > self._idle_since:
            self.idle.append((self._idle_since / _NS, now / _NS))
        self._idle_since = None

    def _finish_step(self) -> None:
        result, shape, predicted, classes = self._step
        self._step = None
        self._idle_since = self.now             # until the next step starts (_pump, at once)
        self.cost.observe(shape, result.elapsed_ns / _NS)
        self.decodes.step(self.now, result.elapsed_ns / _NS, predicted, classes,
                          pure=shape.tokens == shape.seqs)
        self._emit(self.core.on_result(result, self.now))
        self._drop_late()

    # ------------------------------------------------------------------ outputs
    def _emit(self, out: Outcome, terminal: str = COMPLETED) -> None:
        """Deliver what the core produced: tokens to their records; the released ones end
        ``terminal`` and go back to admission's ledger."""
        now_s = self.now / _NS
        for item in out.tokens:
            rec = self.records[item.request_id]
            if item.index == 0 and item.token_ids:     # (a "deadline" end brings none)
                last = self.last_token_ns.get(item.request_id)
                if last is None:
                    rec.ttft_s = now_s - rec.sent_s
                    if item.params is not None:
                        rec.queue_s = item.params.queue_time_s
                else:
                    rec.itl_s.append((self.now - last) / _NS)
                self.last_token_ns[item.request_id] = self.now
            rec.output_tokens += len(item.token_ids)
            if item.finish_reason is not None and item.index == 0:
                rec.finish_reason = item.finish_reason
                rec.preemptions = item.timing.preemptions if item.timing else 0
                rec.cached_tokens = item.usage.cached_tokens if item.usage else 0
        for rid in out.released:
            rec = self.records[rid]
            rec.terminal = terminal
            rec.e2e_s = now_s - rec.sent_s
            self.last_token_ns.pop(rid, None)
        if out.released:
            self.policy.released(out.released, now_s, released_outputs(out), released_ttft(out))

    def _sample(self) -> None:
        kv = self.config.kv
        self.timeline.append(TimelinePoint(
            self.now / _NS, len(self.core.running), len(self.core.waiting) + self.policy.queued,
            kv.num_blocks - self.pool.num_free, kv.num_blocks))


def fast_block_hashes(block_size: int) -> Callable[[list[int], str], list[int]]:
    """The simulator's stand-in for the tokenizer's block hashes: chained over the prefix and
    scoped per tenant like ``components.model.hashing.block_hashes``, but Python's tuple
    hash instead of blake2b (10x faster; the pool verifies every hit's tokens, so a
    collision could never be read as a hit)."""
    def hashes(ids: list[int], scope: str) -> list[int]:
        out, parent = [], zlib.crc32(scope.encode())
        for start in range(0, len(ids) - block_size + 1, block_size):
            parent = hash((parent, tuple(ids[start:start + block_size])))
            out.append(parent)
        return out
    return hashes
