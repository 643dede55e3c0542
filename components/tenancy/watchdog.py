"""The canary's watchdog: compares the requests the candidate decided (the canary: the
tenants in its share) with the rest (the baseline) over the last ``rollout.window_s``, and
says when to roll the candidate back or promote it. Pure and clock-free: the streamer
feeds it what it sees of each request (``decided``, ``ended``) and asks ``verdict(now)``.

What it compares, canary against baseline (``RolloutConfig``'s thresholds):

- **deadline misses**, per class: requests that missed (a late first token or TPOT, cut
  at their end-to-end bound, expired) over requests that ended, refusals included;
  rolled back when the canary's rate is more than ``max_miss_rate_increase`` above.
- **rejections**: refusals for load or budget over requests that ended, all classes.
- **starvation**, per class: the longest wait for a first token, of requests that ended
  in the window (those refused at once have none) and of those still waiting
  (``waiting``); rolled back when the canary's is ``max_wait_increase_s`` longer.
- **oscillation**: decisions that flip (admitted, then refused, or back) from one request
  to the next of the same tenant and class, over decisions.
- **cost**: tokens computed (uncached prompt and output) per good output token; rolled
  back when the canary's is over ``max_cost_ratio`` times the baseline's, or it has
  computed tokens and no good one.

A rate is compared once the canary has ``min_requests`` in the window (per class for the
per-class ones); the baseline's counts as 0 (cost: is not compared) until it has as many
itself, so a candidate is never judged on a handful of requests and never excused by a
baseline that has none. It promotes once ``promote_after_s`` passed since the trial began
with ``min_requests`` canary requests ended and no threshold crossed at that moment.

A trial's watch survives a restart of the streamer (``resumed``): the streamer keeps what
it fed the watchdog in a journal beside the config history, and a restarted one rebuilds
the watch from it and from the trial's version. The trial keeps its start (the version's
``applied_at``: ``promote_after_s`` counts from it, the time the streamer was down
included), its thresholds (the version's ``[rollout]``) and the canary requests it saw
end; its windows hold what the journal holds of the last ``window_s``. A resumed watch
rolls back as any does, but promotes only once the canary has ``min_requests`` ended
within the window it sees now (not on counts from before the gap alone).
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from schemas.config import RolloutConfig

_MAX_SAMPLES = 100_000          # per side and kind: a window longer than this forgets more


class Ended(msgspec.Struct, frozen=True, array_like=True, tag="e"):
    """One request's end as the watchdog counts it (a line of the journal, too)."""

    at: float                   # monotonic seconds
    canary: bool
    service_class: str
    missed: bool = False        # its deadline missed (ttft, tpot, deadline, expired)
    rejected: bool = False      # refused for load or budget
    wait_s: float | None = None  # arrival to first token (to its end if it had none and
    #                             was admitted); None: refused at once
    computed_tokens: int = 0    # uncached prompt + output tokens the engine computed
    good_tokens: int = 0        # its output tokens if it was good


class Decided(msgspec.Struct, frozen=True, array_like=True, tag="d"):
    """One of admission's decisions, as the watchdog counts it."""

    at: float
    canary: bool
    tenant: str
    service_class: str
    admitted: bool


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Literal["promote", "rollback"]
    reason: str


@dataclass
class Side:
    """One side's counts over the window."""

    ended: int = 0
    rejected: int = 0
    computed: int = 0
    good: int = 0
    decisions: int = 0
    flips: int = 0
    by_class: Counter[str] = field(default_factory=Counter)     # ended, by class
    missed: Counter[str] = field(default_factory=Counter)
    wait: dict[str, float] = field(default_factory=dict)         # the longest, by class

    def waited(self, cls: str, wait_s: float) -> None:
        self.wait[cls] = max(self.wait.get(cls, 0.0), wait_s)


class Watchdog:
    """The trial of one canary, begun at ``started`` (monotonic seconds)."""

    def __init__(self, rollout: RolloutConfig, started: float, resumed: bool = False) -> None:
        self.cfg = rollout
        self.started = started
        self.resumed = resumed          # rebuilt after a restart (``resumed``)
        self.ends: deque[Ended] = deque(maxlen=2 * _MAX_SAMPLES)
        self.decisions: deque[Decided] = deque(maxlen=2 * _MAX_SAMPLES)
        self.canary_ended = 0                    # since the trial began

    def decided(self, d: Decided) -> None:
        self.decisions.append(d)

    def ended(self, e: Ended) -> None:
        self.ends.append(e)
        self.canary_ended += e.canary

    def _forget(self, now: float) -> None:
        since = now - self.cfg.window_s
        for q in (self.ends, self.decisions):
            while q and q[0].at < since:
                q.popleft()

    def sides(self, now: float, waiting: dict[tuple[bool, str], float] | None = None
              ) -> tuple[Side, Side]:
        """The window's counts: (baseline, canary). ``waiting``: the longest wait so far
        of requests with no first token yet, by (canary, class)."""
        self._forget(now)
        sides = (Side(), Side())
        for e in self.ends:
            s = sides[e.canary]
            s.ended += 1
            s.by_class[e.service_class] += 1
            s.missed[e.service_class] += e.missed
            s.rejected += e.rejected
            s.computed += e.computed_tokens
            s.good += e.good_tokens
            if e.wait_s is not None:
                s.waited(e.service_class, e.wait_s)
        for (canary, cls), wait_s in (waiting or {}).items():
            sides[canary].waited(cls, wait_s)
        last: dict[tuple[bool, str, str], bool] = {}
        for d in self.decisions:
            s, key = sides[d.canary], (d.canary, d.tenant, d.service_class)
            s.decisions += 1
            if key in last and last[key] != d.admitted:
                s.flips += 1
            last[key] = d.admitted
        return sides

    def verdict(self, now: float, waiting: dict[tuple[bool, str], float] | None = None
                ) -> Verdict | None:
        """Roll back (the first threshold crossed, with why), promote, or neither yet."""
        base, can = self.sides(now, waiting)
        why = self._crossed(base, can)
        if why is not None:
            return Verdict("rollback", why)
        if now - self.started >= self.cfg.promote_after_s \
                and self.canary_ended >= self.cfg.min_requests \
                and (not self.resumed or can.ended >= self.cfg.min_requests):
            return Verdict("promote", f"held {now - self.started:.1f} s over "
                                      f"{self.canary_ended} canary requests")
        return None

    def _crossed(self, base: Side, can: Side) -> str | None:
        cfg, n = self.cfg, self.cfg.min_requests

        def rate(part: float, whole: int, enough: bool = True) -> float:
            return part / whole if whole >= n and enough else 0.0

        for cls in sorted(can.by_class):
            if can.by_class[cls] < n:
                continue
            c, b = rate(can.missed[cls], can.by_class[cls]), rate(base.missed[cls],
                                                                  base.by_class[cls])
            if c - b > cfg.max_miss_rate_increase + 1e-12:
                return (f"deadline-miss rate of class {cls} {c:.2f} on the canary against "
                        f"{b:.2f} (more than +{cfg.max_miss_rate_increase:g})")
        if can.ended >= n:
            c, b = rate(can.rejected, can.ended), rate(base.rejected, base.ended)
            if c - b > cfg.max_reject_rate_increase + 1e-12:
                return (f"rejection rate {c:.2f} on the canary against {b:.2f} (more than "
                        f"+{cfg.max_reject_rate_increase:g})")
        for cls in sorted(can.wait):
            c, b = can.wait[cls], base.wait.get(cls, 0.0)
            if c - b > cfg.max_wait_increase_s + 1e-12:
                return (f"longest wait of class {cls} {c:.2f} s on the canary against "
                        f"{b:.2f} s (more than +{cfg.max_wait_increase_s:g} s)")
        if can.decisions >= n:
            c, b = rate(can.flips, can.decisions), rate(base.flips, base.decisions)
            if c - b > cfg.max_flip_rate_increase + 1e-12:
                return (f"decisions flipping {c:.2f} of the canary's against {b:.2f} (more "
                        f"than +{cfg.max_flip_rate_increase:g})")
        if can.ended >= n and can.computed > 0 and base.ended >= n and base.good > 0:
            b = base.computed / base.good
            if can.good == 0:
                return (f"cost: the canary computed {can.computed} tokens and no good one "
                        f"(the baseline {b:.2f} per good token)")
            c = can.computed / can.good
            if c > b * cfg.max_cost_ratio + 1e-12:
                return (f"cost {c:.2f} tokens computed per good token on the canary against "
                        f"{b:.2f} (more than {cfg.max_cost_ratio:g}x)")
        return None


def resumed(rollout: RolloutConfig, started_at: float, samples: Iterable[Ended | Decided],
            ended_before: int, now: float, mono: float) -> Watchdog:
    """A trial's watch rebuilt after a restart of the streamer (the rule in the module's
    docstring). ``started_at``: the trial's start, wall seconds (its version's
    ``applied_at``); ``samples``: what the journal kept, ``at`` in wall seconds;
    ``ended_before``: the canary requests that ended in the trial before the journal's
    first sample; ``now``, ``mono``: the wall and monotonic clocks now (the watch runs on
    the monotonic one: every time moves by their difference). A sample from before the
    trial is dropped; one stamped after ``now`` (the wall clock stepped back) counts as
    now."""
    shift = now - mono
    w = Watchdog(rollout, started_at - shift, resumed=True)
    w.canary_ended = ended_before
    for s in sorted(samples, key=lambda s: s.at):
        if s.at < started_at:
            continue
        moved = msgspec.structs.replace(s, at=min(s.at, now) - shift)
        if isinstance(moved, Ended):
            w.ended(moved)
        else:
            w.decided(moved)
    return w
