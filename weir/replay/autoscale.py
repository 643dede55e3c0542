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
  A continuously batching replica is busy whenever one stream decodes, so it also
  reads near 1 long after the load has gone.
- ``headroom:T`` -- leading signals: admission's predicted queue seconds (the wait a new
  prompt would see before its prefill, ``components/admission/stats.py``), averaged
  over the ready replicas, against T × the TTFT SLO, and the prompt tokens arriving
  against the replicas' measured prefill rate. It asks for the fewest replicas that
  would hold both: the backlog the ready ones hold, spread over n, waits
  ``ready × queue / n`` (the queue scales with load over capacity), at most the target;
  and the prompt tokens a second fill at most ``LOAD_CEILING`` of n replicas' prefill
  rate. So it grows the moment a burst is admitted (before any first token is late) and
  shrinks as soon as one replica fewer would still hold the SLO, not one step at a time.

Replicas still starting count as carrying no load (HPA's rule for pods not yet ready
when it scales up): a rule on a per-replica average asks for ``ceil(ready × metric /
target)`` replicas in all, not that many more than are starting. Each rule keeps the
current count while the metric is within ``tolerance`` (10%, as HPA) of its target.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("fixed", "rps", "util", "headroom")
LOAD_CEILING = 0.5      # headroom: prompt tokens may fill at most this share of prefill


@dataclass(frozen=True)
class Signals:
    """What the autoscaler sees at one evaluation, over the interval just ended."""

    t_s: float
    current: int                # replicas asked for (ready + starting; not draining)
    ready: int                  # of those, serving
    rps: float = 0.0            # requests arriving at the router per second
    utilisation: float = 0.0    # mean busy fraction of the ready replicas
    queue_s: float = 0.0        # mean predicted queue seconds of the ready replicas
    prompt_tps: float = 0.0     # prompt tokens arriving at the router per second
    capacity_tps: float = 0.0   # mean measured prefill tokens/s of the ready replicas
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


def _proportional(current: int, ready: int, per_ready: float, target: float,
                  tolerance: float) -> int:
    """HPA's rule on a per-replica average: ``ceil(ready × metric / target)`` replicas in
    all (the starting ones carry nothing yet), unchanged while the fleet's average (the
    starting ones as zero) is within the tolerance of the target."""
    need = ready * per_ready / target
    if current and abs(need / current - 1.0) <= tolerance:
        return current
    return math.ceil(need - 1e-9)


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
        return _proportional(s.current, s.ready, s.utilisation, rule.target, rule.tolerance)
    by_queue = _proportional(s.current, s.ready, s.queue_s, rule.target * s.ttft_slo_s,
                             rule.tolerance)
    by_load = math.ceil(s.prompt_tps / (s.capacity_tps * LOAD_CEILING) - 1e-9) \
        if s.capacity_tps > 0 else 0
    return max(by_queue, by_load, 1)


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
