"""``weir qualify``: a candidate config against the one it would replace, both run through
the simulator on the same recorded traffic, judged against the candidate's ``[rollout]``
bars (schemas/config.py ``RolloutConfig``). Pure: ``measure`` reduces a simulated run,
``judge`` compares two; the command is in ``commands.py``.

Both runs are held to one yardstick: each request is counted in the class the *current*
config gave it, with that class's SLO, so a candidate that moves work to a laxer class (or
drops the classes) is not judged by its own, easier, terms.
"""
from __future__ import annotations

from collections.abc import Mapping

import msgspec

from schemas.config import RolloutConfig
from weir.replay.report import met_slo, summarize
from weir.replay.types import FAILED, RequestRecord, RunResult, Slo

_EPS = 1e-9          # float rounding must not turn an equal result into a failure


class Measured(msgspec.Struct, kw_only=True):
    """One config's run, reduced to what qualification judges. ``misses``, ``arrived`` and
    ``longest_wait_s`` are by class (the current config's); ``fairness_gap`` is VTC's
    largest counter spread among backlogged tenants (weighted tokens); ``busy_s`` the
    virtual seconds with a step in flight; ``duration_s`` first arrival to last end (one
    replica's replica-seconds)."""

    label: str
    arrived: int
    met: int
    goodput: float
    arrived_by_class: dict[str, int]
    misses: dict[str, int]
    longest_wait_s: dict[str, float]
    fairness_gap: float
    busy_s: float
    duration_s: float
    rejected: int
    failed: int

    def miss_rate(self, cls: str) -> float:
        n = self.arrived_by_class.get(cls, 0)
        return self.misses.get(cls, 0) / n if n else 0.0


class Check(msgspec.Struct, kw_only=True):
    """One bar: what it is (``name``, with the class where it is per class), the bound the
    candidate had to stay within, both values, and whether it did."""

    name: str
    limit: float | None
    current: float | None
    candidate: float | None
    passed: bool
    detail: str = ""


class Verdict(msgspec.Struct, kw_only=True):
    passed: bool
    checks: list[Check]
    current: Measured
    candidate: Measured


def wait_s(rec: RequestRecord) -> float:
    """How long a request waited to be served: arrival to first scheduled; for one never
    scheduled, arrival to its end (0 for one refused on arrival)."""
    if rec.queue_s is not None:
        return rec.queue_s
    if rec.ttft_s is not None:
        return rec.ttft_s
    return rec.e2e_s or 0.0


def measure(run: RunResult, classes: Mapping[int, str], slos: Mapping[str, Slo],
            default: Slo) -> Measured:
    """``run`` reduced, each request (by index) counted in ``classes[index]`` and held to
    that class's SLO (``default`` for a class ``slos`` does not name)."""
    records = [msgspec.structs.replace(r, service_class=classes.get(r.index, r.service_class))
               for r in run.records]
    arrived: dict[str, int] = {}
    misses: dict[str, int] = {}
    longest: dict[str, float] = {}
    met = 0
    for r in records:
        cls = r.service_class
        arrived[cls] = arrived.get(cls, 0) + 1
        ok = met_slo(r, slos.get(cls, default))
        met += ok
        misses[cls] = misses.get(cls, 0) + (not ok)
        longest[cls] = max(longest.get(cls, 0.0), wait_s(r))
    summary = summarize(msgspec.structs.replace(run, records=records), dict(slos), default,
                        weights=run.meta.get("weights"))
    return Measured(label=run.label, arrived=len(records), met=met,
                    goodput=met / len(records) if records else 0.0,
                    arrived_by_class=dict(sorted(arrived.items())),
                    misses=dict(sorted(misses.items())),
                    longest_wait_s=dict(sorted(longest.items())),
                    fairness_gap=summary.max_backlogged_gap,
                    busy_s=float(run.meta.get("busy_s", 0.0)), duration_s=run.duration_s,
                    rejected=summary.rejected,
                    failed=sum(r.terminal == FAILED for r in records))


def judge(current: Measured, candidate: Measured, bars: RolloutConfig,
          refused: list[str] | None = None) -> Verdict:
    """Every bar of ``bars`` the candidate is held to, in order; it passes when all do.
    ``refused``: why the candidate could not be applied live (a failed check when any)."""
    checks: list[Check] = []

    def bar(name: str, limit: float | None, cur: float | None, cand: float | None,
            ok: bool, detail: str = "") -> None:
        checks.append(Check(name=name, limit=limit, current=cur, candidate=cand, passed=ok,
                            detail=detail))

    if refused is not None:
        bar("applies live", None, None, None, not refused, "; ".join(refused))
    bar("no request stalled", float(current.failed), float(current.failed),
        float(candidate.failed), candidate.failed <= current.failed)
    if bars.max_goodput_drop is not None:
        limit = current.goodput - bars.max_goodput_drop
        bar("goodput", limit, current.goodput, candidate.goodput,
            candidate.goodput >= limit - _EPS)
    classes = sorted(current.arrived_by_class.keys() | candidate.arrived_by_class.keys())
    for cls in classes:
        cur, cand = current.miss_rate(cls), candidate.miss_rate(cls)
        if bars.max_class_miss_increase is not None:
            limit = cur + bars.max_class_miss_increase
            bar(f"miss rate [{cls}]", limit, cur, cand, cand <= limit + _EPS)
        cap = bars.max_class_miss_rate.get(cls, bars.max_class_miss_rate.get("*"))
        if cap is not None:
            bar(f"miss rate cap [{cls}]", cap, cur, cand, cand <= cap + _EPS)
        if bars.max_starvation_increase_s is not None:
            cur_w = current.longest_wait_s.get(cls, 0.0)
            cand_w = candidate.longest_wait_s.get(cls, 0.0)
            limit = cur_w + bars.max_starvation_increase_s
            bar(f"longest wait s [{cls}]", limit, cur_w, cand_w, cand_w <= limit + _EPS)
    if bars.max_starvation_s is not None:
        cur_w = max(current.longest_wait_s.values(), default=0.0)
        cand_w = max(candidate.longest_wait_s.values(), default=0.0)
        bar("longest wait s cap", bars.max_starvation_s, cur_w, cand_w,
            cand_w <= bars.max_starvation_s + _EPS)
    if bars.max_fairness_gap_increase is not None:
        limit = current.fairness_gap * (1 + bars.max_fairness_gap_increase)
        bar("fairness gap", limit, current.fairness_gap, candidate.fairness_gap,
            candidate.fairness_gap <= limit + _EPS)
    if bars.max_fairness_gap is not None:
        bar("fairness gap cap", bars.max_fairness_gap, current.fairness_gap,
            candidate.fairness_gap, candidate.fairness_gap <= bars.max_fairness_gap + _EPS)
    if bars.max_cost_increase is not None:
        limit = current.busy_s * (1 + bars.max_cost_increase)
        bar("busy s (cost)", limit, current.busy_s, candidate.busy_s,
            candidate.busy_s <= limit + _EPS)
    return Verdict(passed=all(c.passed for c in checks), checks=checks, current=current,
                   candidate=candidate)


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if abs(x) < 10 else f"{x:,.1f}"


def render(v: Verdict) -> str:
    """The two configs side by side, then every check, then the verdict."""
    cur, cand = v.current, v.candidate
    rows = [("", "current", "candidate"),
            ("config", cur.label, cand.label),
            ("goodput", f"{cur.goodput:.1%} ({cur.met}/{cur.arrived})",
             f"{cand.goodput:.1%} ({cand.met}/{cand.arrived})"),
            ("rejected", str(cur.rejected), str(cand.rejected))]
    for cls in sorted(cur.arrived_by_class.keys() | cand.arrived_by_class.keys()):
        rows.append((f"misses [{cls}]",
                     f"{cur.misses.get(cls, 0)}/{cur.arrived_by_class.get(cls, 0)}",
                     f"{cand.misses.get(cls, 0)}/{cand.arrived_by_class.get(cls, 0)}"))
        rows.append((f"longest wait s [{cls}]", _num(cur.longest_wait_s.get(cls)),
                     _num(cand.longest_wait_s.get(cls))))
    rows += [("fairness gap (weighted tokens)", _num(cur.fairness_gap), _num(cand.fairness_gap)),
             ("busy s (cost)", _num(cur.busy_s), _num(cand.busy_s)),
             ("replica-s (duration)", _num(cur.duration_s), _num(cand.duration_s))]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    lines.append("")
    checks = [("check", "limit", "current", "candidate", "")]
    for c in v.checks:
        checks.append((c.name, _num(c.limit), _num(c.current), _num(c.candidate),
                       ("pass" if c.passed else "FAIL") + (f": {c.detail}" if c.detail else "")))
    widths = [max(len(r[i]) for r in checks) for i in range(4)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
              for r in checks]
    lines.append("")
    failed = [c.name for c in v.checks if not c.passed]
    lines.append("PASS" if v.passed else f"FAIL ({', '.join(failed)})")
    return "\n".join(lines)
