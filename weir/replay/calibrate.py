"""``weir calibrate``: measure this machine's step times on the live engine and fit a cost
profile for ``weir simulate``.

It starts a local engine (the config given, with the scheduler's step log on), runs a
workload that covers the step shapes replay traffic makes (prefill chunks from 16 tokens up
to the step budget, decode batches from 1 up to 64 sequences at several context lengths,
and decode batches with prefill chunks riding along), stops the engine, and fits the
profile (``weir.replay.profile``) to every step it logged. ``--from-steps`` fits a step log
written elsewhere instead (a production engine's, or ``scripts/gpu_check``'s on a GPU).
"""
from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

import anyio

from kernels.machine import describe
from schemas.config import load_config
from weir.replay import profile as profiles
from weir.replay.local import LocalEngine

_VOCAB = (1000, 40000)        # ordinary ids of the default model's vocabulary


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*_VOCAB) for _ in range(n)]


async def _workload(endpoint: str, key: str, budget: int, max_len: int, max_seqs: int,
                    quick: bool, log) -> None:
    from weir.client import AsyncClient

    rng = random.Random(0)
    async with AsyncClient(endpoint, api_key=key, max_retries=0, timeout=600) as c:

        async def one(prompt: int, out: int, prefix: list[int] = ()) -> None:
            ids = list(prefix) + _ids(rng, prompt - len(prefix))
            await c.generate(prompt_token_ids=ids, max_tokens=out, ignore_eos=True,
                             temperature=0.0)

        async def batch(jobs: list[tuple[int, int]]) -> None:
            """Decode batches: the prompts share all but their last 8 tokens, so the prefix
            cache prefills the context once while every decode step still reads all of it."""
            prefix = _ids(rng, max(jobs[0][0] - 8, 0))
            await one(jobs[0][0], 1, prefix)                        # fill the cache
            async with anyio.create_task_group() as tg:
                for prompt, out in jobs:
                    tg.start_soon(one, prompt, out, prefix)

        await batch([(32, 4)] * 2)                                   # warm up
        lengths = [n for n in (16, 64, 128, 256, 512, 1024, 2048, 4096)
                   if n <= min(budget, max_len - 8)]
        log(f"prefill chunks: {lengths}")
        for _ in range(1 if quick else 2):
            for n in lengths:
                await one(n, 1)
        batches = [b for b in (1, 4, 16, 32, 64) if b <= max_seqs]
        contexts = (64, 512) if quick else (64, 512, 1536)
        for ctx in contexts:
            if ctx + 32 > max_len:
                continue
            log(f"decode batches {batches} at context {ctx}")
            for b in batches:
                await batch([(ctx, 12 if quick else 24)] * b)
        log("decode with prefill riding along")
        for b in ([8] if quick else [8, 32]):
            if b > max_seqs:
                continue
            async with anyio.create_task_group() as tg:
                for _ in range(b):
                    tg.start_soon(one, 128, 48)
                for n in lengths[2:]:
                    await anyio.sleep(0.05)
                    tg.start_soon(one, n, 2)


def calibrate(config: str | None, out: Path, *, model: str | None = None,
              dtype: str | None = None, max_model_len: int | None = None,
              device: str | None = None, quick: bool = False,
              log=lambda msg: print(msg, file=sys.stderr)) -> profiles.CostProfile:
    """Measure on a local engine started from ``config`` with these engine overrides."""
    engine = {"model": model, "dtype": dtype, "max_model_len": max_model_len, "device": device}
    cfg = load_config(config, topology={"run_dir": tempfile.gettempdir()}, engine=engine)
    extra_args = tuple(arg for key, value in engine.items() if value is not None
                       for arg in (f"--{key.replace('_', '-')}", str(value)))
    steps = Path(tempfile.mkdtemp(prefix="weir-calibrate-")) / "steps.jsonl"
    log("starting a local engine ...")
    started = time.monotonic()
    # fcfs admission: the workload measures steps (decode batches up to max_num_seqs, past
    # the pool and any class's SLO), not the policy, which would refuse most of it
    with LocalEngine(config, extra_args=("--step-log", str(steps), "--admission-policy",
                                         "fcfs", *extra_args)) as engine:
        anyio.run(_workload, engine.endpoint, engine.service_key,
                  cfg.scheduler.max_num_batched_tokens, cfg.engine.max_model_len,
                  cfg.scheduler.max_num_seqs, quick, log)
    samples = profiles.read_step_log(steps)
    engine_info = {"model": cfg.engine.model or "default", "dtype": cfg.engine.dtype,
                   "device": cfg.engine.device, "config": config or "",
                   "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
                   "extra_args": list(extra_args)}
    prof = profiles.fit(samples, source="weir calibrate (live engine, bus round trips "
                        "included)", machine=describe(), engine=engine_info)
    profiles.save(prof, out)
    log(f"{len(samples)} steps in {time.monotonic() - started:.0f} s; wrote {out}")
    return prof


def from_steps(path: str, out: Path, source: str = "") -> profiles.CostProfile:
    """Fit a step log. The profile's machine is the one the log names where its steps ran
    (``scripts/gpu_check`` writes ``machine`` into each line: its GPU), else this one's."""
    steps = profiles.read_step_log(path)
    named = next((s["machine"] for s in steps if isinstance(s.get("machine"), dict)), None)
    prof = profiles.fit(steps, source=source or f"step log {path}",
                        machine=named or describe())
    profiles.save(prof, out)
    return prof
