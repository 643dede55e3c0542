"""gpu_check's step grid for a cost profile: executor steps of many shapes (prefill chunks,
decode batches at several contexts, decode with a prefill chunk riding along) run as
ModelRunner.step runs them and written as a step log that ``weir calibrate --from-steps``
fits. A ``budget`` is gpu_check's ``Budget``. Imports nothing of msgspec, zmq or weir."""
from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

from scripts.gpu.timing import _sync


@dataclass(frozen=True)
class StepCase:
    """One step to time: ``(new tokens, tokens computed before)`` for each sequence."""
    kind: str                                       # prefill, decode or mixed
    seqs: tuple[tuple[int, int], ...]

    def shape(self) -> dict[str, int]:
        """The step's shape as ``plan_shape`` (components/costs/cost_model.py) counts it."""
        return {"tokens": sum(n for n, _ in self.seqs),
                "context": sum(done + n for n, done in self.seqs),
                "seqs": len(self.seqs),
                "pairs": sum(n * done + n * (n + 1) // 2 for n, done in self.seqs)}

    def blocks(self, block_size: int) -> int:
        return sum(-(-(done + n) // block_size) for n, done in self.seqs)


@dataclass(frozen=True)
class StepGrid:
    """The steps to time: one-sequence prefill chunks from empty and after a computed
    prefix, decode batches at each context, and decode batches at ``mixed_context`` with one
    prefill chunk from empty riding along."""
    chunks: tuple[int, ...]
    after_prefix: tuple[tuple[int, int], ...]       # (chunk, tokens computed before it)
    batches: tuple[int, ...]
    contexts: tuple[int, ...]                       # tokens computed before each decode token
    mixed: tuple[tuple[int, int], ...]              # (decode batch, prefill chunk)
    mixed_context: int
    repeats: int = 5
    warmup: int = 2

    def cases(self) -> list[StepCase]:
        out = [StepCase("prefill", ((n, 0),)) for n in self.chunks]
        out += [StepCase("prefill", ((n, done),)) for n, done in self.after_prefix]
        out += [StepCase("decode", ((1, ctx),) * b) for ctx in self.contexts
                for b in self.batches]
        out += [StepCase("mixed", ((1, self.mixed_context),) * b + ((n, 0),))
                for b, n in self.mixed]
        return out

    def blocks(self, block_size: int) -> int:
        """KV blocks the largest case needs (each case gets disjoint tables)."""
        return max(c.blocks(block_size) for c in self.cases())


# the engine's defaults: max_model_len 2048 (every decode here replays a graph), a step
# budget of 2048 tokens, KV blocks of 16
GPU_GRID = StepGrid(chunks=(16, 32, 64, 128, 256, 512, 1024, 2048),
                    after_prefix=((256, 768), (512, 1024), (1024, 1024)),
                    batches=(1, 2, 4, 8, 16, 32, 64, 128, 256), contexts=(64, 512, 1536),
                    mixed=((8, 128), (8, 1024), (32, 128), (32, 1024), (128, 128), (128, 1024)),
                    mixed_context=512)


TINY_GRID = StepGrid(chunks=(4, 8, 16, 32), after_prefix=((8, 16), (16, 32)), batches=(1, 2, 4),
                     contexts=(8, 24), mixed=((2, 8), (3, 16)), mixed_context=8, repeats=3,
                     warmup=1)


@dataclass(frozen=True)
class StepTiming:
    case: StepCase
    seconds: float                                  # median of the timed runs
    graph: bool                                     # replayed a CUDA graph


def run_step(model, kv, graphs, case: StepCase, input_ids: list[int],
             tables: list[list[int]], pieces=None) -> bool:
    """``case`` as ModelRunner.step (components/executor/runner.py) runs a plan's steps: a
    decode-only batch replays its CUDA graph when one fits, any other step that fits a
    token bucket of ``pieces`` (PiecewiseGraphs) replays its dense pieces with attention
    eager between them, anything else is one eager forward over every token; each sequence
    samples greedily from its last row, and the tokens come back to the host. True when a
    graph ran. (The runner itself needs msgspec's StepPlan, which the GPU machine may
    lack.)"""
    import torch

    from components.executor.sampling import sample
    from kernels.metadata import AttentionMetadata
    query_lens = [n for n, _ in case.seqs]
    context_lens = [done for _, done in case.seqs]
    n = len(query_lens)
    graph = (graphs is not None and len(input_ids) == n
             and graphs.can_replay(n, max(context_lens) + 1))
    if graph:
        logits = graphs.replay(input_ids, context_lens, tables)
    else:
        dev = kv.device
        meta = AttentionMetadata.build(query_lens, context_lens, tables, kv.block_size, dev)
        rows = [end - 1 for end in accumulate(query_lens)]
        forward = model.forward
        if pieces is not None and pieces.fits(len(input_ids)):
            forward, graph = pieces.forward, pieces.use_graphs
        logits = forward(torch.tensor(input_ids, dtype=torch.long, device=dev),
                         meta.positions, kv, meta,
                         torch.tensor(rows, dtype=torch.long, device=dev))
    sample(logits, [0.0] * n, [1.0] * n, [0] * n, [None] * n, [0] * n).tolist()
    return graph


def time_step_grid(model, kv, graphs, grid: StepGrid, budget,
                   pieces=None) -> list[StepTiming]:
    """Each of ``grid``'s steps on disjoint shuffled blocks of ``kv``: the median seconds of
    ``grid.repeats`` runs after ``grid.warmup``, each run between device syncs. This is the
    executor's step alone (what the runner reports as its elapsed time), with no bus round
    trip. Cases still left when ``budget`` runs out are skipped."""
    rng = random.Random(11)
    pool = range(kv.num_blocks)
    cases = grid.cases()
    out: list[StepTiming] = []
    for i, case in enumerate(cases):
        if budget.left() <= 0:
            print(f"  step grid: {len(cases) - i} shapes skipped (time budget)", flush=True)
            break
        blocks = iter(rng.sample(pool, case.blocks(kv.block_size)))
        tables = [[next(blocks) for _ in range(-(-(done + n) // kv.block_size))]
                  for n, done in case.seqs]
        shape = case.shape()
        ids = [rng.randrange(model.spec.vocab_size) for _ in range(shape["tokens"])]
        for _ in range(grid.warmup):
            run_step(model, kv, graphs, case, ids, tables, pieces)
        times = []
        for _ in range(grid.repeats):
            _sync(kv.device)
            t0 = time.perf_counter()
            graph = run_step(model, kv, graphs, case, ids, tables, pieces)
            _sync(kv.device)
            times.append(time.perf_counter() - t0)
        out.append(StepTiming(case, statistics.median(times), graph))
        print(f"  {case.kind:<7} seqs {shape['seqs']:>3} tokens {shape['tokens']:>4} context "
              f"{shape['context']:>6}: {out[-1].seconds * 1e3:8.3f} ms"
              f"{' (graph)' if graph else ''}", flush=True)
    return out


def step_machine() -> dict[str, object]:
    """Where the step grid ran, in ``kernels.machine.describe()``'s keys (this script imports
    nothing of weir's), with the device: ``weir calibrate --from-steps`` stamps the profile
    with it rather than with the machine that fits the log."""
    import platform

    import torch
    host = platform.machine()
    with contextlib.suppress(OSError):
        host = next((line.split(":", 1)[1].strip() for line in
                     Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), host)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"cpu": f"{device} (host {host})", "flags": [], "cores": os.cpu_count(),
            "python": platform.python_version(), "device": device, "torch": torch.__version__}


def write_step_log(path: Path, timings: list[StepTiming], model: str) -> None:
    """Step-log lines as the scheduler writes them (components/scheduler/service.py
    ``_log_step``), which ``weir calibrate --from-steps`` fits. ``measured_s`` and
    ``executor_s`` are both the executor's step: no bus round trip is included (see the
    module docstring)."""
    where = step_machine()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for t in timings:
            seconds = round(t.seconds, 7)
            f.write(json.dumps({**t.case.shape(), "measured_s": seconds, "executor_s": seconds,
                                "kind": t.case.kind, "graph": t.graph, "model": model,
                                "machine": where}) + "\n")
    print(f"  step grid: {len(timings)} steps written to {path}", flush=True)
