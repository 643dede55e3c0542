"""What a replay run amounts to: SLO goodput, latency percentiles, throughput and fairness, as a
``Summary`` per run and one comparison table across runs.

Goodput is the share of *arrived* requests that completed inside their SLO. A rejected, failed
or cancelled request counts against it like a late one: an engine cannot raise its goodput by
turning work away. A run marked invalid keeps its latencies but prints no goodput or throughput,
since those numbers describe a load the run did not actually offer. The worst 4-second window
(by send time) of the share of accepted requests within their SLO shows misses that cluster in
time, which a whole-run share averages away."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import msgspec

from weir.replay.fairness import max_backlogged_gap, service_curves, service_events, time_grid
from weir.replay.records import read_records, write_records
from weir.replay.types import (
    CANCELLED,
    COMPLETED,
    FAILED,
    REJECTED,
    RequestRecord,
    RunResult,
    Scaling,
    Slo,
)

__all__ = ["Pcts", "Summary", "Window", "met_slo", "pcts", "percentile", "read_records",
           "render_table", "summarize", "worst_window", "write_records", "write_summary_json"]

_EPS_MS = 1e-6      # a nanosecond: float rounding must not turn an on-time request into a miss
WINDOW_S = 4.0      # the worst window's length: issue 44 asks >= 90% of accepted in every 4 s
LATE_DROP = "deadline_expired"   # an accepted request ended for its deadline counts as accepted


def met_slo(rec: RequestRecord, slo: Slo) -> bool:
    """Completed, first token within its own ``deadline_ms`` (else the SLO's TTFT), and time per
    output token within the SLO's TPOT (a request with fewer than two tokens has none and meets
    it). Equal to the bound meets it."""
    if rec.terminal != COMPLETED or rec.ttft_s is None:
        return False
    ttft_bound = rec.deadline_ms if rec.deadline_ms is not None else slo.ttft_ms
    if rec.ttft_s * 1000 > ttft_bound + _EPS_MS:
        return False
    tpot = rec.tpot_s
    return tpot is None or tpot * 1000 <= slo.tpot_ms + _EPS_MS


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) of a non-empty sequence, interpolating linearly between
    closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Window(msgspec.Struct, frozen=True):
    """One window of send times, [start_s, start_s + length): the accepted requests sent in it
    and how many of them met their SLO."""

    start_s: float
    accepted: int
    met: int

    @property
    def share(self) -> float:
        return self.met / self.accepted


def worst_window(records: Sequence[RequestRecord], slos: dict[str, Slo], default: Slo,
                 seconds: float = WINDOW_S) -> Window | None:
    """The window of send times with the lowest share of accepted requests that met their SLO
    (the earliest of equals); None when nothing was accepted. Windows are fixed, ``seconds``
    long from the run's start (sent_s 0), as the overload test windows them. Accepted is every
    request not rejected, plus one rejected ``deadline_expired``: admitted, then dropped for
    its deadline (a late drop), which is a miss, not a refusal."""
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    counts: dict[int, list[int]] = {}
    for r in records:
        if r.terminal == REJECTED and r.reason != LATE_DROP:
            continue
        cell = counts.setdefault(math.floor(r.sent_s / seconds), [0, 0])
        cell[0] += 1
        cell[1] += met_slo(r, slos.get(r.service_class, default))
    if not counts:
        return None
    k, (accepted, met) = min(counts.items(), key=lambda kv: (kv[1][1] / kv[1][0], kv[0]))
    return Window(k * seconds, accepted, met)


class Pcts(msgspec.Struct, frozen=True):
    """p50 / p90 / p99 of one latency, in milliseconds."""

    p50: float
    p90: float
    p99: float


def pcts(values_s: Sequence[float]) -> Pcts | None:
    """Percentiles in ms of durations given in seconds; None when there are none."""
    if not values_s:
        return None
    ms = [v * 1000 for v in values_s]
    return Pcts(percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


class Summary(msgspec.Struct, kw_only=True):
    """One run, reduced. Rates are None where the run has no duration (or, for offered, no
    spread of arrivals); latency percentiles are None where nothing was measured."""

    label: str
    mode: str
    scaling: Scaling
    duration_s: float
    arrived: int
    completed: int
    rejected: int
    failed: int
    cancelled: int
    slo_met: int                        # requests that met their SLO
    offered_rps: float | None           # arrived / (last arrival − first arrival)
    achieved_rps: float | None          # completed / duration
    output_tok_s: float | None          # output tokens of completed requests / duration
    ttft_ms: Pcts | None                # over completed requests
    tpot_ms: Pcts | None
    itl_ms: Pcts | None                 # over every gap of every completed request
    e2e_ms: Pcts | None
    queue_ms: Pcts | None               # over every request with a queue time
    goodput: float | None               # slo_met / arrived
    token_goodput_tok_s: float | None   # output tokens of SLO-meeting requests / duration
    token_goodput_frac: float | None    # … / output tokens of every request
    prefix_hit_rate: float | None       # cached / prompt tokens, accepted requests
    preemptions: int | None             # None where the target does not report them (HTTP)
    wasted_tokens: int | None           # from the run's meta, where it reports them
    own_deadlines: int                  # requests judged by their own deadline_ms
    slos: dict[str, Slo]                # each service class in the run → the SLO it was held to
    weights: dict[str, float]           # tenant weights used for service (default 1)
    service_curves: dict[str, list[tuple[float, float]]]  # tenant → (t_s, weighted service)
    max_backlogged_gap: float           # VTC: largest counter spread among backlogged tenants
                                        # (with a request waiting: sent → first scheduled)
    valid: bool
    invalid_reasons: list[str]
    lag_p50_ms: float | None
    lag_p99_ms: float | None
    worst_window: Window | None = None  # the lowest share of accepted within SLO, by send time


def summarize(run: RunResult, slos: dict[str, Slo], default: Slo,
              weights: dict[str, float] | None = None,
              bucket_s: float | None = None) -> Summary:
    """Reduce ``run``. ``slos`` maps service class → SLO (``default`` for the rest);
    ``weights`` maps tenant → weight for the service curves and the gap (a simulated run carries
    its config's in ``meta["weights"]``); ``bucket_s`` is the curves' sampling step (default:
    duration / 200, at least 1 ms). The gap is ``fairness.max_backlogged_gap``: a tenant is
    backlogged while it has a request waiting, from its send until it is first scheduled."""
    records = run.records
    weights = dict(weights or {})
    if bucket_s is not None and not bucket_s > 0:
        raise ValueError(f"bucket_s must be > 0, got {bucket_s}")
    used = {c: slos.get(c, default) for c in sorted({r.service_class for r in records})}
    good = [r for r in records if met_slo(r, used[r.service_class])]
    done = [r for r in records if r.terminal == COMPLETED]
    counts = Counter(r.terminal for r in records)
    duration = run.duration_s

    def per_s(amount: float) -> float | None:
        return amount / duration if duration > 0 else None

    arrivals = [r.arrival_s for r in records]
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    all_tokens = sum(r.output_tokens for r in records)
    good_tokens = sum(r.output_tokens for r in good)
    accepted = [r for r in records if r.terminal != REJECTED and r.prompt_tokens > 0]
    prompt = sum(r.prompt_tokens for r in accepted)
    wasted = run.meta.get("wasted_tokens")

    events = service_events(records, weights)
    start = min(arrivals, default=0.0)
    end = max(start + duration, events[-1][0] if events else start)    # events are sorted
    step = bucket_s if bucket_s is not None else max(duration / 200, 0.001)
    tenants = sorted({r.tenant for r in records})

    return Summary(
        label=run.label, mode=run.mode, scaling=run.scaling, duration_s=duration,
        arrived=len(records), completed=counts[COMPLETED], rejected=counts[REJECTED],
        failed=counts[FAILED], cancelled=counts[CANCELLED], slo_met=len(good),
        offered_rps=len(records) / span if span > 0 else None,
        achieved_rps=per_s(len(done)),
        output_tok_s=per_s(sum(r.output_tokens for r in done)),
        ttft_ms=pcts([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=pcts([r.tpot_s for r in done if r.tpot_s is not None]),
        itl_ms=pcts([gap for r in done for gap in r.itl_s]),
        e2e_ms=pcts([r.e2e_s for r in done if r.e2e_s is not None]),
        queue_ms=pcts([r.queue_s for r in records if r.queue_s is not None]),
        goodput=len(good) / len(records) if records else None,
        token_goodput_tok_s=per_s(good_tokens),
        token_goodput_frac=good_tokens / all_tokens if all_tokens else None,
        prefix_hit_rate=(sum(r.cached_tokens for r in accepted) / prompt
                         if prompt and run.meta.get("cached_tokens_reported", True) else None),
        preemptions=(sum(r.preemptions for r in records)
                     if run.meta.get("preemptions_reported", True) else None),
        wasted_tokens=int(wasted) if wasted is not None else None,
        own_deadlines=sum(r.deadline_ms is not None for r in records),
        slos=used, weights=weights,
        service_curves=service_curves(events, tenants, time_grid(start, end, step)),
        max_backlogged_gap=max_backlogged_gap(events),
        valid=run.valid, invalid_reasons=list(run.invalid_reasons),
        lag_p50_ms=run.lag_p50_ms, lag_p99_ms=run.lag_p99_ms,
        worst_window=worst_window(records, used, default))


def write_summary_json(summaries: Summary | Sequence[Summary], path: Path) -> None:
    """One summary as a JSON object, several as a JSON list, indented."""
    data = summaries if isinstance(summaries, Summary) else list(summaries)
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(data), indent=2) + b"\n")


# --- the comparison table ---------------------------------------------------------------------

_INVALID = "invalid"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _validity(s: Summary) -> str:
    if s.valid:
        return "valid"
    return "INVALID: " + ("; ".join(s.invalid_reasons) or "no reason given")


def _window(w: Window | None) -> str:
    if w is None:
        return "-"
    return f"{_pct(w.share)} ({w.met}/{w.accepted}) at {w.start_s:g}-{w.start_s + WINDOW_S:g} s"


def _rows(s: Summary) -> list[tuple[str, str]]:
    """(metric, cell) for one run, in table order. A cell flagged True is a goodput or
    throughput number: an invalid run shows "invalid" there instead."""
    rows = [
        ("mode", s.mode, False),
        ("scaling: length ×", f"{s.scaling.length:g}", False),
        ("scaling: time ×", f"{s.scaling.time:g}", False),
        ("scaling: block (tokens)", str(s.scaling.block_size), False),
        ("scaling: seed", str(s.scaling.seed), False),
        ("duration (s)", _num(s.duration_s, ".2f"), False),
        ("arrived", str(s.arrived), False),
        ("completed", str(s.completed), False),
        ("rejected", str(s.rejected), False),
        ("failed", str(s.failed), False),
        ("cancelled", str(s.cancelled), False),
        ("offered (req/s)", _num(s.offered_rps, ".2f"), False),
        ("achieved (req/s)", _num(s.achieved_rps, ".2f"), True),
        ("output (tok/s)", _num(s.output_tok_s), True),
    ]
    for name, p in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms),
                    ("E2E", s.e2e_ms)):
        for q in ("p50", "p90", "p99"):
            rows.append((f"{name} {q} (ms)", _num(getattr(p, q) if p else None), False))
    rows += [
        ("queue p50 (ms)", _num(s.queue_ms.p50 if s.queue_ms else None), False),
        ("queue p99 (ms)", _num(s.queue_ms.p99 if s.queue_ms else None), False),
        ("goodput (% of arrived)",
         f"{_pct(s.goodput)} ({s.slo_met}/{s.arrived})" if s.arrived else "-", True),
        (f"worst {WINDOW_S:g} s window (% of accepted in SLO)", _window(s.worst_window), True),
        ("token goodput (tok/s)", _num(s.token_goodput_tok_s), True),
        ("token goodput (% of output)", _pct(s.token_goodput_frac), True),
        ("own TTFT deadlines", str(s.own_deadlines), False),
        ("prefix hit rate", _pct(s.prefix_hit_rate), False),
        ("preemptions", "-" if s.preemptions is None else str(s.preemptions), False),
        ("wasted tokens", "-" if s.wasted_tokens is None else str(s.wasted_tokens), False),
        ("max backlogged service gap", _num(s.max_backlogged_gap), False),
        ("schedule lag p50 (ms)", _num(s.lag_p50_ms), False),
        ("schedule lag p99 (ms)", _num(s.lag_p99_ms), False),
        ("validity", _validity(s), False),
    ]
    return [(name, _INVALID if trusted and not s.valid else cell) for name, cell, trusted in rows]


def _slo_lines(summaries: Sequence[Summary]) -> list[str]:
    lines = []
    for cls in sorted({c for s in summaries for c in s.slos}):
        held = {s.label: s.slos[cls] for s in summaries if cls in s.slos}
        if len(set(held.values())) == 1:
            slo = next(iter(held.values()))
            lines.append(f"SLO {cls}: TTFT ≤ {slo.ttft_ms:g} ms, TPOT ≤ {slo.tpot_ms:g} ms")
        else:
            lines += [f"SLO {cls} ({label}): TTFT ≤ {slo.ttft_ms:g} ms, "
                      f"TPOT ≤ {slo.tpot_ms:g} ms" for label, slo in held.items()]
    lines.append("A request's own deadline_ms replaces its class's TTFT bound. Goodput counts "
                 "rejected, failed and cancelled requests as misses.")
    return lines


def render_table(summaries: Sequence[Summary]) -> str:
    """One aligned plain-text table: a row per metric, a column per run, then the SLOs."""
    columns = [_rows(s) for s in summaries]
    names = [name for name, _ in columns[0]] if columns else []
    grid = [["metric", *(s.label for s in summaries)]]
    grid += [[name, *(col[i][1] for col in columns)] for i, name in enumerate(names)]
    widths = [max(len(row[j]) for row in grid) for j in range(len(grid[0]))]
    lines = []
    for k, row in enumerate(grid):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines + [""] + _slo_lines(summaries)) + "\n"
