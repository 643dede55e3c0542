"""The deterministic (batch-invariant) kernel plan: what a deterministic step runs, and
the stable id a response carries to say what its bits were pinned to.

A step with ``StepPlan.deterministic`` runs every row through kernels whose reduction order
for that row depends on the row alone: not on the step's token count M, the row's place in
the batch, its neighbours, how its prompt was chunked, or the thread count. So its KV and
logits are the same alone, in a batch of 256, in a chunk of 37 or one token at a time
(which also makes recompute after preemption, prefix-cache hits and verified drafts give
the same bits). design/executor.md, "Deterministic steps", says why each kernel is.

- **Linear layers** (the lm_head too): one kernel for every M, partitioned over the
  outputs N only: the AMX tiles where they run (:func:`invariant_linear`), else the native
  vector kernel (any M, though the measured plan stops it at 256 rows). oneDNN and torch's
  GEMMs never: their blocking (and, for oneDNN, the kernel) changes with M.
- **Attention**: the cpu backend's paged kernel without its prompt kernels (the flash runs
  and SDPA for fresh prompts), so a 1-row decode and a 500-row chunk take the same kernel;
  each row over its own keys in position order, no split of the keys over threads.
- **RMSNorm, RoPE, SiLU, argmax, logprobs, the draw**: the native per-row kernels
  (threads split rows, never a row's reduction).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import torch

from kernels import native_lib
from kernels.tuning import KernelPlan

VERSION = 1             # bump when a kernel of the deterministic plan changes its order
ROLES = ("qkv", "o", "gate_up", "down", "lm_head")
# the invariant linear kernels, best first: each runs any M at a row order fixed by K
INVARIANT_LINEAR = ("amx", "native")


def invariant_linear(cands: Mapping[str, Mapping[str, int]]) -> dict[str, str]:
    """Each role's deterministic kernel among the candidates that run here (role ->
    {candidate: largest M}): the first of ``INVARIANT_LINEAR`` it has; a role with none is
    left out (the plan is then not invariant: :func:`is_invariant`)."""
    out = {}
    for role, c in cands.items():
        for cand in INVARIANT_LINEAR:
            if cand in c:
                out[role] = cand
                break
    return out


def invariant_tiles(amx: bool, forced: str = "auto") -> str:
    """The paged attention's tiles in a deterministic step: the AMX tiles where they can
    run (``amx``: :func:`components.executor.candidates.amx_possible`), one row to a tile (a
    multi-row AMX tile does P.V on the tile unit, a one-row tile by vdpbf16ps, so a row's
    bits would depend on its tile); else the vector tiles (8 rows of a sequence share each
    key read, each row's scores, softmax and P.V its own). ``forced``: the engine's
    ``kernels.attention_tiles`` where it names one. Chosen from what the machine can run,
    not from the plan's timings: a plan measured again (a provisional one, at a quieter
    start) may time the tiles the other way, and a restart would then give other bits
    under another pin. On the 2-core AMX Xeon the one-row AMX tiles beat the vector tiles
    at every shape timed, prompts included (scripts/bench/deterministic.py,
    docs/perf-log.md)."""
    if forced in ("amx", "vector"):
        return forced
    return "amx" if amx else "vector"


def is_invariant(plan: KernelPlan, device: torch.device | str = "cpu") -> bool:
    """Whether a deterministic step's bits are batch-invariant under ``plan``: the CPU, the
    cpu attention backend, native elementwise ops and sampling, and an invariant kernel for
    every linear role. Elsewhere (a GPU's GEMMs, the torch reference) the mode runs, but
    only as reproducible as those kernels are."""
    return (torch.device(device).type == "cpu" and plan.attention == "cpu"
            and plan.elementwise == "native" and plan.sampling == "native"
            and all(r in plan.invariant_linear for r in ROLES))


def plan_kernels(plan: KernelPlan, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> dict[str, str]:
    """What a deterministic step runs, by name: the kernels and what they were built from."""
    build = native_lib.build_key() if native_lib.available() else "none"
    return {**{f"linear.{r}": plan.invariant_linear.get(r, "none") for r in ROLES},
            "attention": plan.attention, "attention_tiles": plan.invariant_tiles,
            "elementwise": plan.elementwise, "sampling": plan.sampling,
            "dtype": str(dtype).removeprefix("torch."),
            "kv_dtype": str(kv_dtype or dtype).removeprefix("torch."),
            "device": torch.device(device).type, "native_build": build,
            "torch": torch.__version__, "version": str(VERSION)}


def plan_id(plan: KernelPlan, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
            device: torch.device | str = "cpu") -> str:
    """The deterministic plan's stable id: ``det<VERSION>-<16 hex>`` over its kernels, the
    native library's build key (its sources, compiler, flags and the CPU's ISA flags), the
    dtypes and torch's version; ``-x`` appended where the plan is not batch-invariant here
    (:func:`is_invariant`). Equal ids on two engines mean the same kernels from the same
    build on the same ISA: a deterministic request gives the same bits on both. A different
    machine or build gives another id, and may give other bits."""
    kernels = plan_kernels(plan, dtype, kv_dtype, device)
    digest = hashlib.sha256(json.dumps(kernels, sort_keys=True).encode()).hexdigest()[:16]
    return f"det{VERSION}-{digest}" + ("" if is_invariant(plan, device) else "-x")
