"""Autoscaler rules for the fleet simulator (``weir simulate --autoscale``), pure: given
the fleet's signals at one evaluation, a rule recommends a replica count
(``recommend``); given the recommendations of the last minutes, the stabilisation
windows decide the count the fleet moves to (``stabilise``), as Kubernetes' HPA does
(``behavior.scaleUp/scaleDown.stabilizationWindowSeconds``).

Rules:

- ``fixed:N`` -- always N.
- ``rps:T`` -- the classic HPA on a pods metric: T requests per second per replica,
  ``ceil(rps / T)``. Lagging for LLMs in the sense that matters: a request is not a unit
  of work (a 30-token prompt and a 2,000-token prompt count the same).
- ``util:T`` -- the classic HPA on utilisation: the fraction of time a replica had a
  step in flight, ``ceil(ready × util / T)``. It saturates at 1, so it cannot say how
  far past capacity the fleet is, and it is measured over the last interval (lagging).
- ``headroom:T`` -- a leading signal: admission's predicted queue seconds (the wait a
  new prompt would see before its prefill, ``components/admission/stats.py``), averaged
  over the ready replicas, against T × the TTFT SLO. Above it the fleet grows in
  proportion (``ceil(current × queue / target)``), as HPA grows on an averaged metric;
  below a quarter of it (headroom to spare) it shrinks by one; between, it holds. The
  queue builds the moment a burst is admitted, before any first token is late.

Each HPA rule keeps the current count while the metric is within ``tolerance`` (10%, as
HPA) of its target.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("fixed", "rps", "util", "headroom")
SHRINK_BELOW = 0.25     # headroom: a queue below this share of the target shrinks by one


@dataclass(frozen=True)
class Signals:
    """What the autoscaler sees at one evaluation, over the interval just ended."""

    t_s: float
    current: int                # replicas asked for (ready + starting; not draining)
    ready: int                  # of those, serving
    rps: float = 0.0            # requests arriving at the router per second
    utilisation: float = 0.0    # mean busy fraction of the ready replicas
    queue_s: float = 0.0        # mean predicted queue seconds of the ready replicas
    ttft_slo_s: float = 3.0     # the TTFT objective the headroom is measured against


@dataclass(frozen=True)
class Rule:
    """One autoscaler: its rule and target, its bounds and its stabilisation windows."""

    kind: str = "fixed"
    target: float = 1.0
    min_replicas: int = 1
    max_replicas: int = 16
    up_window_s: float = 0.0        # scale up to the lowest recommendation of this window
    down_window_s: float = 300.0    # scale down to the highest recommendation of this one
    tolerance: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown autoscaler {self.kind!r}: expected one of "
                             f"{', '.join(KINDS)}")
        if not self.target > 0:
            raise ValueError(f"autoscaler {self.kind}: target must be > 0, got {self.target}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("autoscaler: need 1 <= min_replicas <= max_replicas")
        if self.up_window_s < 0 or self.down_window_s < 0:
            raise ValueError("autoscaler: stabilisation windows must be >= 0")

    @property
    def label(self) -> str:
        return f"fixed:{int(self.target)}" if self.kind == "fixed" else \
            f"{self.kind}:{self.target:g}"

    @property
    def initial(self) -> int:
        return int(self.target) if self.kind == "fixed" else self.min_replicas


def parse_rule(spec: str, **bounds) -> Rule:
    """``fixed:4``, ``rps:2.5``, ``util:0.7``, ``headroom:0.3`` (see the module doc)."""
    kind, _, target = spec.partition(":")
    if not target:
        raise ValueError(f"bad autoscaler {spec!r}: expected KIND:TARGET, KIND one of "
                         f"{', '.join(KINDS)}")
    value = float(target)
    if kind == "fixed":
        if value != int(value) or value < 1:
            raise ValueError(f"bad autoscaler {spec!r}: fixed takes a replica count >= 1")
        n = int(value)
        bounds = {**bounds, "min_replicas": n, "max_replicas": max(n, bounds.get(
            "max_replicas", n))}
    return Rule(kind, value, **bounds)


def _proportional(current: int, ratio: float, tolerance: float) -> int:
    """HPA's ``ceil(current × metric / target)``, unchanged within the tolerance."""
    if abs(ratio - 1.0) <= tolerance:
        return current
    return math.ceil(current * ratio - 1e-9)


def recommend(rule: Rule, s: Signals) -> int:
    """The replica count ``rule`` asks for on ``s``, before stabilisation and bounds."""
    if rule.kind == "fixed":
        return int(rule.target)
    if rule.kind == "rps":
        if s.current and abs(s.rps / (s.current * rule.target) - 1.0) <= rule.tolerance:
            return s.current
        return math.ceil(s.rps / rule.target - 1e-9)
    if s.ready == 0:                      # no replica to measure: keep what is asked
        return s.current
    if rule.kind == "util":
        return _proportional(s.ready, s.utilisation / rule.target, rule.tolerance) \
            + (s.current - s.ready)       # the starting ones count as asked for
    target = rule.target * s.ttft_slo_s   # headroom
    if s.queue_s > target * (1 + rule.tolerance):
        return math.ceil(s.current * s.queue_s / target - 1e-9)
    if s.queue_s < target * SHRINK_BELOW:
        return s.current - 1
    return s.current


def stabilise(rule: Rule, history: Sequence[tuple[float, int]], now_s: float,
              current: int) -> int:
    """The count to move to: ``history`` holds ``(t_s, recommendation)``, the latest last.
    Up to the lowest recommendation within the scale-up window, down to the highest within
    the scale-down window (HPA's rule), then within the bounds."""
    def within(window: float) -> list[int]:
        return [r for t, r in history if now_s - t <= window + 1e-9]

    ups, downs = within(rule.up_window_s), within(rule.down_window_s)
    up_to = min(ups) if ups else current
    down_to = max(downs) if downs else current
    n = current
    if current < up_to:
        n = up_to
    elif current > down_to:
        n = down_to
    return max(rule.min_replicas, min(rule.max_replicas, n))
