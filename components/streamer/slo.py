"""Per-class latency and SLO counts for finished requests, as the streamer sees them.

The streamer forwards every request's events, from the SDK and from the gateway alike
(the gateway is an SDK client), so what it measures covers all traffic. Times are its own
(monotonic): TTFT is arrival at the streamer to the first delta it forwarded, which is
what the client waits for (tokenizing, admission's queue, detokenizing and the hops
included) and what a request's ``deadline_ms`` ("from arrival") promises. TPOT is
(finish - first token) / (tokens - 1), over the longest choice when ``n > 1``.

``stats()`` keys, ``<class>`` last because a class name may hold dots:

- ``slo.<ttft|tpot>.<met|missed>.<class>``: only where there is an objective (TTFT: the
  request's ``deadline_ms``, else its class's ``ttft_slo_ms``, as admission uses it).
- ``degraded.<class>``: finished requests admission had degraded.
- ``<ttft|tpot|e2e>_ms.le.<edge>.<class>`` cumulative bucket counts (edges are whole
  milliseconds), ``<kind>_ms.sum.<class>`` (milliseconds) and ``<kind>_ms.count.<class>``.

Each finish costs a bisect into fixed edges; ``stats()`` accumulates the buckets.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass
from itertools import accumulate

from schemas.client import Finished
from schemas.config import ServiceClass

LATENCY_EDGES_MS = (5, 10, 20, 40, 60, 80, 100, 250, 500, 750, 1000, 2500, 5000, 7500,
                    10000, 20000, 40000, 80000)
TPOT_EDGES_MS = (5, 10, 15, 20, 25, 30, 40, 50, 75, 100, 150, 200, 300, 400, 500, 750,
                 1000, 2500)
EDGES_MS = {"ttft": LATENCY_EDGES_MS, "tpot": TPOT_EDGES_MS, "e2e": LATENCY_EDGES_MS}


@dataclass
class RequestClock:
    """One request's timeline and grant, kept on the streamer's record of it."""

    started: float                      # monotonic seconds at arrival
    deadline_ms: int | None = None      # the request's own TTFT deadline
    service_class: str = ""             # from ``Accepted``
    degraded: bool = False
    first_token: float | None = None

    def token(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now


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

    def finished(self, clock: RequestClock, now: float, tokens: int) -> None:
        """Record a request that ended ``Finished`` at ``now`` with ``tokens`` generated in
        its longest choice."""
        name = clock.service_class
        cls = self.classes.get(name)
        self._observe("e2e", name, (now - clock.started) * 1e3)
        self.degraded[name] += clock.degraded
        if clock.first_token is None:         # nothing was streamed: no first token to time
            return
        ttft_ms = (clock.first_token - clock.started) * 1e3
        self._observe("ttft", name, ttft_ms)
        objective = clock.deadline_ms if clock.deadline_ms is not None else \
            cls.ttft_slo_ms if cls is not None else None
        self._outcome("ttft", name, ttft_ms, objective)
        if tokens > 1:
            tpot_ms = (now - clock.first_token) * 1e3 / (tokens - 1)
            self._observe("tpot", name, tpot_ms)
            self._outcome("tpot", name, tpot_ms, cls.tpot_slo_ms if cls is not None else None)

    def _observe(self, kind: str, name: str, ms: float) -> None:
        hist = self.histograms.get((kind, name))
        if hist is None:
            hist = self.histograms[kind, name] = Histogram(EDGES_MS[kind])
        hist.observe(ms)

    def _outcome(self, kind: str, name: str, ms: float, objective: float | None) -> None:
        if objective is not None:
            self.outcomes[f"slo.{kind}.{'met' if ms <= objective else 'missed'}.{name}"] += 1

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
