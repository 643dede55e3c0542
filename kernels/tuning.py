"""Kernel choice by measurement: what runs each hot operation on this machine.

A kernel that wins on one x86 server loses on another: the native small-batch bf16 linear
(``csrc/cpu_gemv.cpp``) streams weights faster than oneDNN on AMD Zen 4 up to 64 tokens,
but on an Intel Xeon with AMX oneDNN's blocked GEMM beats it from 8 tokens on, by 4x at
64. So nothing is hard-coded: at startup the executor times every candidate that exists
here, at the model's own shapes, and keeps the fastest.

- **Linear layers**, per weight shape (qkv, o, gate_up, down, lm_head) and per bucket of
  step tokens M (1, 2, 4, ... 2048): ``native`` (the small-batch kernels, M <= 256: bf16
  on AVX512-BF16 or AVX2 + FMA, fp32 on AVX2 + FMA), ``amx`` (bf16 on AMX tiles, any M,
  through the native layout: no copy of its own), ``onednn`` (weights reordered once
  into oneDNN's blocked layout; AMX where the CPU has it), ``torch`` (plain
  ``F.linear``) and, for a bf16 model, ``fp32`` (the weight kept in fp32, the step's
  activations cast up and the result back: on a CPU without AVX-512, torch's bf16 GEMM
  runs ~5x slower than fp32 and oneDNN refuses bf16; it costs twice the weight memory, so
  it is kept only where it wins) and ``fp32_onednn`` (the same through oneDNN's packed
  fp32 weight). Each layout is a copy of the weights, so a layout is kept only where it
  beats the layouts already kept by ``KEEP_MARGIN``: no second copy of the weights for a
  marginal gain, and none for a kernel that was not chosen (:func:`choose_linear`).
  gate_up, timed with the SiLU x up that follows it, also has ``onednn_silu`` and
  ``fp32_onednn_silu``: oneDNN's GEMMs with SiLU x up in their epilogue (a layout of their
  own: the gate and up halves packed apart).
- **Fused elementwise ops** (add+RMSNorm, RoPE, SiLU x up) and **sampling** (argmax and the
  temperature / top-k / top-p draw):
  ``native`` or ``torch``.
- **Attention**: the ``cpu`` backend (native paged kernel) or the ``torch`` reference.

The choice is cached per machine under ``<cache>/tuning/<key>.json``; the key hashes the
CPU model, its flags, the cores and threads, the torch version, the dtype and the shapes
(:func:`machine_key`), so a restart does not measure again and another machine does. A
plan measured under load, or with timings that do not grow with the rows, is provisional
and measured again at a quieter start (:mod:`kernels.tuning_guard`); one from before that
guard has no record of it and is measured again once.
``engine.kernels`` in the config forces a candidate (reproducible runs); the executor logs
the plan at startup and reports it in ``weir status --json``.

Torch-only (no msgspec, no weir imports): ``scripts/gpu_check`` imports the model.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import tuning_guard
from kernels.machine import cpu_info

VERSION = 15                     # bump when candidates, the timing method or the choice change
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
KEEP_MARGIN = 0.10               # a further weight layout must save at least 10% where used
LINEAR = ("native", "amx", "onednn", "torch", "fp32", "fp32_onednn", "onednn_silu",
          "fp32_onednn_silu")
# candidates that run another's weight layout: both chosen, the weight exists once
SHARED_LAYOUT = {"amx": "native"}


def layout_of(candidate: str) -> str:
    return SHARED_LAYOUT.get(candidate, candidate)
BINARY = ("native", "torch")


def machine_info() -> dict[str, object]:
    """What a timing depends on besides the shapes: the CPU model, its flags, the cores
    this process may use, torch's threads and version."""
    model, have = cpu_info()
    flags = " ".join(sorted(have))
    # the CPUs it may run on; the threads the plan was timed with are their own entry
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "flags": flags, "cores": cores, "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def machine_key(machine: Mapping[str, object], dtype: str,
                shapes: Mapping[str, tuple[int, int]], max_m: int, max_seqs: int = 0,
                block_size: int = 0) -> str:
    """The cache key: changes with anything in ``machine``, the dtype, the shapes, the
    largest step measured, the most sequences a step holds (the lm_head's buckets), the KV
    block size (the attention timings) and the tuning version."""
    blob = json.dumps({"v": VERSION, "machine": dict(machine), "dtype": dtype,
                       "shapes": {k: list(v) for k, v in sorted(shapes.items())},
                       "max_m": max_m, "max_seqs": max_seqs, "block_size": block_size},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


# ---------------------------------------------------------------------- the choice (pure)
def choose_linear(timings: Mapping[str, Mapping[int, float]],
                  margin: float = KEEP_MARGIN) -> list[tuple[int, str]]:
    """The dispatch table for one weight from measured seconds per candidate and bucket (a
    candidate missing at a bucket cannot run it): ``[(up_to_m, candidate), ...]`` in
    ascending ``up_to_m``; the last entry also takes every larger M.

    Each bucket starts with its fastest candidate. Then the candidates that win the fewest
    buckets are dropped, one at a time, if the others still run those buckets at most
    ``margin`` slower than the dropped one on average over them: every layout kept pays for
    its memory. The average is of each bucket's slowdown (time / the dropped one's time),
    so a one-token step weighs as much as a 256-token one; a sum of times would let the
    largest buckets, where candidates tie, hide a 1.4x loss at decode sizes."""
    buckets = sorted({b for t in timings.values() for b in t})
    if not buckets:
        raise ValueError("no timings to choose from")
    best = _segments(timings, buckets)
    kept = set(best.values())
    for cand in sorted(kept, key=lambda c: (sum(v == c for v in best.values()), c)):
        others = kept - {cand}
        if not others:
            break
        if any(layout_of(o) == layout_of(cand) for o in others):
            continue                   # its layout stays for another: dropping saves nothing
        won = [b for b in buckets if best[b] == cand]
        swap = {}
        for b in won:
            options = [(timings[o][b], o) for o in others if b in timings[o]]
            if not options:
                break
            swap[b] = min(options)
        else:
            if sum(t / timings[cand][b] for b, (t, _) in swap.items()) <= \
                    (1 + margin) * len(won):
                best.update({b: o for b, (_, o) in swap.items()})
                kept = others
    table: list[tuple[int, str]] = []
    for b in buckets:
        if table and table[-1][1] == best[b]:
            table[-1] = (b, best[b])
        else:
            table.append((b, best[b]))
    return table


def _segments(timings: Mapping[str, Mapping[int, float]],
              buckets: Sequence[int]) -> dict[int, str]:
    """The fastest assignment of candidates to buckets in which each candidate runs one
    contiguous range of step sizes. A kernel's time grows with M and candidates cross over
    at most a few times, so a table that flips back and forth (onednn, torch, onednn) is
    timing noise, not a real win; cost = the sum over buckets of time / the bucket's best,
    so small and large steps weigh alike."""
    fastest = {b: min(t[b] for t in timings.values() if b in t) for b in buckets}
    cost = {c: [t[b] / fastest[b] if b in t else float("inf") for b in buckets]
            for c, t in timings.items()}
    n = len(buckets)
    # best[i][used] = (cost, assignment) for buckets[:i], the last segment's candidate
    # being assignment[-1]; candidates already used may not come back
    states: dict[tuple[str, ...], tuple[float, list[str]]] = {(): (0.0, [])}
    for i in range(n):
        nxt: dict[tuple[str, ...], tuple[float, list[str]]] = {}
        for used, (total, assign) in states.items():
            options = ([used[-1]] if used else []) + [c for c in cost if c not in used]
            for c in options:
                step = cost[c][i]
                if step == float("inf"):
                    continue
                key = used if used and c == used[-1] else used + (c,)
                cand = (total + step, assign + [c])
                if key not in nxt or cand[0] < nxt[key][0]:
                    nxt[key] = cand
        states = nxt
    _, assign = min(states.values(), key=lambda v: (v[0], len(set(v[1]))))
    return dict(zip(buckets, assign))


def choose_fastest(timings: Mapping[str, float]) -> str:
    """The candidate with the least time (ties: the first in name order)."""
    return min(sorted(timings), key=lambda c: timings[c])


def pick(table: Sequence[tuple[int, str]], m: int) -> str:
    """The candidate for a step of ``m`` tokens."""
    for up_to, cand in table:
        if m <= up_to:
            return cand
    return table[-1][1]


# ---------------------------------------------------------------------- the plan
@dataclass
class KernelPlan:
    """What runs each operation, and how it was decided ("measured", "cached", "forced")."""

    linear: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    elementwise: str = "torch"
    sampling: str = "torch"
    attention: str = "torch"
    source: str = "measured"
    fresh_prompts: str = "native"              # a prompt's first chunk: native or sdpa
    attention_tiles: str = "vector"            # the cpu backend's paged kernel: vector or amx
    layer_loop: str = "native"                 # the decoder layers: one native call, or python
    key: str = ""
    seconds: float = 0.0                       # spent measuring (0 when cached)
    timings: dict[str, object] = field(default_factory=dict)
    # a deterministic step's kernels (components/executor/determinism.py; derived from what
    # can run here, never cached): each linear role's one kernel for every M (absent: none
    # is batch-invariant here), and the paged attention's tiles ("vector" or "amx")
    invariant_linear: dict[str, str] = field(default_factory=dict)
    invariant_tiles: str = "vector"
    # what the measurement found (kernels/tuning_guard.py): per linear op, its timings that
    # did not grow with the rows ("candidate@rows" -> status, ratio); and the guard's record
    # (load, cores, window_s, provisional: why, "" when clean; attempts, measured_at)
    anomalies: dict[str, dict] = field(default_factory=dict)
    guard: dict[str, object] = field(default_factory=dict)

    def layouts(self, role: str) -> set[str]:
        return {c for _, c in self.linear.get(role, [])}

    def summary(self) -> dict[str, str]:
        """Flat strings for logs and ``weir status``: ``linear.qkv`` ->
        ``"native<=4 onednn"`` (native up to 4 tokens, oneDNN above)."""
        out = {f"linear.{role}": " ".join(f"{c}<={m}" for m, c in table[:-1])
               + (" " if len(table) > 1 else "") + table[-1][1]
               for role, table in sorted(self.linear.items())}
        out.update(elementwise=self.elementwise, sampling=self.sampling, attention=self.attention,
                   fresh_prompts=self.fresh_prompts, attention_tiles=self.attention_tiles,
                   layer_loop=self.layer_loop, source=self.source)
        if self.guard:                  # the load and the reasons: the plan file, the log
            out["guard"] = "provisional" if self.guard.get("provisional") else "clean"
        return out

    def to_json(self) -> dict[str, object]:
        return {"linear": {r: [list(e) for e in t] for r, t in self.linear.items()},
                "elementwise": self.elementwise, "sampling": self.sampling,
                "attention": self.attention, "fresh_prompts": self.fresh_prompts,
                "attention_tiles": self.attention_tiles, "layer_loop": self.layer_loop,
                "timings": self.timings, "guard": {**self.guard, "anomalies": self.anomalies}}

    @classmethod
    def from_json(cls, data: Mapping[str, object], key: str) -> KernelPlan:
        """A cached plan; one from before the guard has an empty ``guard``."""
        guard = dict(data.get("guard") or {})
        anomalies = dict(guard.pop("anomalies", {}))
        return cls({r: [(int(m), str(c)) for m, c in t] for r, t in data["linear"].items()},
                   str(data["elementwise"]), str(data["sampling"]), str(data["attention"]),
                   "cached", str(data.get("fresh_prompts", "native")),
                   str(data.get("attention_tiles", "vector")),
                   str(data.get("layer_loop", "native")), key, 0.0,
                   dict(data.get("timings", {})), anomalies=anomalies, guard=guard)


def load_cached(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def measuring(path: Path):
    """Held while this process measures the plan for ``path``: executors of one machine
    started together (replicas, a compose stack) measure one at a time, and each after the
    first finds the plan stored. Timings taken while another process times its own kernels
    on the same cores would be the neighbour's, not the machine's: so inside the lock of
    ``path`` (the plan or step costs of one key) it takes the cache's machine-wide
    ``measuring.lock`` (``path``'s grandparent: ``<cache>/tuning/<key>.json`` ->
    ``<cache>``), and executors of other configs measure one after another too (two of
    them side by side on 2 cores, each timing with a 2-thread OpenMP team, took 50-52 s each
    in a suite run where one alone took 7-25 s). Always in that order: none waits on a lock
    held by one that waits on its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _flocked(path.with_suffix(".lock")), _flocked(path.parent.parent / "measuring.lock"):
        yield


@contextlib.contextmanager
def _flocked(lock: Path):
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def store(path: Path, data: Mapping[str, object]) -> None:
    """Atomically (concurrent executors on one machine agree)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


# ---------------------------------------------------------------------- timing
def time_call(fn: Callable[[], object]) -> float:
    """Seconds of one candidate, as :func:`time_interleaved` times several."""
    return time_interleaved({"fn": fn})["fn"]


STREAM_BYTES = 64 << 20          # weights rotated through per candidate (see time_linear)


# A candidate this much slower than the bucket's best, at calls this long, in PRUNE_BUCKETS
# buckets in a row, is not timed at larger ones: on a 2-core AVX2 EPYC torch's own bf16 GEMM
# runs 7-10x behind the native and fp32 kernels, and its calls up to 2048 rows were ~30 s of
# a 43-44 s bf16 plan (15-16 s without them, the same choices). A fixed cost per call could
# make a candidate lose by 3x at small M and win later, so only calls of a millisecond or
# more count: there the GEMM, not a fixed cost, is the time.
PRUNE_RATIO = 3.0
PRUNE_MIN_S = 1e-3
PRUNE_BUCKETS = 2


def time_linear(candidates: Mapping[str, tuple[Callable, Sequence, int]], k: int,
                dtype: torch.dtype, buckets: Sequence[int],
                timer: Callable[[Mapping[str, Callable[[], object]]], dict[str, float]]
                | None = None, anomalies: dict | None = None,
                meter: tuning_guard.LoadMeter | None = None) -> dict[str, dict[int, float]]:
    """``candidates``: name -> (fn(x, weight), copies of the weight in that layout, largest
    M it runs). Times each at every bucket it can run (``buckets`` ascending); returns seconds
    per candidate and bucket. Each call takes the next copy: in a real step every weight is
    used once and 30 layers of others pass through the caches before it comes round again,
    so a weight that stays in L2 between calls would favour the kernels that compute most
    per byte. A candidate left behind (PRUNE_RATIO, PRUNE_MIN_S, PRUNE_BUCKETS) has no
    times above the bucket where it was dropped, as one that cannot run them: it cannot win
    them either. A candidate whose time does not grow with the rows is timed again at those
    buckets (:func:`kernels.tuning_guard.recheck`: quiet cores are those ``meter`` finds
    under LOAD_LIMIT since this call began); what that found goes into ``anomalies`` (by
    "candidate@rows").
    ``timer``: :func:`time_interleaved`; ``meter``: a LoadMeter (tests inject their own)."""
    timer = timer or time_interleaved
    meter = meter or tuning_guard.LoadMeter()
    since = meter.read()
    g = torch.Generator().manual_seed(0)

    def fns_at(names: Sequence[str], m: int) -> dict[str, Callable[[], object]]:
        x = torch.randn(m, k, generator=g).to(dtype)
        fns = {}
        for name in names:
            fn, copies, _ = candidates[name]
            turn = iter(range(1 << 62))
            fns[name] = (lambda fn=fn, copies=copies, turn=turn, x=x:
                         fn(x, copies[next(turn) % len(copies)]))
        return fns

    out: dict[str, dict[int, float]] = {c: {} for c in candidates}
    behind = {c: 0 for c in candidates}           # buckets in a row lost by PRUNE_RATIO
    for m in buckets:
        times = timer(fns_at([name for name, (_, _, max_m) in candidates.items()
                              if m <= max_m and behind[name] < PRUNE_BUCKETS], m))
        best = min(times.values(), default=0.0)
        for name, t in times.items():
            out[name][m] = t
            far = t >= PRUNE_MIN_S and t >= PRUNE_RATIO * best
            behind[name] = behind[name] + 1 if far else 0
    found = tuning_guard.recheck(
        out, lambda names, m: timer(fns_at(names, m)),
        lambda: tuning_guard.load_between(since, meter.read(), meter.cores)
        <= tuning_guard.LOAD_LIMIT)
    if anomalies is not None:
        anomalies.update(found)
    return out


def copies_for(w: torch.Tensor, prepare: Callable[[torch.Tensor], object],
               stream_bytes: int = STREAM_BYTES) -> list:
    """Enough distinct prepared copies of ``w`` to stream ``stream_bytes`` (at most 64)."""
    n = max(1, min(64, stream_bytes // max(w.numel() * w.element_size(), 1)))
    return [prepare(w.clone()) for _ in range(n)]


def time_interleaved(fns: Mapping[str, Callable[[], object]], reps: int = 9,
                     budget_s: float = 0.5) -> dict[str, float]:
    """The least seconds of each candidate over ``reps`` rounds after two warm-up calls
    (fewer rounds once ``budget_s`` is spent, at least 3), one call of each in turn per
    round: a burst of load from another process slows them all alike instead of one of
    them. The least, not the median: other processes only ever add time, and a choice
    between kernels must not follow them."""
    for fn in fns.values():
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    for i in range(reps):
        if i >= 3 and time.perf_counter() - start > budget_s:
            break
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(t) for name, t in times.items()}
