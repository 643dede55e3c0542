"""The steps the executor times at startup, for the scheduler's step-cost model to start
from (``ExecutorReady.step_costs``): with them admission predicts TTFT from the first
request after a start or a restart, instead of passing every deadline check until the
scheduler has measured steps of its own.

A handful of real steps through the runner, at shapes that tell the model's features apart
(``components/costs/cost_model.py``): fresh prompt chunks of three sizes (the fixed and
per-token costs, and attention's quadratic), a short chunk at two long contexts (attention
per key read), and decode batches (the per-sequence and per-position costs). Each is run
once to warm up (oneDNN builds a primitive per new shape, first-touch page faults), then
``REPS`` rounds of all of them; each shape's least time is kept. Before any KV exists (as
the copy bandwidth is measured), and after the structured-output vocabulary is built (its
build holds the GIL: steps timed beside it took ~2 s each, whatever their size): the
probe's sequences write the first blocks of the pool and are forgotten.

Measured once per machine and cached under ``<cache>/step_costs/<key>.json``, as the kernel
plan is (:mod:`kernels.tuning`: executors started together measure one at a time under the
same file lock, and the file is replaced atomically). The key hashes what a step's time
depends on: the machine (CPU model, flags, cores, threads, torch; the GPU's name), the
model's shape, the dtypes, the attention backend and the kernels the plan chose (not whether
it was measured, read back or provisional: :func:`plan_choices`), and the probe's
shapes (clipped to the engine's budget, context, sequences and pool). ``engine.kernels.cache
= false`` measures at each start, as for the kernel plan; so does a measurement whose steps
did not grow with their work (``scales_with_work``: a stalled, busy machine).

A config with a key of its own measures only the probe steps no other config has stored:
each file records, per step, :func:`probe_key` (its shape and the kernels that step runs)
and :func:`base_key` (the machine, model, dtypes, block, backend), and a step another
config of the same base timed under the same kernels is taken from it (the fresh chunks
and the decodes that every config probes alike, where the budgets, pools and contexts
differ).

Timed in the executor, a step leaves out the bus round trip and the scheduler's planning
that the scheduler's own samples include; the scheduler's model scales its prior by its
first measured steps, then fits them (``StepCostModel``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path
from typing import NamedTuple

import torch

from kernels import tuning
from schemas.wire import NewSeq, SeqStep, StepPlan, StepSample

VERSION = 3                 # bump when the shapes or the timing change
REPS = 3
PROBE_SEQ = 1 << 40                 # seq ids above any the scheduler hands out


class Probe(NamedTuple):
    """``rows`` sequences each computing ``tokens`` after ``done`` positions."""

    rows: int
    tokens: int
    done: int


def probe_shapes(budget: int, max_len: int, max_seqs: int, num_blocks: int,
                 block_size: int) -> list[Probe]:
    """The probe, clipped to what the engine can run: fresh chunks of 16, 128 and 256
    tokens; a step of the budget's worth of 128-token prompts and one of a single prompt;
    32 tokens after a quarter of, and after, a long context (4096, or the longest
    that fits); one decode, and a batch of 16 at 512."""

    def fits(p: Probe) -> bool:
        shared = p.done // block_size
        own = -(-(p.done + p.tokens) // block_size) - shared
        return (p.rows <= max_seqs and p.rows * p.tokens <= budget
                and p.done + p.tokens <= max_len and shared + p.rows * own <= num_blocks)

    long = max(min(4096, max_len - 32, (num_blocks - 4) * block_size), 0)
    batch = min(16, max_seqs)
    # and steps at the budget: a burst's (short prompts, many rows) and one long prompt's:
    # the linear kernels change with the rows (the plan's per-size choice), so a fit of
    # chunks up to 256 alone priced a full 2048-token step 1.4-1.8x what it took
    shapes = [Probe(1, 16, 0), Probe(1, 128, 0), Probe(1, 256, 0),
              Probe(max(budget // 128, 1), 128, 0), Probe(1, budget, 0),
              Probe(1, 32, long // 4), Probe(1, 32, long),
              Probe(1, 1, 255), Probe(batch, 1, 511)]
    out: list[Probe] = []
    for p in shapes:
        p = p._replace(done=max(min(p.done, max_len - p.tokens), 0))
        while not fits(p) and p.tokens > 1:           # a small engine: a smaller chunk
            p = p._replace(tokens=p.tokens // 2)
        if fits(p) and p not in out:
            out.append(p)
    return out


def sample_of(p: Probe, seconds: float) -> StepSample:
    pairs = p.rows * (p.tokens * p.done + p.tokens * (p.tokens + 1) // 2)
    return StepSample(p.rows * p.tokens, p.rows * (p.done + p.tokens), p.rows, pairs, seconds)


def probe_plan(p: Probe, step_id: int, block_size: int, vocab: int) -> StepPlan:
    """One step of ``p``: its rows share the blocks before their own writes (as prefix
    hits do), each writes its own, and each samples its last row greedily."""
    shared = p.done // block_size
    own = -(-(p.done + p.tokens) // block_size) - shared
    ids = [(1000 + 7 * i) % vocab for i in range(p.done + p.tokens)]
    new_seqs, steps = [], []
    for r in range(p.rows):
        sid = PROBE_SEQ + step_id * 1024 + r
        blocks = list(range(shared)) + list(range(shared + r * own, shared + (r + 1) * own))
        new_seqs.append(NewSeq(sid, ids, len(ids), p.done, blocks, 0.0, 1.0, 0, None))
        steps.append(SeqStep(sid, p.tokens, [], True))
    return StepPlan(step_id, new_seqs, steps, [])


def measure(runner, shapes: list[Probe], vocab: int, reps: int = REPS) -> list[StepSample]:
    """Each shape's least time over ``reps`` rounds after one call to warm up, every shape
    once per round: a burst of load from another process slows a round's shapes alike
    instead of all of one shape's. The least, as the kernel plan's timings: other processes
    only ever add time (the scheduler's live steps then say how much they add now)."""
    step_id = 0

    def run(p: Probe) -> float:
        nonlocal step_id
        step_id += 1
        result = runner.step(probe_plan(p, step_id, runner.block_size, vocab))
        runner.seqs.clear()
        return result.elapsed_ns / 1e9

    for p in shapes:
        run(p)
    times: list[list[float]] = [[] for _ in shapes]
    for _ in range(reps):
        for i, p in enumerate(shapes):
            times[i].append(run(p))
    return [sample_of(p, min(t)) for p, t in zip(shapes, times)]


def _base(model, runner) -> dict[str, object]:
    """What every probe step's time depends on besides its shape and its kernels."""
    machine = tuning.machine_info()
    if runner.kv.device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(runner.kv.device)
    spec = model.spec
    return {"v": VERSION, "machine": machine,
            "model": [spec.num_layers, spec.hidden_size, spec.intermediate_size,
                      spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size],
            "dtype": str(model.dtype), "kv": str(runner.kv.dtype), "block": runner.block_size,
            "backend": model.backend.name, "graphs": runner.graphs is not None}


def _hash(blob: object) -> str:
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_key(model, runner, shapes: list[Probe]) -> str:
    return _hash({**_base(model, runner), "plan": plan_choices(model.plan),
                  "shapes": [list(p) for p in shapes]})


def base_key(model, runner) -> str:
    """The key of the steps another config may share: same machine, model, dtypes, block,
    backend."""
    return _hash(_base(model, runner))


def probe_key(plan, p: Probe) -> str:
    """One probe step under ``plan``: its shape and the kernels that step runs (each
    linear's pick at the step's rows, the lm_head's at its sampled rows, the other ops).
    Two configs whose plans differ only at step sizes this probe does not reach (a larger
    budget's last buckets) run it alike."""
    kernels = {k: v for k, v in plan_choices(plan).items() if not k.startswith("linear.")}
    if plan is not None:
        kernels.update({f"linear.{role}": tuning.pick(table, p.rows if role.startswith(
            "lm_head") else p.rows * p.tokens) for role, table in sorted(plan.linear.items())})
    return _hash({"probe": list(p), "kernels": kernels})


def _known(root: Path, base: str) -> dict[str, StepSample]:
    """The probe steps stored by other configs of this ``base``, by :func:`probe_key`."""
    out: dict[str, StepSample] = {}
    for path in sorted(root.glob("*.json"), key=lambda f: f.stat().st_mtime):
        data = tuning.load_cached(path)
        if not isinstance(data, dict) or data.get("base") != base:
            continue
        try:
            out.update({k: StepSample(*row) for k, row in zip(data["probes"], data["steps"],
                                                              strict=True)})
        except (KeyError, TypeError, ValueError):
            continue
    return out


def plan_choices(plan) -> dict[str, str]:
    """What a kernel plan runs (its summary less how it was had): the start that measured
    the plan and every start that reads it back time the same kernels, so they share one
    probe; a provisional plan measured again to the same choices keeps it too."""
    if plan is None:
        return {}
    return {k: v for k, v in plan.summary().items() if k not in ("source", "guard")}


def _cached(path: Path | None, key: str) -> list[StepSample] | None:
    data = tuning.load_cached(path) if path is not None else None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    try:
        return [StepSample(*row) for row in data["steps"]]
    except (KeyError, TypeError):
        return None


def step_costs(runner, model, budget: int, max_len: int, max_seqs: int,
               cache_dir: Path | None) -> tuple[list[StepSample], str, float]:
    """The probe's samples, how they were had ("cached" or "measured") and the seconds
    measuring took (0 when cached). ``cache_dir`` None: measure, keep nothing."""
    shapes = probe_shapes(budget, max_len, max_seqs, runner.num_blocks, runner.block_size)
    if not shapes:
        return [], "none", 0.0
    key = cache_key(model, runner, shapes)
    path = cache_dir / "step_costs" / f"{key}.json" if cache_dir is not None else None
    if (got := _cached(path, key)) is not None:
        return got, "cached", 0.0
    with tuning.measuring(path) if path is not None else contextlib.nullcontext():
        if (got := _cached(path, key)) is not None:        # another executor measured
            return got, "cached", 0.0
        base = base_key(model, runner)
        keys = [probe_key(model.plan, p) for p in shapes]
        known = _known(path.parent, base) if path is not None else {}
        todo = [p for p, k in zip(shapes, keys) if k not in known]
        t0 = time.perf_counter()
        fresh = iter(measure(runner, todo, model.spec.vocab_size) if todo else [])
        seconds = round(time.perf_counter() - t0, 2)
        samples = [known[k] if k in known else next(fresh) for k in keys]
        reused = len(shapes) - len(todo)
        how = "measured" if not reused else "taken from other configs' probes" if not todo \
            else f"measured {len(todo)}, {reused} from other configs' probes"
        if not scales_with_work(samples):
            return samples, f"{how}, stalled: not kept", seconds
        if path is not None:
            tuning.store(path, {"key": key, "seconds": seconds, "base": base, "probes": keys,
                                "steps": [[s.tokens, s.context, s.seqs, s.pairs, s.seconds]
                                          for s in samples]})
    return samples, how, seconds


def scales_with_work(samples: list[StepSample]) -> bool:
    """Whether the largest fresh chunk took at least twice the smallest, where it is 8x
    the work or more. On a CPU busy with other processes every step can take the same
    ~2 s whatever its size (16 tokens 1.7 s, 256 tokens 2.1 s, on two shared cores: each
    OpenMP barrier waits for a descheduled thread), which is the neighbours' cost, not
    this machine's: such a measurement serves this start and is not kept. (A small model
    on a GPU fails it too, its steps bound by launches: measured again at each start,
    which costs a GPU little.)"""
    fresh = sorted((s for s in samples if s.seqs == 1 and s.context == s.tokens),
                   key=lambda s: s.tokens)
    if len(fresh) < 2 or fresh[-1].tokens < 8 * fresh[0].tokens:
        return True
    return fresh[-1].seconds >= 2 * fresh[0].seconds
