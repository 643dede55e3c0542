"""Prometheus metrics for the gateway: per-request latencies of HTTP requests measured
here, and engine state (queues, KV, prefix cache, preemptions, and the streamer's latency
and SLO counts of all traffic, SDK and HTTP) read from the latest status report.
Names follow vLLM's where the meaning is the same, under the ``weir:`` prefix."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from schemas.client import TenantUsage

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0)
_ITL = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
        0.5, 0.75, 1.0, 2.5)


class _EngineCollector:
    def __init__(self, model: str) -> None:
        self.model = model
        self.stats: dict[str, dict[str, float]] = {}
        self.tenants: dict[str, TenantUsage] = {}         # the scheduler's, per tenant

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self.model], value)
        return c

    def collect(self):
        sched = self.stats.get("scheduler", {})
        kv = self.stats.get("kv_manager", {})
        total = kv.get("total_blocks", 0) or 1
        yield self._gauge("weir:num_requests_running", "Sequences in the running batch.",
                          sched.get("running", 0))
        yield self._gauge("weir:num_requests_waiting", "Sequences waiting to be scheduled.",
                          sched.get("waiting", 0))
        yield self._gauge("weir:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                          1.0 - kv.get("free_blocks", total) / total)
        yield self._gauge("weir:kv_free_blocks", "Free KV blocks (including evictable cached).",
                          kv.get("free_blocks", 0))
        yield self._counter("weir:prefix_cache_queries",
                            "Prompt tokens looked up in the prefix cache.",
                            kv.get("prefix_query_tokens", 0))
        yield self._counter("weir:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                            kv.get("prefix_hit_tokens", 0))
        pre = CounterMetricFamily("weir:num_preemptions", "Sequences preempted, by kind.",
                                  labels=["model_name", "kind"])
        for kind in ("recompute", "swap"):
            pre.add_metric([self.model, kind], sched.get(f"preemptions.{kind}", 0))
        yield pre
        ex = self.stats.get("executor", {})
        yield self._counter("weir:structured_output_rows", "Rows sampled under structured "
                            "output's masks (all traffic).", ex.get("structured.rows", 0))
        yield self._counter("weir:structured_output_mask_seconds", "Time the executor spent "
                            "making and applying structured output's masks.",
                            ex.get("structured.mask_s", 0))
        yield self._counter("weir:structured_output_compile_wait_seconds", "Time executor "
                            "steps waited for a language's matcher to finish compiling "
                            "(it compiles while the step's forward pass runs).",
                            ex.get("structured.compile_wait_s", 0))
        yield self._gauge("weir:kv_cpu_tier_blocks", "Blocks in the executor's host-memory tier.",
                          kv.get("cpu_total_blocks", 0))
        yield self._gauge("weir:kv_cpu_tier_free_blocks", "Free host-tier blocks (incl. cached).",
                          kv.get("cpu_free_blocks", 0))
        yield self._gauge("weir:kv_cpu_tier_cached_blocks",
                          "Host-tier blocks holding demoted prefix KV.",
                          kv.get("cpu_cached_blocks", 0))
        yield self._gauge("weir:num_requests_swapped", "Sequences swapped out to the host tier.",
                          kv.get("swapped_seqs", 0))
        yield self._counter("weir:kv_swapped_out_blocks", "Blocks swapped out by preemption.",
                            sched.get("swapped_out_blocks", 0))
        yield self._counter("weir:kv_prefix_demoted_blocks",
                            "Evicted prefix blocks demoted to the host tier.",
                            kv.get("demoted_blocks", 0))
        yield self._counter("weir:kv_prefix_promoted_blocks",
                            "Host-tier prefix blocks copied back on a hit.",
                            kv.get("promoted_blocks", 0))
        yield self._gauge("weir:kv_watermark_blocks", "Blocks a new sequence's first lease "
                          "must leave free.", kv.get("watermark_blocks", 0))
        yield self._gauge("weir:kv_below_watermark", "1 while free blocks are under the "
                          "watermark (new sequences wait).", kv.get("below_watermark", 0))
        yield self._counter("weir:preemption_wasted_tokens",
                            "Computed tokens discarded by preemption.",
                            sched.get("wasted_tokens", 0))
        yield self._counter("weir:discarded_samples", "Tokens sampled for a sequence that "
                            "ended or was preempted while its step ran (overlapped steps).",
                            sched.get("discarded_samples", 0))
        yield self._gauge("weir:kv_cached_blocks", "Blocks holding reusable prefix KV.",
                          kv.get("cached_blocks", 0))
        yield self._gauge("weir:num_active_kv_tokens", "Tokens held in KV by running sequences.",
                          sched.get("active_kv_tokens", 0))
        yield self._counter("weir:kv_allocation_failures", "KV allocations the pool refused.",
                            kv.get("alloc_failures", 0))
        yield self._batch_histogram(sched)
        yield from self._spec_families(sched, self.stats.get("executor", {}))
        streamer = self.stats.get("streamer", {})
        yield self._counter("weir:request_cancellations", "Requests cancelled (client or timeout).",
                            streamer.get("requests.cancelled", 0))
        yield self._counter("weir:request_retries", "Submissions that were a client's retry "
                            "after a Retry-After rejection (the SDK's Submit.attempt > 0).",
                            streamer.get("requests.retries", 0))
        yield self._counter("weir:idempotent_attaches", "Submissions that attached to a running "
                            "or finished request with the same Idempotency-Key.",
                            streamer.get("requests.idempotent_attached", 0))
        rej = CounterMetricFamily("weir:request_rejections", "Requests rejected by admission, "
                                  "by reason and service class.",
                                  labels=["model_name", "reason", "class"])
        dec = CounterMetricFamily("weir:admission_decisions", "Admission decisions (accept, "
                                  "degrade, queue, reject) by service class.",
                                  labels=["model_name", "decision", "class"])
        depth = GaugeMetricFamily("weir:admission_queue_depth", "Requests held in admission's "
                                  "queue, by service class.", labels=["model_name", "class"])
        for key, value in self.stats.get("admission", {}).items():
            kind, _, rest = key.partition(".")
            if kind == "rejections":
                reason, _, cls = rest.partition(".")
                rej.add_metric([self.model, reason, cls], value)
            elif kind == "decisions":
                decision, _, cls = rest.partition(".")
                dec.add_metric([self.model, decision, cls], value)
            elif kind == "queue_depth":
                depth.add_metric([self.model, rest], value)
        yield rej
        yield dec
        yield depth
        tok = CounterMetricFamily("weir:tenant_tokens", "Tokens per tenant (processed = prompt "
                                  "and fed-back tokens computed; generated = sampled).",
                                  labels=["model_name", "tenant", "kind"])
        kvb = GaugeMetricFamily("weir:tenant_kv_blocks", "KV blocks held per tenant.",
                                labels=["model_name", "tenant"])
        vtc = GaugeMetricFamily("weir:tenant_virtual_counter", "Weighted service each tenant "
                                "received (input + 2 x output tokens, / weight): the scheduler "
                                "starts new work in this order (VTC).",
                                labels=["model_name", "tenant"])
        for tenant, usage in sorted(self.tenants.items()):
            kvb.add_metric([self.model, tenant], usage.kv_blocks)
            vtc.add_metric([self.model, tenant], usage.virtual_counter)
            tok.add_metric([self.model, tenant, "processed"], usage.processed_tokens)
            tok.add_metric([self.model, tenant, "generated"], usage.generated_tokens)
        yield tok
        yield kvb
        yield vtc
        yield from self._request_families(streamer)
        if "router" in self.stats:
            yield from self._router_families(self.stats["router"])

    def _batch_histogram(self, sched: dict[str, float]) -> HistogramMetricFamily:
        h = HistogramMetricFamily("weir:batch_size", "Sequences per scheduler step.",
                                  labels=["model_name"])
        buckets = sorted((float(k.removeprefix("batch_size.le.")), v) for k, v in sched.items()
                         if k.startswith("batch_size.le."))
        count = sched.get("batch_size.count", 0)
        h.add_metric([self.model], [(str(int(le)), v) for le, v in buckets] + [("+Inf", count)],
                     sum_value=sched.get("batch_size.sum", 0))
        return h

    def _spec_families(self, sched: dict[str, float], ex: dict[str, float]):
        """Speculative decoding (components/scheduler/speculation.py), from the scheduler's
        counts (``spec.*``; none while ``speculative.method = "off"``, when every family
        is empty) and the executor's drafting time. The acceptance rate is not exported:
        compute it over a window, as vLLM's docs do, as
        ``rate(weir:spec_accepted_tokens_total[5m]) / rate(weir:spec_draft_tokens_total[5m])``
        (by class); tokens per model pass as ``rate(weir:spec_emitted_tokens_total[5m]) /
        rate(weir:spec_verifies_total[5m])``."""
        labels = ["model_name", "class"]
        drafted = CounterMetricFamily(
            "weir:spec_draft_tokens", "Draft tokens verified, by service class (vLLM: "
            "vllm:spec_decode_num_draft_tokens, not by class).", labels=labels)
        accepted = CounterMetricFamily(
            "weir:spec_accepted_tokens", "Draft tokens the target accepted, by service class "
            "(vLLM: vllm:spec_decode_num_accepted_tokens, not by class). Acceptance rate: "
            "rate(weir:spec_accepted_tokens_total) / rate(weir:spec_draft_tokens_total).",
            labels=labels)
        skipped = CounterMetricFamily(
            "weir:spec_skipped_steps", "Steps with decode rows in which no row drafted, by "
            "reason (no_gain: no draft pays for its step time; budget: prefill took the "
            "token budget; tpot: a draft would stretch the step past the tightest TPOT "
            "objective; no_row: no row may draft; no_cost_model). No vLLM equivalent.",
            labels=["model_name", "reason"])
        ks: dict[int, float] = {}
        for key, value in sorted(sched.items()):
            head, field, rest = (key.split(".", 2) + ["", ""])[:3]
            if head != "spec":
                continue
            if field == "drafted":
                drafted.add_metric([self.model, rest], value)
            elif field == "accepted":
                accepted.add_metric([self.model, rest], value)
            elif field == "none":
                skipped.add_metric([self.model, rest], value)
            elif field == "k" and rest.isdigit():
                ks[int(rest)] = value
        yield from (drafted, accepted)
        yield self._counter("weir:spec_verifies", "Speculating rows verified: one per row per "
                            "model pass that checked drafts (vLLM: "
                            "vllm:spec_decode_num_drafts).", sched.get("spec.verifies", 0))
        yield self._counter("weir:spec_emitted_tokens", "Tokens the verified rows emitted (the "
                            "accepted drafts and the target's own token of each verify). "
                            "Tokens per model pass of a speculating row: "
                            "rate(weir:spec_emitted_tokens_total) / "
                            "rate(weir:spec_verifies_total) (vLLM's mean acceptance length, "
                            "1 + accepted / drafts).", sched.get("spec.emitted", 0))
        yield skipped
        yield self._counter("weir:spec_draft_seconds", "Time the executor spent proposing "
                            "drafts (the n-gram lookup or the draft model's forwards).",
                            ex.get("spec.draft_s", 0))
        h = HistogramMetricFamily("weir:spec_k", "Draft tokens (k) the scheduler gave each "
                                  "decode row it considered for speculation, per step (0: "
                                  "none). vLLM has no equivalent: its k is the fixed "
                                  "num_speculative_tokens.", labels=["model_name"])
        if ks:
            h.add_metric([self.model], [(str(le), sum(n for k, n in ks.items() if k <= le))
                                        for le in _SPEC_K]
                         + [("+Inf", sum(ks.values()))],
                         sum_value=sum(k * n for k, n in ks.items()))
        yield h

    def _router_families(self, router: dict[str, float]):
        """A gateway in front of `weir route`: the router's decisions by reason (prefix,
        load, session, idempotent, rerouted, round_robin, ...), its reroutes by the replica's
        rejection, and each replica's health and losses."""
        dec = CounterMetricFamily("weir:router_decisions", "Requests routed, by the reason "
                                  "the replica was chosen.", labels=["model_name", "reason"])
        rerouted = CounterMetricFamily("weir:router_reroutes", "Requests sent on to another "
                                       "replica after a rejection for load, by replica and "
                                       "the rejection's reason.",
                                       labels=["model_name", "replica", "reason"])
        healthy = GaugeMetricFamily("weir:router_replica_healthy", "1 while the router hears "
                                    "the replica.", labels=["model_name", "replica"])
        lost = CounterMetricFamily("weir:router_replica_lost", "Times the replica went silent "
                                   "or restarted (its open requests failed).",
                                   labels=["model_name", "replica"])
        for key, value in sorted(router.items()):
            parts = key.split(".")
            if key.startswith("requests.reason."):
                dec.add_metric([self.model, key[len("requests.reason."):]], value)
            elif parts[0] == "replica" and len(parts) >= 3:
                name, field = ".".join(parts[1:-1]), parts[-1]
                if len(parts) >= 4 and parts[-2] == "rerouted":
                    rerouted.add_metric([self.model, ".".join(parts[1:-2]), parts[-1]], value)
                elif field == "healthy":
                    healthy.add_metric([self.model, name], value)
                elif field == "lost":
                    lost.add_metric([self.model, name], value)
        yield from (dec, rerouted, healthy, lost)
        yield from self._fleetq_families(router)
        yield from self._signal_families(router)

    def _fleetq_families(self, router: dict[str, float]):
        """The router's fleet queue (components/router/fleetq.py; empty while
        ``router.fleet_queue`` is off): requests held per tenant, each tenant's virtual
        counter, the wait of those released, and the refusals by reason."""
        depth = GaugeMetricFamily("weir:router_fleet_queue_depth", "Requests held in the "
                                  "router's fleet queue, by tenant.",
                                  labels=["model_name", "tenant"])
        counter = GaugeMetricFamily("weir:router_fleet_virtual_counter", "Each tenant's "
                                    "weighted service across the fleet (VTC): the fleet "
                                    "queue releases the least first.",
                                    labels=["model_name", "tenant"])
        wait = GaugeMetricFamily("weir:router_fleet_queue_wait_seconds", "Wait in the fleet "
                                 "queue of the requests released from it (recent).",
                                 labels=["model_name", "quantile"])
        events = CounterMetricFamily("weir:router_fleet_queue_events", "Requests held, "
                                     "released, removed (cancelled) and refused "
                                     "(refused.queue_full, refused.deadline: at arrival; "
                                     "refused.expiring: held).",
                                     labels=["model_name", "event"])
        for key, value in sorted(router.items()):
            if key.startswith("fleetq.depth."):
                depth.add_metric([self.model, key[len("fleetq.depth."):]], value)
            elif key.startswith("fleetq.counter."):
                counter.add_metric([self.model, key[len("fleetq.counter."):]], value)
            elif key in ("fleetq.wait_ms.p50", "fleetq.wait_ms.p99"):
                wait.add_metric([self.model, "0.5" if key.endswith("p50") else "0.99"],
                                value / 1e3)
            elif key.startswith("fleetq.") and key.split(".")[1] in (
                    "held", "released", "removed", "refused"):
                events.add_metric([self.model, key[len("fleetq."):]], value)
        yield from (depth, counter, wait, events)

    def _signal_families(self, router: dict[str, float]):
        """The signals that lead latency (components/router/signals.py), per replica
        (``weir:replica_*``, label ``replica``: the pod's name in Kubernetes) and fleet-wide
        (over the replicas taking new work), for an autoscaler (docs/deploy.md)."""
        m = self.model
        per, fleet = ["model_name", "replica"], ["model_name"]
        gauges = {                    # field -> (name, doc)
            "queue_s": ("predicted_queue_seconds", "Predicted wait before a new prompt's "
                        "prefill starts: the replica's admission's prediction (its backlog "
                        "at its measured prefill rate) plus what the router sent since"),
            "kv_used": ("kv_pressure_ratio", "Fraction of KV blocks in use (used / total)"),
            "prefill_backlog_tokens": ("prefill_backlog_tokens", "Prompt (and recomputed) "
                                       "tokens waiting and running sequences have still to "
                                       "prefill"),
            "decode_backlog_tokens": ("decode_backlog_tokens", "Output tokens waiting and "
                                      "running sequences may still sample, at most "
                                      "(max_tokens, else max_model_len)")}
        fams: dict[tuple[bool, str], Metric] = {}
        for fld, (name, doc) in gauges.items():
            fams[False, fld] = GaugeMetricFamily(f"weir:replica_{name}", f"{doc}; per "
                                                 "replica.", labels=per)
            fams[True, fld] = GaugeMetricFamily(
                f"weir:{name}", f"{doc}; fleet-wide over the replicas taking new work "
                f"({'their mean' if fld == 'queue_s' else 'all of them'}).", labels=fleet)
        head = ("SLO headroom: 1 - predicted TTFT / the class's TTFT objective (predicted "
                "TTFT: weir:{}predicted_queue_seconds); 1 idle, 0 at the objective, < 0 "
                "past it")
        fams[False, "headroom"] = GaugeMetricFamily(
            "weir:replica_slo_headroom_ratio", head.format("replica_") + "; per replica and "
            "class.", labels=per + ["class"])
        fams[True, "headroom"] = GaugeMetricFamily(
            "weir:slo_headroom_ratio", head.format("") + "; fleet-wide, per class.",
            labels=fleet + ["class"])
        fams[False, "load_rejections"] = CounterMetricFamily(
            "weir:replica_load_rejections", "Refusals for load (overloaded, "
            "deadline_unmeetable, queue_full, kv_pressure, ...) the replica answered the "
            "router, rerouted or not; rate() it.", labels=per)
        fams[True, "load_rejections"] = CounterMetricFamily(
            "weir:load_rejections", "Requests the fleet refused for load, as their clients "
            "heard it (no replica could take one, or a replica's refusal was relayed); "
            "rate() it.", labels=fleet)
        fams[True, "replicas"] = GaugeMetricFamily(
            "weir:serving_replicas", "Replicas taking new work (healthy, reporting their "
            "load, not draining or retiring).", labels=fleet)
        for key, value in sorted(router.items()):
            head_, _, rest = key.partition("/")
            if head_ == "signal":
                replica, _, rest = rest.partition("/")
                labels = [m, replica]
            elif head_ == "fleet":
                labels = [m]
            else:
                continue
            fld, _, cls = rest.partition("/")
            fam = fams.get((head_ == "fleet", fld))
            if fam is not None:
                fam.add_metric(labels + [cls] if fld == "headroom" else labels, value)
        yield from fams.values()

    def _request_families(self, streamer: dict[str, float]):
        """SLO outcomes, goodput, degraded requests and latency histograms by service class,
        from the streamer's counts of every request (components/streamer/slo.py)."""
        slo = CounterMetricFamily("weir:slo_requests", "Finished requests that met or missed "
                                  "their objective, by service class and kind (ttft: the "
                                  "request's deadline_ms, else its class's ttft_slo_ms; tpot: "
                                  "the class's tpot_slo_ms). All traffic, SDK and HTTP.",
                                  labels=["model_name", "class", "kind", "outcome"])
        degraded = CounterMetricFamily("weir:degraded_requests", "Finished requests whose "
                                       "max_tokens admission lowered, by service class.",
                                       labels=["model_name", "class"])
        good = CounterMetricFamily("weir:goodput_requests", "Requests that finished within "
                                   "their SLO, by service class: a first token within the "
                                   "request's deadline_ms (else its class's ttft_slo_ms) and "
                                   "TPOT within the class's tpot_slo_ms, where it has them. "
                                   "With weir:slo_missed_requests, every request that ended "
                                   "is counted once. All traffic, SDK and HTTP.",
                                   labels=["model_name", "class"])
        good_tokens = CounterMetricFamily("weir:goodput_tokens", "Generated tokens (every "
                                          "choice's) of the requests in "
                                          "weir:goodput_requests, by service class.",
                                          labels=["model_name", "class"])
        missed = CounterMetricFamily("weir:slo_missed_requests", "Requests that ended outside "
                                     "their SLO, by service class and reason: ttft, tpot or "
                                     "both (finished late; no first token at all is ttft), "
                                     "deadline (finished at its end-to-end deadline, cut "
                                     "short), rejected (refused for load or budget), expired "
                                     "(deadline_expired, queued or admitted), failed, "
                                     "cancelled. A refusal of a request that could not be "
                                     "served as asked (invalid_request, prompt_too_long, "
                                     "unknown_tenant, class_not_allowed, unauthenticated, "
                                     "idempotency_key_reused, structured_output_error) counts "
                                     "in neither. All traffic, SDK and HTTP.",
                                     labels=["model_name", "class", "reason"])
        missed_tokens = CounterMetricFamily("weir:slo_missed_tokens", "Generated tokens of "
                                            "finished requests that missed their SLO (reason "
                                            "ttft, tpot, both or deadline), by service class.",
                                            labels=["model_name", "class"])
        goodput = {"requests": good, "tokens": good_tokens, "missed_tokens": missed_tokens}
        hists: dict[tuple[str, str], dict] = {}       # (kind, class) -> le, sum, count
        for key, value in sorted(streamer.items()):
            head, _, rest = key.partition(".")
            if head == "slo":
                kind, outcome, cls = rest.split(".", 2)
                slo.add_metric([self.model, cls, kind, outcome], value)
            elif head == "degraded":
                degraded.add_metric([self.model, rest], value)
            elif head == "goodput":
                field, _, cls = rest.partition(".")
                if field == "missed":
                    reason, _, cls = cls.partition(".")
                    missed.add_metric([self.model, cls, reason], value)
                elif field in goodput:
                    goodput[field].add_metric([self.model, cls], value)
            elif head.endswith("_ms") and head[:-3] in _REQUEST_HISTOGRAMS:   # ms, here s
                field, _, rest = rest.partition(".")
                edge, cls = rest.split(".", 1) if field == "le" else ("", rest)
                parts = hists.setdefault((head[:-3], cls), {"le": []})
                if field == "le":
                    parts["le"].append((int(edge), value))
                else:
                    parts[field] = value
        yield from (slo, degraded, good, good_tokens, missed, missed_tokens)
        for kind, doc in _REQUEST_HISTOGRAMS.items():
            h = HistogramMetricFamily(f"weir:request_{kind}_seconds", doc,
                                      labels=["model_name", "class"])
            for (of, cls), parts in sorted(hists.items()):
                if of == kind:
                    buckets = [(floatToGoString(ms / 1e3), v) for ms, v in sorted(parts["le"])]
                    h.add_metric([self.model, cls], buckets + [("+Inf", parts.get("count", 0))],
                                 sum_value=parts.get("sum", 0.0) / 1e3)
            yield h


_SPEC_K = range(17)          # k is whole and at most speculative.max_k (<= 16): exact buckets
_ALL = " All traffic, SDK and HTTP."
_REQUEST_HISTOGRAMS = {
    "ttft": "Time to first token, by service class, as the streamer sees it (arrival to the "
            "first delta it forwards)." + _ALL,
    "tpot": "Time per output token after the first, by service class (the longest choice's)."
            + _ALL,
    "itl": "Gaps between a request's consecutive output deltas (choice 0's; one per engine "
           "step that gave it tokens), by service class, as the streamer forwards them." + _ALL,
    "e2e": "Arrival to finish of finished requests, by service class." + _ALL,
    "queue": "Arrival to first scheduled (tokenizing, admission's queue and the scheduler's), "
             "by service class, from the scheduler's timing of finished requests." + _ALL,
    "admission_queue": "Time held in admission's queue (part of weir:request_queue_seconds), "
                       "by service class, of every admitted request." + _ALL,
    "prefill": "First scheduled to first token, by service class, from the scheduler's "
               "timing of finished requests." + _ALL,
    "decode": "First token to finish, by service class, from the scheduler's timing of "
              "finished requests." + _ALL,
}


class _TenantView:
    """A registry seen by one tenant: every series that carries a ``tenant`` label is
    dropped unless it is this tenant's; engine-wide series (no tenant label) stay."""

    def __init__(self, registry: CollectorRegistry, tenant: str) -> None:
        self.registry, self.tenant = registry, tenant

    def collect(self):
        for family in self.registry.collect():
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [s for s in family.samples
                            if s.labels.get("tenant", self.tenant) == self.tenant]
            yield kept


class GatewayMetrics:
    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram("weir:time_to_first_token_seconds", "Time to first token of "
                              "HTTP requests only, as the gateway sees it (all traffic: "
                              "weir:request_ttft_seconds).", m, buckets=_LATENCY, registry=r)
        self.itl = Histogram("weir:inter_token_latency_seconds", "Time between output tokens "
                             "of HTTP requests only (all traffic: weir:request_itl_seconds).",
                             m, buckets=_ITL, registry=r)
        self.queue = Histogram("weir:request_queue_time_seconds", "Time from arrival to first "
                               "scheduling, HTTP requests only (all traffic: "
                               "weir:request_queue_seconds).", m, buckets=_LATENCY,
                               registry=r)
        self.e2e = Histogram("weir:e2e_request_latency_seconds", "End-to-end latency of HTTP "
                             "requests only (all traffic: weir:request_e2e_seconds).",
                             m, buckets=_LATENCY, registry=r)
        self.prefill = Histogram("weir:request_prefill_time_seconds", "First scheduled to "
                                 "first token, HTTP requests only (all traffic: "
                                 "weir:request_prefill_seconds).", m, buckets=_LATENCY,
                                 registry=r)
        self.decode = Histogram("weir:request_decode_time_seconds", "First token to finish, "
                                "HTTP requests only (all traffic: "
                                "weir:request_decode_seconds).", m, buckets=_LATENCY, registry=r)
        self.success = Counter("weir:request_success", "Finished HTTP requests by reason "
                               "(all traffic: weir:goodput_requests plus "
                               "weir:slo_missed_requests of reason ttft, tpot, both or "
                               "deadline).",
                               m + ["finished_reason"], registry=r)
        self.errors = Counter("weir:request_errors", "HTTP requests that ended without "
                              "finishing, by kind (rejected:<reason>, cancelled, failed, "
                              "http_<status>).",
                              m + ["kind"], registry=r)
        self.structured = Counter("weir:structured_output_requests", "HTTP requests held to "
                                  "a language, by kind (json, json_object, regex, choice, "
                                  "grammar; a tool_choice's is json).", m + ["kind"],
                                  registry=r)
        self.prompt_tokens = Counter("weir:prompt_tokens", "Prompt tokens of finished HTTP "
                                     "requests.", m, registry=r)
        self.generation_tokens = Counter("weir:generation_tokens", "Tokens generated for "
                                         "finished HTTP requests (all traffic: "
                                         "weir:goodput_tokens plus weir:slo_missed_tokens).",
                                         m, registry=r)
        self.engine = _EngineCollector(model)
        r.register(self.engine)

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int,
                 queue_s: float, e2e_s: float, timing=None) -> None:
        self.success.labels(self.model, reason).inc()
        if timing is not None:
            self.prefill.labels(self.model).observe(timing.prefill_s)
            self.decode.labels(self.model).observe(timing.decode_s)
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.generation_tokens.labels(self.model).inc(completion_tokens)
        self.queue.labels(self.model).observe(queue_s)
        self.e2e.labels(self.model).observe(e2e_s)

    def error(self, kind: str) -> None:
        self.errors.labels(self.model, kind).inc()

    def render(self, tenant: str | None = None) -> bytes:
        """The exposition text: everything, or (``tenant``) only that tenant's labelled
        series beside the engine-wide ones."""
        return generate_latest(self.registry if tenant is None
                               else _TenantView(self.registry, tenant))
