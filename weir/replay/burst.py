"""Bursts, measured and built, for the fleet simulator (``weir simulate --autoscale``).

``burstiness`` counts a trace's arrivals in fixed windows and reports the largest jump from
one window to the next (and peak over mean): the number that says whether a trace has a
burst for an autoscaler to answer. ``splice`` builds a bursty timeline from real rows of a
Mooncake trace: each segment ``(seconds, copies)`` takes ``copies`` consecutive stretches of
``seconds`` from the source and lays them over each other, so a segment of 3 copies has
three times the source's rate for its length. Every row keeps its lengths and ``hash_ids``
(the prefix structure within a stretch is the source's); only ``timestamp`` is moved. The
result is constructed, not observed: say so beside anything measured on it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Jump:
    window_s: float
    before: int             # arrivals in the quieter window
    after: int              # arrivals in the window just after it
    at_s: float             # where the later window starts
    peak_over_mean: float

    @property
    def ratio(self) -> float:
        return self.after / self.before if self.before else math.inf


def burstiness(arrivals_s: Sequence[float], window_s: float, min_before: int = 5) -> Jump:
    """The largest rise from one ``window_s`` window to the next (windows from the first
    arrival; a window with fewer than ``min_before`` arrivals does not count as the quiet one,
    so an empty gap is not an infinite burst)."""
    if not arrivals_s or window_s <= 0:
        raise ValueError("burstiness: need arrivals and a window > 0")
    t0 = min(arrivals_s)
    counts = [0] * (int((max(arrivals_s) - t0) // window_s) + 1)
    for t in arrivals_s:
        counts[int((t - t0) // window_s)] += 1
    best = (0.0, 0, 0, 0.0)
    for i in range(len(counts) - 1):
        a, b = counts[i], counts[i + 1]
        if a >= min_before and b / a > best[0]:
            best = (b / a, a, b, (i + 1) * window_s)
    mean = len(arrivals_s) / len(counts)
    return Jump(window_s, best[1], best[2], best[3], max(counts) / mean)


def splice(rows: Sequence[dict], segments: Sequence[tuple[float, int]],
           start_s: float = 0.0) -> list[dict]:
    """Mooncake rows (``timestamp`` in ms, sorted) laid out by ``segments`` from ``start_s``
    into the source; returns new rows sorted by their new timestamp, from 0."""
    if not segments or any(sec <= 0 or copies < 1 for sec, copies in segments):
        raise ValueError("splice: each segment needs seconds > 0 and copies >= 1")
    out: list[tuple[int, int, dict]] = []
    cursor_ms, at_ms = start_s * 1e3, 0.0
    for sec, copies in segments:
        span = sec * 1e3
        for c in range(copies):
            lo = cursor_ms + c * span
            if lo >= rows[-1]["timestamp"]:
                need = cursor_ms + copies * span
                raise ValueError(f"splice: the segments need {need / 1e3:.0f} s of the source "
                                 f"from {start_s:g} s; it has "
                                 f"{rows[-1]['timestamp'] / 1e3:.0f} s")
            for row in rows:
                t = row["timestamp"]
                if lo <= t < lo + span:
                    out.append((round(at_ms + t - lo), len(out), row))
        cursor_ms += copies * span
        at_ms += span
    out.sort(key=lambda x: (x[0], x[1]))
    return [{**row, "timestamp": t} for t, _, row in out]
