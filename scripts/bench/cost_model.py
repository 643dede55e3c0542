"""The step-cost model against measured prefill steps at several context lengths: the
model before the attention term, the model with it, and the startup profile alone (what
admission predicts from at a cold start).

    scripts/run bench/cost_model [--max-model-len 4096] [--budget 512]
        [--contexts 0,1024,2048,3072] [--chunk 256] [--rounds 3] [--steps LOG]

Starts a local engine (fcfs admission, the scheduler's step log on), runs a few decode
batches, then for each context C caches a prefix of C tokens (its chunks are prefill steps
at growing contexts too) and sends it again with ``--chunk`` new tokens: one prefill step
of that many tokens after C cached; ``--rounds`` times (new tokens each time), so a
neighbour's burst on the machine shows as one outlier among its repeats. ``--steps``
analyses a step log written before instead (``--prior``: the startup steps its engine
used). The log's steps are replayed in order through each model, each step predicted
before the model learns from it (as live); every prefill step (one sequence, at least 64
tokens) is printed, measured and each model's prediction and error, then the medians by
shape. The startup profile is the one the engine's executor measured (or found cached)
for this config.
"""
from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
from pathlib import Path

from components.costs.cost_model import StepCostModel, StepShape
from weir.replay.profile import read_step_log


def run_engine(args, steps: Path) -> list[tuple[StepShape, float]]:
    """Run the workload; the executor's startup steps (it wrote or read them at start)."""
    import anyio

    from components.model.fetch import cache_dir
    from weir.client import AsyncClient
    from weir.replay.local import LocalEngine

    cfg = Path(tempfile.mkdtemp(prefix="weir-costs-")) / "weir.toml"
    cfg.write_text(f'[admission]\npolicy = "fcfs"\n[scheduler]\n'
                   f'max_num_batched_tokens = {args.budget}\n')
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    async def work(endpoint: str, key: str) -> None:
        async with AsyncClient(endpoint, api_key=key, max_retries=0, timeout=900) as c:
            async def one(prompt: list[int], out: int = 1) -> None:
                await c.generate(prompt_token_ids=prompt, max_tokens=out, ignore_eos=True,
                                 temperature=0.0)

            for b in (1, 4, 8):                   # decode batches: the live window's bulk
                async with anyio.create_task_group() as tg:
                    for _ in range(b):
                        tg.start_soon(one, ids(32), 16)
            prefixes = {ctx: ids(ctx) for ctx in args.contexts}
            for r in range(args.rounds):        # rounds: a neighbour's burst shows as one
                for ctx, prefix in prefixes.items():
                    if ctx and not r:
                        await one(prefix)
                    await one(prefix + ids(args.chunk))
                print(f"round {r + 1}: done", file=sys.stderr)

    with LocalEngine(str(cfg), extra_args=("--step-log", str(steps), "--max-model-len",
                                           str(args.max_model_len))) as eng:
        anyio.run(work, eng.endpoint, eng.service_key)
    return startup_steps(cache_dir())


def startup_steps(cache: Path, path: str | None = None) -> list[tuple[StepShape, float]]:
    """The startup steps in ``path``, else the most recently written under ``cache`` (the
    engine just run)."""
    import json

    files = [Path(path)] if path else sorted((cache / "step_costs").glob("*.json"),
                                              key=lambda p: p.stat().st_mtime)
    if not files:
        return []
    print(f"startup steps: {files[-1]}", file=sys.stderr)
    rows = json.loads(files[-1].read_text())["steps"]
    return [(StepShape(*r[:4]), r[4]) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--contexts", default="0,1024,2048,3072")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", default=None, help="a step log to analyse (no engine run)")
    ap.add_argument("--prior", default=None,
                    help="with --steps: the startup steps its engine used (a file under "
                         "~/.cache/weir/step_costs; default the newest there)")
    args = ap.parse_args()
    args.contexts = [int(c) for c in re.split(r"[, ]+", args.contexts) if c]
    if args.steps:
        from components.model.fetch import cache_dir

        log = Path(args.steps)
        prior = startup_steps(cache_dir(), args.prior)
    else:
        log = Path(tempfile.mkdtemp(prefix="weir-costs-")) / "steps.jsonl"
        prior = run_engine(args, log)
    rows = read_step_log(log)
    before = StepCostModel()                       # no attention term, no prior
    after = StepCostModel()
    cold = StepCostModel()
    if prior and after.prior_from(prior):
        cold.prior_from(prior)
    print(f"{len(rows)} steps; startup profile: {len(prior)} steps "
          f"({'used' if after.prior else 'none'})")
    print(f"{'tokens':>6} {'context':>7} {'measured':>9} | {'before':>8} {'err':>6} | "
          f"{'after':>8} {'err':>6} | {'startup':>8} {'err':>6}")
    errs: dict[str, list[float]] = {"before": [], "after": [], "startup": []}
    groups: dict[tuple[int, int], list[tuple[float, dict[str, float]]]] = {}
    for r in rows:
        shape = StepShape(r["tokens"], r["context"], r["seqs"], r["pairs"])
        y = r["measured_s"]
        preds = {"before": before.predict(shape._replace(pairs=0)),
                 "after": after.predict(shape), "startup": cold.predict(shape)}
        if shape.seqs == 1 and shape.tokens >= 64:
            cells = []
            for name, p in preds.items():
                err = (p - y) / y
                errs[name].append(abs(err))
                cells.append(f"{p * 1e3:8.0f} {err:+6.0%}")
            print(f"{shape.tokens:6d} {shape.context - shape.tokens:7d} {y * 1e3:9.0f} | "
                  + " | ".join(cells))
            groups.setdefault((shape.tokens, shape.context - shape.tokens), []).append(
                (y, preds))
        before.observe(shape._replace(pairs=0), y)
        after.observe(shape, y)
    for name, e in errs.items():
        if e:
            e.sort()
            print(f"{name}: median |error| {e[len(e) // 2]:.0%}, worst {e[-1]:.0%} "
                  f"over {len(e)} prefill steps")
    print("by shape, medians (ms; error of the median prediction):")
    for (tokens, done), seen in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        y = statistics.median(m for m, _ in seen)
        cells = [f"{name} {statistics.median(p[name] for _, p in seen) / y - 1:+5.0%}"
                 for name in errs]
        print(f"  {tokens:5d} after {done:5d}: measured {y * 1e3:6.0f} (n={len(seen)}) | "
              + " | ".join(cells))


if __name__ == "__main__":
    main()
