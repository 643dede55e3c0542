"""What a deterministic step costs (issue 50): SmolLM2-shaped steps (random weights, the
kernel plan measured here) timed on the measured plan, and with some of their sequences
deterministic run two ways:

- ``step``: the whole step on the batch-invariant kernels when any row is deterministic
  (``StepPlan.deterministic``; what the executor does);
- ``split``: the deterministic sequences' rows in a forward of their own on the invariant
  kernels, the rest in another on the measured plan (a row meets other sequences' rows
  only in shared kernels, so two forwards are exactly "their own kernels within a mixed
  step": each weight is read twice).

    scripts/run bench/deterministic --dtype bfloat16 --steps 7 [--tiles vector,amx]

Each shape is decode rows (context ``--context``) and prompt chunks (fresh, of the given
length); ``frac`` is the share of its sequences that are deterministic (at least one).
Prints ms/step, median of ``--steps``, each after one warm-up.
"""
from __future__ import annotations

import argparse
import functools
import random
import statistics
import time

import torch

from components.executor.build import build_model
from components.executor.synthetic import SMOLLM2_135M, random_weights
from components.model.fetch import cache_dir
from kernels import AttentionMetadata

BLOCK = 16
# (decode rows, prompt chunks' lengths)
SHAPES = [(1, []), (64, []), (256, []), (32, [256]), (0, [512]), (0, [128] * 8),
          (64, [512])]


def _forward(model, kv, seqs: list[tuple[int, int]], tables: list[list[int]],
             idx: list[int], invariant: bool):
    """A call running the sequences ``idx`` of ``seqs`` (new tokens, context) as one
    forward, on the invariant kernels or the plan's; None for no sequences."""
    if not idx:
        return None
    sub = [seqs[i] for i in idx]
    meta = AttentionMetadata.build([q for q, _ in sub], [c for _, c in sub],
                                   [tables[i] for i in idx], BLOCK)
    ids = torch.randint(0, SMOLLM2_135M.vocab_size, (meta.num_tokens,))
    last = torch.tensor(meta.query_start_loc[1:].tolist()) - 1
    return lambda: model.forward(ids, meta.positions, kv, meta, last, deterministic=invariant)


def _timed(fn, steps: int) -> float:
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--frac", default="0.1,1.0", help="shares of deterministic sequences")
    p.add_argument("--tiles", default="amx,vector",
                   help="the invariant attention tiles to time, comma-separated: amx, vector "
                        "(the split runs on the first)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = build_model(SMOLLM2_135M, random_weights(SMOLLM2_135M, dtype), dtype=dtype,
                        tuning_cache=cache_dir(), kv_block_size=BLOCK)
    print(f"plan: {model.plan.summary()}\ninvariant: {model.plan.invariant_linear}, "
          f"threads {torch.get_num_threads()}")
    rng = random.Random(0)
    need = sum(-(-(args.context + 1) // BLOCK) for _ in range(256)) + 8 * 40 + 64
    kv = model.new_kv_cache(need, BLOCK)
    blocks = list(range(need))
    rng.shuffle(blocks)
    fracs = [float(f) for f in args.frac.split(",")]
    tiles = args.tiles.split(",")
    head = f"{'shape':<22}{'plan':>9}" + "".join(f"{'inv-' + t:>12}" for t in tiles) + "".join(
        f"{'split ' + str(f):>12}" for f in fracs)
    print(head)
    for decodes, prompts in SHAPES:
        seqs = [(1, args.context)] * decodes + [(n, 0) for n in prompts]
        tables, at = [], 0
        for q, c in seqs:
            nb = -(-(q + c) // BLOCK)
            tables.append(blocks[at:at + nb])
            at += nb

        forward = functools.partial(_forward, model, kv, seqs, tables)

        every = list(range(len(seqs)))
        row = f"{f'{decodes}d+' + 'x'.join(map(str, prompts)) if prompts else f'{decodes}d':<22}"
        row += f"{_timed(forward(every, False), args.steps):>9.2f}"
        for t in tiles:
            model.plan.invariant_tiles = model.backend.invariant_tiles = t
            row += f"{_timed(forward(every, True), args.steps):>12.2f}"
        model.plan.invariant_tiles = model.backend.invariant_tiles = tiles[0]
        for f in fracs:
            det = set(rng.sample(every, max(1, round(f * len(seqs)))))
            a = forward(sorted(det), True)
            b = forward([i for i in every if i not in det], False)
            row += f"{_timed(lambda a=a, b=b: (a(), b and b()), args.steps):>12.2f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
