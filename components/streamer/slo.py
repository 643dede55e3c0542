"""Per-class latency, SLO and goodput counts, as the streamer sees them.

The streamer forwards every request's events, from the SDK and from the gateway alike
(the gateway is an SDK client), so what it measures covers all traffic. Times are its own
(monotonic): TTFT is arrival at the streamer to the first delta it forwarded, which is
what the client waits for (tokenizing, admission's queue, detokenizing and the hops
included) and what a request's ``deadline_ms`` ("from arrival") promises. TPOT is
(finish - first token) / (tokens - 1), over the longest choice when ``n > 1``. ITL is the
gap between choice 0's consecutive deltas (one per engine step that gave it tokens): one
bisect per delta. Queue, prefill and decode are the scheduler's (``RequestTiming`` on
``Finished``), admission's queue is ``Accepted.queued_s``.

Goodput: every request that ends, whatever ended it, is counted once, either as *good*
(finished, its first token within its TTFT objective, its TPOT within its class's) or as
*missed*, by reason: ``ttft``, ``tpot``, ``both``, ``deadline`` (finished at its
end-to-end bound, its output cut short: finish reason ``deadline``), ``rejected`` (refused
for load or budget), ``expired`` (``deadline_expired``, wherever it was: no first token by
its TTFT deadline or its end-to-end bound), ``failed``, ``cancelled``.
A request with no objective that finishes is good; one that never got a first token is a
TTFT miss, as ``weir replay`` counts it. Refusals of a request that could never be served
as asked (``NOT_SERVABLE``) count on neither side: they are the client's error, not the
engine's. Until admission names a request's class, it is the one admission would grant
(``schemas.resolve``'s label: the class asked for if one is configured, else the tenant's
default), so a request refused before it runs is counted under its class; a name nobody
configured never becomes a label.

``stats()`` keys, ``<class>`` last because a class name may hold dots:

- ``slo.<ttft|tpot>.<met|missed>.<class>``: only where there is an objective (TTFT: the
  request's ``deadline_ms``, else its class's ``ttft_slo_ms``: ``schemas.resolve``).
- ``degraded.<class>``: finished requests admission had degraded.
- ``goodput.requests.<class>``, ``goodput.tokens.<class>`` (every choice's generated
  tokens), ``goodput.missed.<reason>.<class>``, ``goodput.missed_tokens.<class>`` (tokens
  of finished requests that missed, ``deadline`` ones included).
- ``<kind>_ms.le.<edge>.<class>`` cumulative bucket counts (edges are whole
  milliseconds), ``<kind>_ms.sum.<class>`` (milliseconds) and ``<kind>_ms.count.<class>``,
  for each kind of ``EDGES_MS``.

Each observation costs a bisect into fixed edges; ``stats()`` accumulates the buckets.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass
from itertools import accumulate

from schemas.client import STRUCTURED_OUTPUT_ERROR, Accepted, Cancelled, Failed, Finished, Rejected
from schemas.config import AdmissionConfig, ServiceClass
from schemas.resolve import ttft_deadline_ms

LATENCY_EDGES_MS = (5, 10, 20, 40, 60, 80, 100, 250, 500, 750, 1000, 2500, 5000, 7500,
                    10000, 20000, 40000, 80000)
TPOT_EDGES_MS = (5, 10, 15, 20, 25, 30, 40, 50, 75, 100, 150, 200, 300, 400, 500, 750,
                 1000, 2500)
EDGES_MS = {"ttft": LATENCY_EDGES_MS, "tpot": TPOT_EDGES_MS, "e2e": LATENCY_EDGES_MS,
            "itl": TPOT_EDGES_MS, "queue": LATENCY_EDGES_MS, "prefill": LATENCY_EDGES_MS,
            "decode": LATENCY_EDGES_MS, "admission_queue": LATENCY_EDGES_MS}
MISSED = ("ttft", "tpot", "both", "deadline", "rejected", "expired", "failed", "cancelled")
# refusals of what could never be served as asked: counted neither good nor missed
NOT_SERVABLE = frozenset({"invalid_request", "unknown_tenant", "prompt_too_long",
                          "unauthenticated", "class_not_allowed", "idempotency_key_reused"})


class Histogram:
    """Counts per bucket (the last one past every edge), a sum and a count."""

    __slots__ = ("count", "counts", "edges", "sum")

    def __init__(self, edges: tuple[int, ...]) -> None:
        self.edges = edges
        self.counts = [0] * (len(edges) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, ms: float) -> None:
        self.counts[bisect_left(self.edges, ms)] += 1      # first edge with ms <= edge
        self.sum += ms
        self.count += 1

    def cumulative(self) -> list[int]:
        """Requests at or under each edge, in the order of ``edges``."""
        return list(accumulate(self.counts[:-1]))


@dataclass
class RequestClock:
    """One request's timeline and grant, kept on the streamer's record of it."""

    started: float                      # monotonic seconds at arrival
    deadline_ms: int | None = None      # the request's own TTFT deadline
    service_class: str = ""             # admission's grant (``Accepted``), else its guess
    degraded: bool = False
    admitted: bool = False              # admission accepted it (``Accepted``)
    first_token: float | None = None
    last_token: float | None = None     # choice 0's latest delta
    itl: Histogram | None = None        # its class's, once ``Accepted`` names the class

    def token(self, now: float, index: int = 0) -> None:
        if self.first_token is None:
            self.first_token = now
        if index == 0:
            if self.last_token is not None and self.itl is not None:
                self.itl.observe((now - self.last_token) * 1e3)
            self.last_token = now


class SloStats:
    def __init__(self, classes: dict[str, ServiceClass]) -> None:
        self.classes = classes
        self.outcomes: Counter[str] = Counter()
        self.degraded: Counter[str] = Counter({name: 0 for name in classes})
        self.histograms: dict[tuple[str, str], Histogram] = {}
        for name, cls in classes.items():          # configured objectives show from the start
            for kind, slo in (("ttft", cls.ttft_slo_ms), ("tpot", cls.tpot_slo_ms)):
                if slo is not None:
                    self.outcomes.update({f"slo.{kind}.met.{name}": 0,
                                          f"slo.{kind}.missed.{name}": 0})
            self.outcomes.update({f"goodput.requests.{name}": 0, f"goodput.tokens.{name}": 0,
                                  f"goodput.missed_tokens.{name}": 0})
            self.outcomes.update({f"goodput.missed.{why}.{name}": 0 for why in MISSED})

    @classmethod
    def for_config(cls, adm: AdmissionConfig) -> SloStats:
        return cls(adm.service_classes())

    def accepted(self, clock: RequestClock, event: Accepted) -> None:
        name = clock.service_class = event.service_class
        clock.degraded, clock.admitted = event.degraded, True
        clock.itl = self._histogram("itl", name)
        self._histogram("admission_queue", name).observe(event.queued_s * 1e3)

    def ended(self, clock: RequestClock, event: Finished | Rejected | Failed | Cancelled,
              now: float) -> str | None:
        """Count a request's end: its latencies if it finished, and good or missed.
        Returns "good", the reason it missed (``MISSED``), or None (counted on neither
        side)."""
        name = clock.service_class
        match event:
            case Finished():
                return self._finished(clock, now, event)
            case Rejected(reason=why) if why in NOT_SERVABLE:
                return None
            case Failed(reason=why) if why.startswith(STRUCTURED_OUTPUT_ERROR):
                return None                             # its own language: a retry fails too
            case Rejected(reason="deadline_expired"):
                missed = "expired"
            case Rejected():
                missed = "rejected"
            case Failed():
                missed = "failed"
            case _:
                missed = "cancelled"
        self.outcomes[f"goodput.missed.{missed}.{name}"] += 1
        return missed

    def _finished(self, clock: RequestClock, now: float, event: Finished) -> str:
        name = clock.service_class
        cls = self.classes.get(name)
        self._observe("e2e", name, (now - clock.started) * 1e3)
        if (t := event.timing) is not None:
            self._observe("queue", name, t.queue_s * 1e3)
            self._observe("prefill", name, t.prefill_s * 1e3)
            self._observe("decode", name, t.decode_s * 1e3)
        self.degraded[name] += clock.degraded
        ttft_late = tpot_late = False
        if clock.first_token is None:         # nothing was streamed: no first token to time
            ttft_late = True
        else:
            ttft_ms = (clock.first_token - clock.started) * 1e3
            self._observe("ttft", name, ttft_ms)
            objective = ttft_deadline_ms(clock.deadline_ms, cls)
            ttft_late = self._outcome("ttft", name, ttft_ms, objective)
            tokens = generated_tokens(event)
            if tokens > 1:
                tpot_ms = (now - clock.first_token) * 1e3 / (tokens - 1)
                self._observe("tpot", name, tpot_ms)
                tpot_late = self._outcome("tpot", name, tpot_ms,
                                          cls.tpot_slo_ms if cls is not None else None)
        if event.finish_reason == "deadline" or ttft_late or tpot_late:
            missed = "deadline" if event.finish_reason == "deadline" else \
                "both" if ttft_late and tpot_late else "ttft" if ttft_late else "tpot"
            self.outcomes[f"goodput.missed.{missed}.{name}"] += 1
            self.outcomes[f"goodput.missed_tokens.{name}"] += event.usage.completion_tokens
            return missed
        self.outcomes[f"goodput.requests.{name}"] += 1
        self.outcomes[f"goodput.tokens.{name}"] += event.usage.completion_tokens
        return "good"

    def _histogram(self, kind: str, name: str) -> Histogram:
        hist = self.histograms.get((kind, name))
        if hist is None:
            hist = self.histograms[kind, name] = Histogram(EDGES_MS[kind])
        return hist

    def _observe(self, kind: str, name: str, ms: float) -> None:
        self._histogram(kind, name).observe(ms)

    def _outcome(self, kind: str, name: str, ms: float, objective: float | None) -> bool:
        """Count met or missed against ``objective``; whether it was missed."""
        if objective is None:
            return False
        late = ms > objective
        self.outcomes[f"slo.{kind}.{'missed' if late else 'met'}.{name}"] += 1
        return late

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.outcomes)
        out.update({f"degraded.{name}": n for name, n in self.degraded.items()})
        for (kind, name), hist in self.histograms.items():
            out.update({f"{kind}_ms.le.{le}.{name}": n
                        for le, n in zip(hist.edges, hist.cumulative())})
            out[f"{kind}_ms.sum.{name}"] = hist.sum
            out[f"{kind}_ms.count.{name}"] = hist.count
        return out


def generated_tokens(event: Finished) -> int:
    """Tokens of the longest choice: the choices decode side by side, so TPOT is per
    choice, not per token of their sum."""
    return max((c.completion_tokens for c in event.choices),
               default=event.usage.completion_tokens)
