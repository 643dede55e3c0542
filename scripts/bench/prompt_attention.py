"""One layer's prompt attention on the native CPU kernel (the prompt kernels: a run of 32 or
more rows of one sequence), SmolLM2-135M shapes (9 q / 3 kv heads, head dim 64, bf16, KV
blocks of 16 scattered over the cache, q a view into the fused qkv projection as the model
passes it): ms per call (median and best of ``--reps``) and causal TFLOP/s (4 x head dim
FLOPs per query head per attended key), with the machine it ran on.

    scripts/run bench/prompt_attention --shapes 512:0,2048:0,2048:2048,512:2048 --threads 2

A shape is ``new:context`` (a prompt's chunk of ``new`` rows after ``context`` cached keys).
``--tiles amx`` (the default where the CPU has AMX tiles) or ``vector``. Run it under the CPU
lock; to compare two trees, run it from each (``PYTHONPATH``), back to back.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kernels import cpu_native, machine, native_lib
from kernels.metadata import AttentionMetadata

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def case(new: int, context: int, seed: int = 0):
    """q (a view into a [new, 15 x 64] qkv), the two caches and the step's metadata."""
    rng = random.Random(seed)
    blocks = -(-(new + context) // BLOCK)
    ids = list(range(blocks + 3))
    rng.shuffle(ids)
    g = torch.Generator().manual_seed(seed)
    cache = (blocks + 3, BLOCK, KV_HEADS, DIM)
    kc = torch.randn(*cache, generator=g).bfloat16()
    vc = torch.randn(*cache, generator=g).bfloat16()
    qkv = torch.randn(new, (HEADS + 2 * KV_HEADS) * DIM, generator=g).bfloat16()
    q = qkv[:, :HEADS * DIM].view(new, HEADS, DIM)
    meta = AttentionMetadata.build([new], [context], [ids[:blocks]], BLOCK)
    return q, kc, vc, meta


def flops(new: int, context: int) -> float:
    keys = new * context + new * (new + 1) // 2           # row i attends context + i + 1
    return 4.0 * DIM * HEADS * keys


def measure(new: int, context: int, amx: bool, reps: int) -> tuple[float, float]:
    q, kc, vc, meta = case(new, context)
    scale = DIM ** -0.5
    for _ in range(2):
        cpu_native.paged_attention(q, kc, vc, meta, scale, amx)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        cpu_native.paged_attention(q, kc, vc, meta, scale, amx)
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="512:0,2048:0,2048:2048,512:2048",
                    help="new:context, comma separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tiles", choices=["amx", "vector"],
                    default="amx" if native_lib.amx_supported() else "vector")
    args = ap.parse_args()
    if args.tiles == "amx" and not native_lib.amx_supported():
        raise SystemExit("--tiles amx: this CPU has no AMX tiles")
    torch.set_num_threads(args.threads)
    model, have = machine.cpu_info()
    extra = [f for f in ("avx512_fp16",) if f in have]
    print(f"{model} [{' '.join(machine.describe()['flags'] + extra)}], "
          f"{args.threads} threads, tiles {args.tiles}, median / best of {args.reps}")
    print(f"{'new':>6} {'context':>8} {'ms (med)':>9} {'ms (best)':>10} {'TFLOP/s':>8}")
    for shape in args.shapes.split(","):
        new, context = (int(x) for x in shape.split(":"))
        med, best = measure(new, context, args.tiles == "amx", args.reps)
        print(f"{new:>6} {context:>8} {med * 1e3:>9.2f} {best * 1e3:>10.2f} "
              f"{flops(new, context) / med / 1e12:>8.3f}")


if __name__ == "__main__":
    main()
