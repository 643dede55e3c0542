"""A kernel plan for a smaller step budget, cut from one cached for a larger budget.

A plan is measured per step budget (``scheduler.max_num_batched_tokens``): its linear
timings run over the buckets of step tokens up to the budget (:func:`linear_buckets`), and a
plan for 256 tokens times 1, 2, ... 128, 256 rows. A plan measured for 2048 tokens on the
same machine, model shapes, dtypes and KV block size already holds those timings, taken the
same way (each bucket's candidates and pruning follow from the buckets below it alone), so
the smaller plan is its timings up to the smaller budget, chosen again
(:func:`kernels.tuning.choose_linear`), with the ops that do not depend on the budget
(elementwise, sampling, attention, its tiles, fresh prompts) as they were. A second config
on one machine then starts without measuring.

The source must time the same buckets below the cut (the smaller budget is one of its
buckets, as a power of two is), the lm_head at the same rows (``max_num_seqs``), and
sampling at the same rows (``min(64, max_num_seqs)``). Its guard record comes along: the
cut is provisional where its load or its own buckets' unsettled timings say so, and is then
measured again at a quieter start like any provisional plan (:mod:`kernels.tuning_guard`).
Only plans that name their scope (``scope`` in the file: written since this module) are
sources; one an operator marked to be measured again is not.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from components.executor.linear import GREEDY_HEAD
from kernels import tuning, tuning_guard
from kernels.tuning import KernelPlan

HEADS = ("lm_head", GREEDY_HEAD)
SAMPLING_ROWS = 64            # measure._time_sampling's largest batch of rows
SAME = ("dtypes", "shapes", "block_size")


def linear_buckets(max_tokens: int, max_seqs: int, head: bool) -> list[int]:
    """The step sizes a linear role is timed at: every bucket below the budget, then the
    budget; the lm_head's rows are the sampled ones, up to ``max_seqs``."""
    buckets = [b for b in tuning.M_BUCKETS if b < max_tokens] + [max_tokens]
    if not head:
        return buckets
    use = [b for b in buckets if b <= max(max_seqs, 1)]
    if use[-1] < max_seqs:
        use.append(max_seqs)
    return use


def scope_of(dtypes: str, shapes: Mapping[str, tuple[int, int]], max_tokens: int,
             max_seqs: int, block_size: int) -> dict[str, object]:
    """What a plan was measured for besides the machine (stored with it as ``scope``)."""
    return {"dtypes": dtypes, "shapes": {k: list(v) for k, v in sorted(shapes.items())},
            "max_m": max_tokens, "max_seqs": max_seqs, "block_size": block_size}


def cut(source: Mapping[str, object], scope: Mapping[str, object]) -> KernelPlan | None:
    """The plan for ``scope`` from the stored plan ``source`` (a plan file's JSON), or None
    where it cannot be had from it. The result's ``source`` is "cut", its guard the
    source's (``cut_from`` names it), its timings the source's up to the cut."""
    have = source.get("scope")
    if not isinstance(have, Mapping) or any(have.get(k) != scope[k] for k in SAME):
        return None
    big, small = int(have["max_m"]), int(scope["max_m"])
    seqs, want_seqs = int(have["max_seqs"]), int(scope["max_seqs"])
    if big < small or min(SAMPLING_ROWS, seqs) != min(SAMPLING_ROWS, want_seqs):
        return None
    guard = dict(source.get("guard") or {})
    if not guard or guard.get("remeasure"):
        return None                       # before the guard, or marked: measured again
    timings = source.get("timings")
    table = source.get("linear")
    if not isinstance(timings, Mapping) or not isinstance(table, Mapping):
        return None
    linear: dict[str, list[tuple[int, str]]] = {}
    kept: dict[str, object] = {}
    rows: dict[str, set[int]] = {}
    for role in table:
        head = role in HEADS
        want = linear_buckets(small, want_seqs, head)
        if linear_buckets(big, seqs, head)[:len(want)] != want:
            return None                   # the source timed other buckets below the cut
        times = timings.get(f"linear.{role}")
        if not isinstance(times, Mapping):
            return None
        part = {c: {m: float(t[str(m)]) for m in want if str(m) in t}
                for c, t in times.items()}
        part = {c: t for c, t in part.items() if t}
        if not part or any(not any(m in t for t in part.values()) for m in want):
            return None
        linear[role] = tuning.choose_linear(part)
        kept[f"linear.{role}"] = {c: {str(m): s for m, s in t.items()} for c, t in part.items()}
        rows[f"linear.{role}"] = set(want)
    kept.update({op: t for op, t in timings.items() if not op.startswith("linear.")})
    anomalies = {op: found for op, found in (
        (op, {k: v for k, v in dict(found).items()
              if int(k.rsplit("@", 1)[1]) in rows.get(op, set())})
        for op, found in dict(guard.pop("anomalies", None) or {}).items()) if found}
    guard["provisional"] = tuning_guard.judge(float(guard.get("load", 0.0)), anomalies,
                                              int(guard.get("cores", 1)))
    guard["cut_from"] = str(source.get("key", ""))
    return KernelPlan(linear, str(source["elementwise"]), str(source["sampling"]),
                      str(source["attention"]), "cut", str(source.get("fresh_prompts", "native")),
                      str(source.get("attention_tiles", "vector")),
                      str(source.get("layer_loop", "native")), timings=kept,
                      anomalies=anomalies, guard=guard)


def find(root: Path, machine: Mapping[str, object],
         scope: Mapping[str, object]) -> KernelPlan | None:
    """The plan for ``scope`` cut from a plan cached under ``root`` (``<cache>/tuning``) on
    this ``machine``: from the one with the smallest budget that serves, the newest of
    those."""
    best: tuple[tuple[int, float], KernelPlan] | None = None
    here = json.loads(json.dumps(dict(machine)))          # as stored: lists, not tuples
    for path in root.glob("*.json"):
        data = tuning.load_cached(path)
        if not isinstance(data, dict) or data.get("machine") != here:
            continue
        try:
            plan = cut(data, scope)
        except (KeyError, TypeError, ValueError):
            plan = None                   # a file of another shape: not a source
        if plan is None:
            continue
        rank = (int(data["scope"]["max_m"]), -float(plan.guard.get("measured_at", 0.0)))
        if best is None or rank < best[0]:
            best = (rank, plan)
    return best[1] if best is not None else None
