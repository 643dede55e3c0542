"""``weir simulate --autoscale``: a fleet of simulated replicas behind the production
routing policy, grown and shrunk by an autoscaler rule, on one virtual clock.

- **Replicas.** Each is the single-replica ``Simulator`` (sim.py) unchanged: the
  production admission policy, ``SchedulerCore`` and ``BlockPool``, and the cost
  profile's step times. The fleet only merges their event queues into one clock
  (``ReplicaSim.handle`` is ``Simulator.run``'s loop body, one event at a time).
- **Routing.** The router's own ``RoutingCore`` (components/router/routing.py) over
  ``membership.Replica`` objects, as the router service keeps them: every
  ``router.load_interval_s`` each serving replica's load report (a ``StatusReport``
  with its admission policy's ``stats()`` and its pool's free and total blocks) is
  taken in through ``Membership.heard``; ``Accepted``, ``Rejected`` and first tokens go
  through ``RoutingCore.answered`` / ``note_prefilled``, so the router's correction of a
  stale report (``predicted_queue_s`` in scoring.py) runs as live; a rejection for
  load before acceptance is rerouted as live. Approximated: the prefix index is read
  straight from the replica's pool (live, it follows the KV event stream a moment
  late; the CPU tier counts as GPU); messages take no time; a reroute happens only for
  a refusal at admission's decision (a queued request that expires is not rerouted).
- **Cold start.** A replica the autoscaler adds is paid for at once and serves
  ``cold_start_s`` later (weights, kernel plan, warm-up, registration); until then the
  router sees it unhealthy and sends it nothing.
- **Scale-down drains.** A replica let go takes no new work (it is *retiring* at the
  router), finishes what it has (its admission queue included), and is removed, and
  stops costing, once it is idle. One still starting is cancelled at once.
- **Autoscaler.** Every ``scale_interval_s`` the rule (autoscale.py) sees the fleet's
  signals over the interval and recommends a count; the stabilisation windows decide.
  The predicted queue is each replica's mean over the load reports of the interval
  (``average_queue``; else the report scraped at the evaluation, a point sample that
  swings with every admitted prompt).

Deterministic: the same trace, config, profile, seed and rule give the same result.
Cost is replica-seconds: each replica from the moment it is asked for until it is gone
(or the run ends).
"""
from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from components.router.index import PrefixMatch, ReplicaIndex
from components.router.membership import Membership, Replica, load_query_id
from components.router.routing import Flight, RoutingCore, note_prefilled
from schemas.client import Accepted, ComponentStatus, Rejected, StatusReport, Submit
from schemas.config import ReplicaSpec, WeirConfig
from schemas.wire import SamplingParams
from weir.replay.autoscale import Rule, Signals, recommend, stabilise
from weir.replay.profile import CostProfile
from weir.replay.sim import _ARRIVAL, _CANCEL, _NS, _SAMPLE, _STEP_DONE, Simulator
from weir.replay.types import CANCELLED, COMPLETED, REJECTED, RunResult, Scaling, TraceRequest

_TICK_LOAD, _TICK_SCALE, _READY = 10, 11, 12


class ReplicaSim(Simulator):
    """One replica of the fleet: the single-replica simulator, driven one event at a
    time by the fleet's clock, telling the fleet what its router would hear."""

    def __init__(self, fleet: FleetSim, name: str, born_ns: int, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.fleet, self.name, self.born_ns = fleet, name, born_ns
        self.ready_ns: int | None = None
        self.gone_ns: int | None = None
        self._sample_every = fleet.sample_every
        self._idle_since = born_ns

    def next_ns(self) -> int | None:
        return self._events[0][0] if self._events else None

    def handle(self) -> None:
        """``Simulator.run``'s loop body for this replica's next event."""
        t, _, kind, data = heapq.heappop(self._events)
        self.now = t
        if kind == _STEP_DONE:
            self._finish_step()
        elif kind == _CANCEL:
            if self.policy.cancel(data):
                rec = self.records[data]
                rec.terminal, rec.e2e_s = CANCELLED, self.now / _NS - rec.sent_s
            else:
                seq = self.core.by_request.get(data)
                if seq is not None and seq.first_scheduled_ns:
                    self.records[data].queue_s = max(
                        seq.first_scheduled_ns - seq.arrival_ns, 0) / _NS
                self._emit(self.core.cancel(data), CANCELLED)
                self._drop_late()
        elif kind == _SAMPLE:
            self._drain_queue()
            self._sample()
            if self.fleet.pending or self.busy:
                self._push(t + self._sample_every, _SAMPLE, None)
            return
        self._drain_queue()
        self._pump()

    def arrive(self, req: TraceRequest, now: int) -> None:
        self.now = now
        self._arrive(req)
        self._drain_queue()
        self._pump()

    @property
    def busy(self) -> bool:
        return self.core.has_work or bool(self.policy.queued)

    def _emit(self, out, terminal: str = COMPLETED) -> None:
        super()._emit(out, terminal)
        self.fleet.heard(self, out)


class PoolIndex(ReplicaIndex):
    """The router's prefix index of one replica, read from its pool (live: kept from its
    KV events, a moment late). ``RoutingCore.state`` calls ``match`` as on the real one."""

    def __init__(self, sim: ReplicaSim, fleet: FleetSim) -> None:
        super().__init__()
        self.sim, self.fleet = sim, fleet

    def match(self, hashes: list[int], public_scope: str, public_blocks: int,
              tenant: str) -> PrefixMatch:
        ids, bs = self.fleet.routing_ids, self.sim.config.kv.block_size
        cached = self.sim.pool.cached_tokens(tenant, hashes, ids[:len(hashes) * bs],
                                             (len(ids) - 1) // bs)
        return PrefixMatch(gpu_blocks=cached // bs)


@dataclass
class FleetPoint:
    t_s: float
    asked: int          # ready + starting
    ready: int
    alive: int          # paid for: ready + starting + draining
    desired: int
    signals: Signals | None = None      # what the rule saw (None: the start)
    recommended: int | None = None      # what it asked for, before the windows


@dataclass
class FleetResult:
    rule: Rule
    run: RunResult
    replica_seconds: float
    max_alive: int
    points: list[FleetPoint] = field(default_factory=list)
    scale_ups: int = 0
    scale_downs: int = 0


class FleetSim:
    """One autoscaler ``rule`` over one trace: replicas built from ``config`` and
    ``profile``, ``tokens`` and ``hashes`` as for ``Simulator``."""

    def __init__(self, config: WeirConfig, profile: CostProfile, rule: Rule, *,
                 tokens: Callable[[TraceRequest], list[int]],
                 hashes: Callable[[list[int], str], list[int]],
                 cold_start_s: float = 30.0, scale_interval_s: float = 15.0,
                 ttft_slo_s: float = 3.0, initial: int | None = None,
                 label: str = "", average_queue: bool = True) -> None:
        if cold_start_s < 0 or not scale_interval_s > 0:
            raise ValueError("need cold_start_s >= 0 and scale_interval_s > 0")
        self.config, self.profile, self.rule = config, profile, rule
        self.hashes = hashes
        self._last_ids: tuple[int, list[int]] | None = None
        self._tokens = tokens
        self.cold_ns = round(cold_start_s * _NS)
        self.interval_ns = round(scale_interval_s * _NS)
        self.load_ns = round(config.router.load_interval_s * _NS)
        self.ttft_slo_s = ttft_slo_s
        self.average_queue = average_queue
        self._queue_samples: dict[str, list[float]] = {}
        self.initial = initial if initial is not None else rule.initial
        self.label = label or rule.label
        self.router = RoutingCore(config.router, config.admission, config.kv.block_size,
                                  idempotency_ttl_s=600.0)
        self.members = Membership()
        self.sims: dict[str, ReplicaSim] = {}
        self.all_sims: list[ReplicaSim] = []
        self.flights: dict[str, Flight] = {}
        self.where: dict[int, ReplicaSim] = {}     # request index -> its replica now
        self.routing_ids: list[int] = []
        self.now = 0
        self.pending = 0
        self._events: list[tuple[int, int, int, object]] = []
        self._order = 0
        self._serial = 0
        self.history: list[tuple[float, int]] = []
        self.points: list[FleetPoint] = []
        self._arrived_in_interval = 0
        self._prompt_in_interval = 0
        self._busy_mark: dict[str, int] = {}
        self.scale_ups = self.scale_downs = 0
        self.sample_every = _NS

    # ------------------------------------------------------------------ plumbing
    def tokens(self, req: TraceRequest) -> list[int]:
        """The prompt's ids, made once for the router and its replica."""
        if self._last_ids is None or self._last_ids[0] != req.index:
            self._last_ids = (req.index, self._tokens(req))
        return self._last_ids[1]

    def _push(self, t: int, kind: int, data: object) -> None:
        self._order += 1
        heapq.heappush(self._events, (t, self._order, kind, data))

    def _add_replica(self, ready_at: int | None) -> ReplicaSim:
        """A new replica, asked for now; it serves at ``ready_at`` (None: at once)."""
        name = f"replica-{self._serial}"
        self._serial += 1
        sim = ReplicaSim(self, name, self.now, self.config, self.profile, label=name,
                         tokens=self.tokens, hashes=self.hashes, timeline_points=50)
        r = self.members.add(ReplicaSpec(name, f"tcp://{name}:0"))
        r.index = PoolIndex(sim, self)
        self.sims[name] = sim
        self.all_sims.append(sim)
        if ready_at is None:
            self._ready(sim)
        else:
            self._push(ready_at, _READY, name)
        return sim

    def _ready(self, sim: ReplicaSim) -> None:
        r = self.members.get(sim.name)
        if r is None or r.retiring:
            return
        sim.ready_ns = self.now
        r.healthy = True
        self._busy_mark[sim.name] = sim.busy_ns
        sim._idle_since = self.now
        sim._push(self.now, _SAMPLE, None)
        self._report(sim, r)

    def _report(self, sim: ReplicaSim, r: Replica) -> None:
        """The replica's load report, answering the router's query sent now."""
        sim.now = self.now
        sim._refresh_load()
        kv = sim.config.kv
        report = StatusReport(load_query_id(self.now), (
            ComponentStatus("admission", 0, True, "ready", 0, 0.0, sim.policy.stats()),
            ComponentStatus("kv_manager", 0, True, "ready", 0, 0.0,
                            {"total_blocks": float(kv.num_blocks),
                             "free_blocks": float(sim.pool.num_free)})))
        Membership.heard(r, report, self.now / _NS)

    def heard(self, sim: ReplicaSim, out) -> None:
        """A replica's tokens and ends, as its router hears them."""
        r = self.members.get(sim.name)
        now = self.now / _NS
        for item in out.tokens:
            f = self.flights.get(item.request_id)
            if f is not None and r is not None and item.index == 0 and item.token_ids:
                note_prefilled(r, f, now)
        for rid in out.released:
            f = self.flights.pop(rid, None)
            if f is not None and r is not None:
                note_prefilled(r, f, now)
                r.open.discard(rid)

    # ------------------------------------------------------------------ routing
    def _route(self, req: TraceRequest, f: Flight | None = None) -> None:
        rid = f"r{req.index}"
        tenant = req.tenant or "default"
        if f is None:
            ids = self.tokens(req)
            out = req.max_tokens if req.max_tokens is not None else (req.output_tokens or 1)
            if len(ids) + out <= self.config.engine.max_model_len:   # else refused unserved
                self._prompt_in_interval += len(ids)
            sub = Submit(rid, prompt_token_ids=None, tenant=tenant,
                         params=SamplingParams(max_tokens=out, temperature=0.0,
                                               ignore_eos=True, n=req.n),
                         deadline_ms=req.deadline_ms, service_class=req.service_class,
                         session_id=req.session_id)
            f = Flight(b"", sub, tenant, self.now / _NS, len(ids),
                       hashes=self.hashes(ids, tenant)
                       if self.config.kv.enable_prefix_cache else [])
            self.flights[rid] = f
        self.routing_ids = self.tokens(req)
        now = self.now / _NS
        replicas = list(self.members)
        route = self.router.route(f, replicas, self.flights, now)
        if route.decision is None:
            # nowhere to go (every replica starting or draining): the router refuses it
            sim = self.where.get(req.index) or self._any_sim()
            sim.now = self.now
            sim._arrive(req)
            rec = sim.records[rid]
            rec.decision, rec.reason = "reject", "no_replica"
            rec.terminal, rec.e2e_s = REJECTED, 0.0
            self.flights.pop(rid, None)
            self.where[req.index] = sim
            return
        r = self.members[route.decision.replica]
        sim = self.sims[r.name]
        self.router.assign(f, r, route)
        self.where[req.index] = sim
        sim.arrive(req, self.now)
        rec = sim.records[rid]
        if rec.terminal == REJECTED and rec.e2e_s == 0.0:
            body = Rejected(rid, rec.reason, "")
            if self.router.answered(f, r, body, replicas, now) == "reroute":
                self._route(req, f)
                return
            r.open.discard(rid)
            self.flights.pop(rid, None)
        else:
            self.router.answered(f, r, Accepted(rid, rec.prompt_tokens), replicas, now)

    def _any_sim(self) -> ReplicaSim:
        return next(iter(self.sims.values()))

    # ------------------------------------------------------------------ autoscaling
    def _asked(self) -> list[Replica]:
        return [r for r in self.members if not r.retiring]

    def _scale(self) -> None:
        now_s = self.now / _NS
        asked = self._asked()
        ready = [r for r in asked if r.healthy]
        interval = self.interval_ns / _NS
        util = queue = capacity = 0.0
        measured = 0
        for r in ready:
            sim = self.sims[r.name]
            self._report(sim, r)              # the metrics as scraped now
            since = max(self.now - self.interval_ns, sim.ready_ns or 0)
            span = max(self.now - since, 1)
            util += min((sim.busy_ns - self._busy_mark.get(r.name, 0)) / span, 1.0)
            self._busy_mark[r.name] = sim.busy_ns
            samples = self._queue_samples.get(r.name) if self.average_queue else None
            queue += sum(samples) / len(samples) if samples else \
                r.stat("admission", "predicted_queue_s", 0.0)
            if (rate := r.stat("admission", "prefill_tokens_per_s", 0.0)) > 0:
                capacity += rate              # (none until its scheduler has measured it)
                measured += 1
        signals = Signals(now_s, len(asked), len(ready),
                          rps=self._arrived_in_interval / interval,
                          utilisation=util / len(ready) if ready else 0.0,
                          queue_s=queue / len(ready) if ready else 0.0,
                          prompt_tps=self._prompt_in_interval / interval,
                          capacity_tps=capacity / measured if measured else 0.0,
                          ttft_slo_s=self.ttft_slo_s)
        self._arrived_in_interval = self._prompt_in_interval = 0
        self._queue_samples.clear()
        rec = recommend(self.rule, signals)
        self.history.append((now_s, rec))
        keep = max(self.rule.up_window_s, self.rule.down_window_s)
        self.history = [(t, n) for t, n in self.history if now_s - t <= keep + 1e-9]
        desired = stabilise(self.rule, self.history, now_s, len(asked))
        if desired > len(asked):
            self.scale_ups += 1
            for _ in range(desired - len(asked)):
                self._add_replica(self.now + self.cold_ns)
        elif desired < len(asked):
            self.scale_downs += 1
            # the ones still starting go first (newest first), then the least loaded
            order = sorted(asked, key=lambda r: (r.healthy, len(r.open),
                                                 -self.sims[r.name].born_ns))
            for r in order[:len(asked) - desired]:
                r.retiring = True
                self._maybe_gone(self.sims[r.name])
        self._point(desired, signals, rec)

    def _maybe_gone(self, sim: ReplicaSim) -> None:
        r = self.members.get(sim.name)
        if r is None or not r.retiring or sim.busy:
            return
        for rid in [rid for rid in r.open if sim.records[rid].e2e_s is not None]:
            r.open.discard(rid)
            self.flights.pop(rid, None)
        if r.open:
            return
        sim.gone_ns = self.now
        sim._close_idle(self.now)
        self.members.let_go(r)
        del self.sims[sim.name]

    def _point(self, desired: int, signals: Signals | None = None,
               recommended: int | None = None) -> None:
        asked = self._asked()
        self.points.append(FleetPoint(self.now / _NS, len(asked),
                                      sum(r.healthy for r in asked), len(self.sims), desired,
                                      signals, recommended))

    # ------------------------------------------------------------------ driver
    def run(self, requests: list[TraceRequest], scaling: Scaling = Scaling()) -> FleetResult:
        started = time.perf_counter()
        last_arrival = max((r.arrival_s for r in requests), default=0.0)
        self.sample_every = max(round(last_arrival * _NS / 400), _NS // 10)
        for _ in range(self.initial):
            self._add_replica(None)
        for req in requests:
            self._push(round(req.arrival_s * _NS), _ARRIVAL, req)
        self.pending = len(requests)
        self._push(self.load_ns, _TICK_LOAD, None)
        self._push(self.interval_ns, _TICK_SCALE, None)
        self._point(self.initial)
        while True:
            t_fleet = self._events[0][0] if self._events else None
            nxt: ReplicaSim | None = None
            t_next = t_fleet
            for sim in self.sims.values():
                t = sim.next_ns()
                if t is not None and (t_next is None or t < t_next):
                    nxt, t_next = sim, t
            if t_next is None:
                break
            if nxt is not None:
                self.now = t_next
                nxt.handle()
                if nxt.name in self.members.replicas and self.members[nxt.name].retiring:
                    self._maybe_gone(nxt)
                continue
            t, _, kind, data = heapq.heappop(self._events)
            self.now = t
            if kind == _ARRIVAL:
                self.pending -= 1
                self._arrived_in_interval += 1
                self._route(data)
            elif kind == _READY:
                sim = self.sims.get(data)
                if sim is not None:
                    self._ready(sim)
            elif kind == _TICK_LOAD:
                self.router.expire(t / _NS)
                for r in list(self.members):
                    if r.healthy:
                        self._report(self.sims[r.name], r)
                        if not r.retiring:
                            self._queue_samples.setdefault(r.name, []).append(
                                r.stat("admission", "predicted_queue_s", 0.0))
                    if r.retiring:
                        self._maybe_gone(self.sims[r.name])
                if self._live():
                    self._push(t + self.load_ns, _TICK_LOAD, None)
            elif kind == _TICK_SCALE:
                self._scale()
                if self._live():
                    self._push(t + self.interval_ns, _TICK_SCALE, None)
        return self._result(requests, scaling, started)

    def _live(self) -> bool:
        return bool(self.pending) or any(s.busy or s._step is not None
                                         for s in self.sims.values())

    def _result(self, requests: list[TraceRequest], scaling: Scaling,
                started: float) -> FleetResult:
        records = []
        for req in requests:
            sim = self.where[req.index]
            rec = sim.records[f"r{req.index}"]
            if rec.e2e_s is None:
                rec.terminal, rec.reason = "failed", "stalled: the engine could never run it"
            records.append(rec)
        ends = [r.sent_s + (r.e2e_s or 0.0) for r in records]
        end_ns = round(max(ends, default=0.0) * _NS)      # the last request's end
        cost = 0.0
        alive: list[tuple[int, int]] = []
        for sim in self.all_sims:
            gone = sim.gone_ns if sim.gone_ns is not None else max(end_ns, sim.born_ns)
            cost += max(gone - sim.born_ns, 0) / _NS
            alive += [(sim.born_ns, 1), (gone, -1)]
        peak = level = 0
        for _, d in sorted(alive, key=lambda x: (x[0], x[1])):
            level += d
            peak = max(peak, level)
        first = min((r.arrival_s for r in records), default=0.0)
        run = RunResult(
            label=self.label, mode="simulated", records=records, scaling=scaling,
            duration_s=max(ends, default=0.0) - first,
            meta={"autoscaler": self.rule.label, "replica_seconds": cost, "max_replicas": peak,
                  "replicas": len(self.all_sims), "scale_ups": self.scale_ups,
                  "scale_downs": self.scale_downs,
                  "profile": self.profile.describe(), "machine": self.profile.machine,
                  "policy": self.config.admission.policy,
                  "weights": {t.name: t.weight for t in self.config.admission.tenants},
                  "wasted_tokens": sum(s.core.wasted_tokens for s in self.all_sims),
                  "preemptions": sum(s.core.preemptions for s in self.all_sims),
                  "fleet": [(p.t_s, p.asked, p.ready, p.alive, p.desired)
                            for p in self.points],
                  "sim_wall_s": round(time.perf_counter() - started, 3)})
        return FleetResult(self.rule, run, cost, peak, self.points, self.scale_ups,
                           self.scale_downs)


def render_timeline(res: FleetResult) -> str:
    """One line per evaluation: the fleet, what the rule saw and what it asked for."""
    lines = ["t_s\tasked\tready\talive\trecommended\tdesired\trps\tutil\tqueue_s"
             "\tprompt_tps\tcapacity_tps"]
    for p in res.points:
        s = p.signals
        sig = "\t".join("-" for _ in range(5)) if s is None else \
            f"{s.rps:.2f}\t{s.utilisation:.3f}\t{s.queue_s:.3f}\t{s.prompt_tps:.0f}\t" \
            f"{s.capacity_tps:.0f}"
        rec = "-" if p.recommended is None else str(p.recommended)
        lines.append(f"{p.t_s:.1f}\t{p.asked}\t{p.ready}\t{p.alive}\t{rec}\t{p.desired}"
                     f"\t{sig}")
    return "\n".join(lines) + "\n"


def render_fleet_table(results: list[FleetResult], slo_met: list[int]) -> str:
    """The autoscaler comparison: one row per rule over the same trace."""
    head = ("autoscaler", "goodput", "SLO misses", "rejected", "TTFT p99 (ms)",
            "replica-s", "mean replicas", "max replicas", "ups/downs")
    rows = [head]
    for res, met in zip(results, slo_met, strict=True):
        recs = res.run.records
        n = len(recs)
        ttfts = sorted(r.ttft_s for r in recs if r.ttft_s is not None)
        p99 = ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)] * 1e3 \
            if ttfts else float("nan")
        dur = res.run.duration_s
        rows.append((res.rule.label, f"{met / n * 100:.1f}% ({met}/{n})" if n else "-",
                     str(n - met), str(sum(r.terminal == REJECTED for r in recs)),
                     f"{p99:.0f}", f"{res.replica_seconds:.0f}",
                     f"{res.replica_seconds / dur:.2f}" if dur > 0 else "-",
                     str(res.max_alive), f"{res.scale_ups}/{res.scale_downs}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
