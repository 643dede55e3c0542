"""The executor's kernel plan: measured on this machine at the model's shapes, or cached,
or forced by the config (see :mod:`kernels.tuning` for the candidates and the rules).

Measuring (:mod:`components.executor.measure`) takes a few seconds on 2 cores (the SmolLM2
shapes, bf16) and happens once per machine: the plan is cached under
``<cache>/tuning/<key>.json``. Timings use weights of the model's shapes (random values: a
GEMM's time does not depend on them), so no layout of the real weights is made for a
candidate that is not chosen. The plan is made before the model and handed to it
(:func:`components.executor.build.build_model`); the model never plans.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from components.executor import determinism, plan_cut
from components.executor.candidates import (
    amx_possible,
    linear_candidates,
    native_ops_possible,
    shapes,
    triton_available,
)
from components.executor.linear import GREEDY_HEAD
from components.executor.measure import measure_plan
from kernels import get_backend, native_lib, tuning, tuning_guard
from kernels.tuning import KernelPlan
from kernels.tuning_guard import LoadMeter

if TYPE_CHECKING:
    from schemas.model import ModelSpec

log = structlog.get_logger("executor")
ROLES = ("qkv", "o", "gate_up", "down", "lm_head")
# gate_up's candidates with SiLU x up in the epilogue, and the GEMM they fuse it into
SILU_BASE = {"onednn_silu": "onednn", "fp32_onednn_silu": "fp32_onednn"}


def plan_kernels(spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 forced: Mapping[str, str] | None = None, attention: str = "auto",
                 cache_dir: Path | None = None, max_tokens: int = 2048,
                 max_seqs: int = 256, kv_block_size: int | None = None,
                 kv_dtype: torch.dtype | None = None) -> KernelPlan:
    """Choose every kernel: forced ones as given, the rest measured (or read from the
    cache under ``cache_dir``; None: measure, keep nothing). ``kv_dtype``: the KV cache's
    element type when it is not the model's (fp8): attention is timed on such a cache, and
    a fresh prompt's first chunk reads it like any other (no SDPA on the unrounded keys)."""
    kv_dtype = kv_dtype or dtype
    forced = {k: v for k, v in (forced or {}).items() if v != "auto"}
    shp = shapes(spec)
    native_ops = native_ops_possible(spec, dtype, device)
    cands = {role: linear_candidates(dtype, device, s, silu=role == "gate_up" and native_ops)
             for role, s in shp.items()}
    if device.type != "cpu":
        # a GPU: torch's GEMMs; the elementwise ops as Triton's fused kernels where Triton
        # is installed (one launch each instead of ~28 per layer, and a small model's decode
        # step is bound by launches: see kernels/triton_fused.py), else torch
        plan = KernelPlan({r: [(max_tokens, "torch")] for r in ROLES},
                          "triton" if triton_available() else "torch", "torch",
                          get_backend(attention, device, block_size=kv_block_size,
                                      dtype=dtype, kv_dtype=kv_dtype).name, source="device",
                          layer_loop="python")
        if "elementwise" in forced:
            plan.elementwise = _elementwise_forced(forced["elementwise"], False, device)
            plan.source = "forced"
        return plan
    machine = {**tuning.machine_info(), "native_ops": native_ops,
               "native_build": native_lib.build_key() if native_lib.available() else "",
               "candidates": {r: sorted(c) for r, c in cands.items()}}
    dtypes = str(dtype).removeprefix("torch.") + (
        "" if kv_dtype == dtype else "+kv:" + str(kv_dtype).removeprefix("torch."))
    key = tuning.machine_key(machine, dtypes, shp, max_tokens, max_seqs, kv_block_size or 16)
    # a plan with forced parts measures only the rest, and is not cached
    skip = set(forced) | ({"attention"} if attention != "auto" else set())
    path = cache_dir / "tuning" / f"{key}.json" if cache_dir is not None and not skip \
        else None
    plan = cached_or_measured(
        path, key, machine, lambda: measure_plan(spec, dtype, shp, cands, native_ops, max_tokens,
                                                 max_seqs, kv_block_size or 16, skip, kv_dtype),
        scope=plan_cut.scope_of(dtypes, shp, max_tokens, max_seqs, kv_block_size or 16))
    plan = _apply_forced(plan, forced, cands, native_ops, attention, kv_block_size, dtype,
                         max_tokens)
    # a deterministic step's kernels: derived from what runs here, not measured or cached
    plan.invariant_linear = determinism.invariant_linear(cands)
    plan.invariant_tiles = determinism.invariant_tiles(
        amx_possible(dtype, kv_block_size or 16), forced.get("attention_tiles", "auto"))
    return plan


def cached_or_measured(path: Path | None, key: str, machine: Mapping[str, object],
                       measure: Callable[[], KernelPlan],
                       meter: Callable[[], LoadMeter] = LoadMeter,
                       scope: Mapping[str, object] | None = None) -> KernelPlan:
    """The plan stored at ``path`` (None: keep nothing), or ``measure()``'s under a load
    meter. A stored plan is measured again only where :func:`tuning_guard.due` says so (a
    provisional one, the cores quieter now than then), and the new one replaces it where
    :func:`tuning_guard.better` says so; otherwise the stored one stays and counts the
    attempt. A provisional plan is used either way, with a warning naming the load.
    ``scope`` (:func:`plan_cut.scope_of`: the budget, rows, shapes it is for) is stored
    with the plan; where none is stored at ``path``, a plan cut from one cached beside it
    for a larger budget (:mod:`components.executor.plan_cut`) is stored and used instead of
    measuring."""
    plan = _cached_plan(path, key)
    if plan is not None and not tuning_guard.due(plan.guard or None, lambda: meter().probe()):
        _warn_if_provisional(plan)
        return plan
    with tuning.measuring(path) if path is not None else contextlib.nullcontext():
        again = _cached_plan(path, key)
        if again is not None and (plan is None or again.guard != plan.guard):
            _warn_if_provisional(again)
            return again                    # another executor measured meanwhile
        if plan is None and path is not None and scope is not None and \
                (got := plan_cut.find(path.parent, machine, scope)) is not None:
            got.key = key
            tuning.store(path, {"key": key, "machine": dict(machine), "scope": dict(scope),
                                **got.to_json()})
            log.info("kernel_plan_cut", key=key, cut_from=got.guard["cut_from"],
                     max_m=scope["max_m"])
            _warn_if_provisional(got)
            return got
        old = plan.guard if plan is not None and plan.guard else None
        t0 = time.perf_counter()
        with meter() as m:
            new = measure()
        new.key, new.seconds = key, round(time.perf_counter() - t0, 2)
        attempts = int(old.get("attempts", 1)) + 1 if old and not old.get("remeasure") else 1
        new.guard = {"load": round(m.load, 3), "cores": m.cores,
                     "window_s": round(m.window_s, 2), "attempts": attempts,
                     "provisional": tuning_guard.judge(m.load, new.anomalies, m.cores),
                     "measured_at": round(time.time(), 1)}
        if plan is not None and not tuning_guard.better(new.guard, old):
            plan.guard = {**plan.guard, "attempts": attempts}
            log.warning("kernel_plan_remeasure_kept_old", key=key, new_load=new.guard["load"],
                        old_load=plan.guard.get("load"), why=new.guard["provisional"])
            new = plan
        if path is not None:
            tuning.store(path, {"key": key, "machine": dict(machine),
                                **({"scope": dict(scope)} if scope is not None else {}),
                                **new.to_json()})
    _warn_if_provisional(new)
    return new


def _warn_if_provisional(plan: KernelPlan) -> None:
    why = plan.guard.get("provisional")
    if why:
        attempts = int(plan.guard.get("attempts", 1))
        log.warning("kernel_plan_provisional", key=plan.key, why=why,
                    load=plan.guard.get("load"), attempts=attempts,
                    next_start=("measures again if the cores are quieter"
                                if attempts < tuning_guard.MAX_ATTEMPTS else
                                "keeps it (weir plan --remeasure to measure again)"))


def _cached_plan(path: Path | None, key: str) -> KernelPlan | None:
    cached = tuning.load_cached(path) if path is not None else None
    return KernelPlan.from_json(cached, key) if cached is not None and \
        cached.get("key") == key else None


def _apply_forced(plan: KernelPlan, forced: Mapping[str, str],
                  cands: Mapping[str, Mapping[str, int]], native_ops: bool, attention: str,
                  kv_block_size: int | None, dtype: torch.dtype,
                  max_tokens: int) -> KernelPlan:
    if "linear" in forced:
        for role in cands:
            # SiLU x up in oneDNN's epilogue is gate_up's: forced, the other weights run
            # the same GEMM without it
            only = forced["linear"] if role == "gate_up" else \
                SILU_BASE.get(forced["linear"], forced["linear"])
            if only not in cands[role]:
                raise ValueError(f"engine.kernels.linear = {only!r} cannot run here "
                                 f"(the {role} weight can use: {', '.join(sorted(cands[role]))})")
            limit = cands[role][only]
            fill = "onednn" if "onednn" in cands[role] else "torch"
            plan.linear[role] = [(limit, only)] + ([(max_tokens, fill)]
                                                   if limit < max_tokens else [])
        if "lm_head" in plan.linear:
            plan.linear[GREEDY_HEAD] = list(plan.linear["lm_head"])
        plan.source = "forced"
    if "fresh_prompts" in forced:
        plan.fresh_prompts = forced["fresh_prompts"]
        plan.source = "forced"
    if "layer_loop" in forced:
        if forced["layer_loop"] not in ("native", "python"):
            raise ValueError(f"engine.kernels.layer_loop = {forced['layer_loop']!r}: "
                             f"'native' or 'python'")
        plan.layer_loop = forced["layer_loop"]
        plan.source = "forced"
    if "attention_tiles" in forced:
        if forced["attention_tiles"] == "amx" and not amx_possible(dtype, kv_block_size or 16):
            raise ValueError("engine.kernels.attention_tiles = 'amx' cannot run here: it needs "
                             "bfloat16, a kv.block_size that is a multiple of 16, and a CPU with "
                             "AMX-BF16 that the native kernels were built for")
        plan.attention_tiles = forced["attention_tiles"]
        plan.source = "forced"
    if "elementwise" in forced:
        plan.elementwise = _elementwise_forced(forced["elementwise"], native_ops,
                                               torch.device("cpu"))   # a CPU plan
        plan.source = "forced"
    if "sampling" in forced:
        if forced["sampling"] not in ("native", "torch"):
            raise ValueError(f"engine.kernels.sampling = {forced['sampling']!r}: 'native' or "
                             f"'torch'")
        if forced["sampling"] == "native" and not native_ops:
            raise ValueError("engine.kernels.sampling = 'native' cannot run here: the native "
                             "CPU kernels did not build, or the dtype/shape is not compiled in")
        plan.sampling = forced["sampling"]
        plan.source = "forced"
    if attention != "auto":
        get_backend(attention, "cpu", block_size=kv_block_size, dtype=dtype)   # or refuse
        plan.attention = attention
    return plan


def _elementwise_forced(choice: str, native_ops: bool, device: torch.device) -> str:
    """A forced ``engine.kernels.elementwise``, or a clear error where it cannot run. Triton
    runs on a GPU, and on the CPU only under ``TRITON_INTERPRET=1`` (the tests' way)."""
    if choice not in ("native", "triton", "torch"):
        raise ValueError(f"engine.kernels.elementwise = {choice!r}: 'native', 'triton' or "
                         f"'torch'")
    if choice == "native" and not native_ops:
        raise ValueError("engine.kernels.elementwise = 'native' cannot run here: the native "
                         "CPU kernels did not build, or the dtype/shape/device is not "
                         "compiled in")
    if choice == "triton" and not triton_available():
        raise ValueError("engine.kernels.elementwise = 'triton' cannot run here: triton is "
                         "not installed")
    if choice == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("engine.kernels.elementwise = 'triton' runs on a GPU, not the CPU "
                         "(there: 'native' or 'torch')")
    return choice


