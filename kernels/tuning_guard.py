"""Whether a measured kernel plan can be trusted: the load on the cores while it was timed,
and whether its linear timings grow with the rows as a GEMM's must.

A plan is measured once per machine and then cached, so one timed while other processes
held the cores would be served for good: on the 2-core AMX Xeon such a plan sent qkv to
torch's unpacked GEMM above 512 rows and the served tok/s fell from 1.23-1.32x vLLM's to
1.05x until its file was deleted by hand. Two checks guard it:

- **Load** (:class:`LoadMeter`): other processes' CPU time over the measuring window, as a
  fraction of the cores this process may run on: the busy time of those cores in
  ``/proc/stat`` less this process's own (``os.times``: every thread of the process, the
  OpenMP workers included). Above :data:`LOAD_LIMIT` the plan is *provisional*.
- **Growth** (:func:`violations`): from 256 rows on, each linear candidate's time must grow
  by :data:`MIN_GROWTH` per doubling of the rows. A pair that does not is timed again
  (:func:`recheck`, at most :data:`RETRIES` times) and each bucket keeps its least time
  (other processes only add time). A pair still flat after a re-timing on quiet cores is
  the kernel's own behaviour (oneDNN's bf16 GEMM on the AMX Xeon takes as long at 1024 rows
  as at 2048 for the down and qkv weights, in every plan measured there): kept as measured.
  One still flat after re-timings on busy cores only is *unsettled* and makes the plan
  provisional.

A provisional plan is used, logged with a warning, and measured again at the next start if
the cores are quieter then than while it was measured (:func:`due`); the new plan replaces
it if it is better (:func:`better`: clean, or measured under less load). After
:data:`MAX_ATTEMPTS` measurements a plan is kept as it is. A clean plan is never measured
again, and a clean machine measures nothing more than before: the load is two reads of
``/proc/stat``, and only pairs that break the growth rule are timed again.

Pure (no torch): the readers are injected for tests.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

# Load: another process holding one of the 2 cores for the whole window is 0.5, and the
# timings it leaves are wrong (torch's 2-thread GEMM waits for its slower thread every
# call). Under the CPU lock with nothing else measuring, a bf16 plan's window read
# 0.004-0.011 on the 2-core Xeon, and 0.36 with one busy loop beside it (docs/perf-log.md).
# An engine's own start is not that quiet: its other processes (tokenizer, admission, the
# streamer...) start beside the executor's measurement, and the plans the end-to-end
# tests' engines measured read 0.03-0.10 with nothing else running (0.15-0.25 where
# another test's work ran beside). At 0.10 a serving engine's own start made plans
# provisional, each measured again at its next start. 0.20 of the cores (two fifths of
# one of the 2, on average over the window) is well above an engine's own start and
# below one neighbour busy for half the window.
LOAD_LIMIT = 0.20
# Growth: from 256 rows on, a GEMM's time is its arithmetic and its weight traffic; in the
# 103 plans cached on the 2-core AMX Xeon (bf16 and fp32, 1,108 doubling pairs outside the
# kernels' own plateaus) the least growth per doubling was 1.35 and the typical 1.4-2.0;
# a burst of load in the smaller bucket showed as 0.5-0.95.
GROWTH_FROM = 256
MIN_GROWTH = 1.3
RETRIES = 2
MAX_ATTEMPTS = 3
PROBE_S = 0.5                    # how long a start samples the load before re-measuring


# ---------------------------------------------------------------------- load
@dataclass(frozen=True)
class LoadSample:
    """One reading: wall seconds, the busy CPU seconds of the cores watched (every process,
    this one included) and this process's own CPU seconds (all its threads)."""

    wall_s: float
    busy_s: float
    own_s: float


def busy_ticks(stat_text: str, cpus: Collection[int] | None) -> int:
    """Busy clock ticks of ``cpus`` (None: every core) from ``/proc/stat``: user, nice,
    system, irq, softirq and steal (a hypervisor's other guests take the core as surely as
    a process does); not idle or iowait, and not guest time, which user already counts."""
    total = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or (
                cpus is not None and int(name[3:]) not in cpus):
            continue
        f = [int(v) for v in rest.split()]
        total += f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)
    return total


def _cpus() -> set[int] | None:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def read_sample(cpus: Collection[int] | None = None) -> LoadSample:
    """The real reader: ``/proc/stat`` for the cores this process may run on, ``os.times``
    for its own CPU time (user + system, every thread; children not included). Without
    ``/proc/stat`` (not Linux) the load reads 0: the growth check still runs."""
    t = os.times()
    own = t.user + t.system
    try:
        with open("/proc/stat") as f:
            busy = busy_ticks(f.read(), cpus if cpus is not None else _cpus())
    except OSError:
        return LoadSample(time.monotonic(), own, own)
    return LoadSample(time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), own)


def load_between(a: LoadSample, b: LoadSample, cores: int) -> float:
    """Other processes' share of ``cores`` from ``a`` to ``b`` (0: none; 1: every core)."""
    wall = b.wall_s - a.wall_s
    if wall <= 0 or cores <= 0:
        return 0.0
    others = (b.busy_s - a.busy_s) - (b.own_s - a.own_s)
    return min(1.0, max(0.0, others / (wall * cores)))


class LoadMeter:
    """Measures the load over a window: ``with meter: ...``, then ``meter.load``."""

    def __init__(self, read: Callable[[], LoadSample] | None = None, cores: int | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.cores = cores if cores is not None else len(_cpus() or range(os.cpu_count() or 1))
        self.read = read or read_sample
        self.sleep = sleep
        self.load = 0.0
        self.window_s = 0.0

    def __enter__(self) -> LoadMeter:
        self._start = self.read()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self.read()
        self.load = load_between(self._start, end, self.cores)
        self.window_s = end.wall_s - self._start.wall_s

    def probe(self, seconds: float = PROBE_S) -> float:
        """The load over the next ``seconds`` (this process idle meanwhile)."""
        with self:
            self.sleep(seconds)
        return self.load


# ---------------------------------------------------------------------- growth
def min_growth(a: int, b: int) -> float:
    """The least time ratio from ``a`` rows to ``b``: MIN_GROWTH per doubling, linear in
    b / a (a last bucket that is not a power of two, e.g. 1024 -> 1500: 1.14)."""
    return 1 + (MIN_GROWTH - 1) * (b / a - 1)


def violations(times: Mapping[int, float]) -> list[tuple[int, int]]:
    """The neighbouring buckets ``(a, b)``, a >= GROWTH_FROM, where one candidate's time
    grows by less than :func:`min_growth`."""
    ms = sorted(times)
    return [(a, b) for a, b in zip(ms, ms[1:])
            if a >= GROWTH_FROM and times[b] < min_growth(a, b) * times[a]]


def recheck(timings: dict[str, dict[int, float]],
            retime: Callable[[Collection[str], int], Mapping[str, float]],
            quiet: Callable[[], bool], retries: int = RETRIES) -> dict[str, dict[str, object]]:
    """Times again, with ``retime(candidates, m)`` (seconds per candidate at ``m`` rows), the
    pairs of buckets that break the growth rule, up to ``retries`` times; each bucket keeps
    its least time (``timings`` is updated in place). Returns what was found, by
    ``"candidate@a"``: the ratio left and a status: ``settled`` (the re-timing restored the
    growth: the first timing was disturbed), ``reproduced`` (still flat, timed again while
    ``quiet()``: other processes only add time, so a plateau that quiet cores repeat is the
    kernel's own) or ``unsettled`` (still flat, and the cores were busy each time)."""
    found: dict[str, dict[str, object]] = {}
    for _ in range(retries):
        bad = [(c, a, b) for c, t in sorted(timings.items()) for a, b in violations(t)
               if found.get(f"{c}@{a}", {}).get("status") != "reproduced"]
        if not bad:
            break
        want: dict[int, set[str]] = {}
        for c, a, b in bad:
            want.setdefault(a, set()).add(c)
            want.setdefault(b, set()).add(c)
        new = {(c, m): s for m in sorted(want) for c, s in retime(sorted(want[m]), m).items()}
        calm = quiet()
        for c, a, b in bad:
            timings[c][a] = min(timings[c][a], new[(c, a)])
            timings[c][b] = min(timings[c][b], new[(c, b)])
            ok = timings[c][b] >= min_growth(a, b) * timings[c][a]
            found[f"{c}@{a}"] = {"status": "settled" if ok else
                                 "reproduced" if calm else "unsettled",
                                 "ratio": round(timings[c][b] / timings[c][a], 3)}
    for c, t in timings.items():           # broken by a merge in the last round, or left
        for a, b in violations(t):
            entry = found.setdefault(f"{c}@{a}", {"status": "unsettled"})
            entry["ratio"] = round(t[b] / t[a], 3)
            if entry["status"] == "settled":
                entry["status"] = "unsettled"
    return found


# ---------------------------------------------------------------------- the verdict
def judge(load: float, anomalies: Mapping[str, Mapping[str, Mapping[str, object]]],
          cores: int) -> str:
    """Why a plan measured under ``load`` with these anomalies (per op, per
    ``candidate@rows``) is provisional, or "" when it is clean."""
    why = []
    if load > LOAD_LIMIT:
        why.append(f"other processes used {load:.0%} of the {cores} cores while it was "
                   f"measured (limit {LOAD_LIMIT:.0%})")
    unsettled = sorted(f"{op}.{k}" for op, found in anomalies.items()
                       for k, v in found.items() if v.get("status") == "unsettled")
    if unsettled:
        why.append("timings that do not grow with the rows and stayed so when timed again "
                   "on busy cores: " + ", ".join(unsettled))
    return "; ".join(why)


def due(guard: Mapping[str, Any] | None, load_now: Callable[[], float]) -> bool:
    """Whether a cached plan with this guard record is measured again at this start: never
    a clean one; a provisional one if the cores are quieter now than while it was measured
    (``load_now()`` samples them: only provisional plans pay for it), up to MAX_ATTEMPTS;
    always one an operator marked (``weir plan --remeasure``); once, one from before the
    guard (no record)."""
    if guard is None:
        return True
    if guard.get("remeasure"):
        return True
    if not guard.get("provisional") or int(guard.get("attempts", 1)) >= MAX_ATTEMPTS:
        return False
    return load_now() < max(LOAD_LIMIT, float(guard.get("load", 1.0)))


def better(new: Mapping[str, Any], old: Mapping[str, Any] | None) -> bool:
    """Whether a new measurement's guard record replaces the cached plan's: a clean one
    always; a provisional one where the old was measured under more load, or has no record,
    or was marked by an operator."""
    if old is None or not new.get("provisional") or old.get("remeasure"):
        return True
    return float(new.get("load", 1.0)) < float(old.get("load", 1.0))
