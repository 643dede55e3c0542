"""A linear layer's kernels and the layer that runs them by its kernel plan.

The candidates (:mod:`kernels.tuning` describes them): how each lays a weight out
(``PREPARE``) and runs a step on it (``RUN``), and :class:`Linear`, one weight run by the
candidate its plan picks for each step's token count. The planner
(:mod:`components.executor.autotune`) times these; the model
(:mod:`components.executor.model`) runs them; neither imports the other.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from components.executor.sampling import greedy
from kernels import cpu_linear, cpu_native, tuning

if TYPE_CHECKING:
    from components.executor.elementwise import ElementwiseOps

log = logging.getLogger(__name__)

PACK_HINT = 64          # the batch size oneDNN lays packed weights out for (any M works)

# oneDNN builds (JIT) a primitive per input shape, the first time it sees one: ~1.5 ms for
# each weight shape on 2 Zen 4 cores, and it keeps it, ~0.3-0.5 MB each, in two LRU caches
# (oneDNN's own and ideep's) of 1024 entries by default. Served, every step's token count M
# is a new shape until seen: 600 prompts of distinct lengths (257-856 tokens, bf16) grew an
# executor by 763 MB, still growing, and once more shapes are in use than the caches hold
# every step pays the build again. So M runs as itself only up to EXACT_ROWS (decode
# batches, where padding rows costs compute on CPUs without AMX tiles) and above it as the
# next multiple of 32 (64 above 1024): at most 296 shapes per weight, which the caches keep.
# The same 600 prompts then: +350 MB, flat after the first 100, in 282 s against 302.
EXACT_ROWS = 256
CACHE_ENTRIES = "2048"
for _var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_var, CACHE_ENTRIES)     # read by oneDNN and ideep on first use


def onednn_rows(m: int) -> int:
    """The rows oneDNN runs a step of ``m`` tokens as (zero rows padding the rest)."""
    if m <= EXACT_ROWS:
        return m
    step = 32 if m <= 1024 else 64
    return -(-m // step) * step


def onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT)


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
    m = x.shape[0]
    rows = onednn_rows(m)
    x = x.contiguous() if rows == m else F.pad(x, (0, 0, 0, rows - m))
    y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return y if rows == m else y[:m]


_PACKS: dict[torch.dtype, bool] = {}


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs for ``dtype`` on this CPU: tried once on a tiny
    weight, since the ops exist in every build but refuse at run time where the CPU lacks
    what the dtype needs (bf16 without AVX-512 or AVX-NE-CONVERT, as on AVX2-only CPUs)."""
    if dtype not in _PACKS:
        ok = (torch.backends.mkldnn.is_available()
              and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
              and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
        if ok:
            try:
                w = torch.ones(16, 32, dtype=dtype)
                y = onednn_linear(torch.ones(2, 32, dtype=dtype), onednn_pack(w))
                ok = bool(torch.equal(y, torch.full((2, 16), 32.0, dtype=dtype)))
            except RuntimeError as err:
                log.info("oneDNN packed linear unavailable for %s here: %s", dtype, err)
                ok = False
        _PACKS[dtype] = ok
    return _PACKS[dtype]


def native_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
    return cpu_linear.small_batch_linear(x, w, b)


def amx_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
    return cpu_linear.small_batch_linear(x, w, b, tiles="amx")


def amx_linear_f32(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
    """``amx_linear(x, w, b).float()`` in one pass (the lm_head's float32 logits)."""
    return cpu_linear.small_batch_linear(x, w, b, tiles="amx", out_dtype=torch.float32)


def upcast(run):
    """``run`` (an fp32 linear: torch's, or oneDNN's on a packed fp32 weight) for a
    low-precision step: fp32 math, the step's dtype out."""
    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
        return run(x.float(), w, None if b is None else b.float()).to(x.dtype)
    return linear


# SiLU x up in the GEMM's epilogue (the ``onednn_silu`` candidate, gate_up only): the fused
# [gate; up] weight packed as two oneDNN weights; the gate's GEMM applies swish (x sigmoid(x))
# to its float32 accumulators, the up GEMM multiplies its accumulators by that, so the
# [M, 2 x inter] intermediate is never written and there is no second pass over it. Its
# rounding differs from the linear then SiLU x up (gate and up are not rounded to the
# model's dtype first): by an ulp of the output, and only where the plan measured it faster.
# On the 2-core AMX Xeon: 3.36 ms a layer at 2,048 rows against 3.82 for the gate_up GEMM and
# the native SiLU x up pass.
def split_pack(pack):
    """A [gate; up] weight (``[2 x inter, k]``) packed by ``pack`` as two weights."""
    def prepare(w: torch.Tensor):
        inter = w.shape[0] // 2
        return pack(w[:inter].contiguous()), pack(w[inter:].contiguous())
    return prepare


def _halves(b: torch.Tensor | None):
    if b is None:
        return None, None
    inter = b.shape[0] // 2
    return b[:inter].contiguous(), b[inter:].contiguous()


def onednn_silu_mul(x: torch.Tensor, w: tuple, b: torch.Tensor | None = None):
    """``silu(x @ gate^T) * (x @ up^T)`` by two oneDNN GEMMs with post-ops (``w``: the
    halves from :func:`split_pack`), the SiLU x up of the gate_up projection in one pass."""
    m = x.shape[0]
    rows = onednn_rows(m)
    x = x.contiguous() if rows == m else F.pad(x, (0, 0, 0, rows - m))
    bg, bu = _halves(b)
    gate = torch.ops.mkldnn._linear_pointwise(x, w[0], bg, "swish", [], "")
    y = torch.ops.mkldnn._linear_pointwise.binary(x, gate, w[1], bu, "mul")
    return y if rows == m else y[:m]


def onednn_halves(x: torch.Tensor, w: tuple, b: torch.Tensor | None = None):
    """The plain gate_up projection on :func:`split_pack`'s halves (``Linear.__call__``;
    the model calls :meth:`Linear.silu_mul`, which fuses)."""
    bg, bu = _halves(b)
    return torch.cat([onednn_linear(x, w[0], bg), onednn_linear(x, w[1], bu)], dim=-1)


# The unfused gate_up writes an [M, 2 x inter] intermediate for the SiLU x up pass. glibc
# serves an allocation above its mmap threshold (which adapts, but never past 32 MiB on
# 64-bit) by a fresh mmap, so every layer faulted in and zeroed that many new pages: at
# 8,192 rows of SmolLM2 (48 MiB) the step's MLPs took ~600 ms more than SiLU x up in the
# GEMMs' epilogue, whose largest output is half that (perf log, 2026-12-06). So above
# SILU_BLOCK_BYTES the GEMM and the pass run a block of rows at a time (the largest power
# of two of rows within it; 2,048 for SmolLM2 in bf16), each block's intermediate reused
# from the heap. Below it (every step of the default 2,048-token budget) nothing changes.
SILU_BLOCK_BYTES = 16 << 20


def silu_block_rows(n: int, elem: int) -> int:
    """Rows of an ``[rows, n]`` gate_up intermediate of ``elem``-byte elements within
    ``SILU_BLOCK_BYTES``: the largest power of two, at least 64."""
    rows = 64
    while rows * 2 * n * elem <= SILU_BLOCK_BYTES:
        rows *= 2
    return rows


# the SiLU x up candidates (gate_up's only): each one's fused run; RUN has their plain one
SILU_FUSED = {"onednn_silu": onednn_silu_mul, "fp32_onednn_silu": upcast(onednn_silu_mul)}

# how each candidate lays its weights out, and runs them ("amx" runs "native"'s layout:
# tuning.SHARED_LAYOUT)
PREPARE = {"torch": lambda w: w, "onednn": onednn_pack, "native": cpu_linear.pack_small_batch,
           "amx": cpu_linear.pack_small_batch,
           "fp32": lambda w: w.float(), "fp32_onednn": lambda w: onednn_pack(w.float()),
           "onednn_silu": split_pack(onednn_pack),
           "fp32_onednn_silu": split_pack(lambda w: onednn_pack(w.float()))}
RUN = {"torch": F.linear, "onednn": onednn_linear, "native": native_linear, "amx": amx_linear,
       "fp32": upcast(F.linear), "fp32_onednn": upcast(onednn_linear),
       "onednn_silu": onednn_halves, "fp32_onednn_silu": upcast(onednn_halves)}


# the lm_head of a step whose rows are all greedy (LlamaModel.forward(greedy=True)): its own
# dispatch table, timed as the tokens (the AMX kernel's argmax in its pass, the others'
# logits then the argmax). On the 2-core AMX Xeon the fused pass took 7.4 ms at 256 rows
# against 25.3 for oneDNN's logits and the argmax (4.7 against 8.5 at 128).
GREEDY_HEAD = "lm_head.greedy"


class StepMode:
    """Whether the step running now is deterministic: one object the model and its linear
    layers share, set by the model for the length of a forward (a step runs on one thread)."""

    __slots__ = ("invariant",)

    def __init__(self) -> None:
        self.invariant = False


class Linear:
    """One weight, run by the kernel its plan picks for each step's token count M: the
    table ``[(up_to_m, candidate)]`` and the weight in each chosen candidate's layout only
    (kernels/tuning.py). ``runs`` maps a candidate to its function; it is the model's, so a
    profiler can wrap one candidate for every weight. ``invariant``: the one candidate a
    deterministic step runs for every M (components/executor/determinism.py; its layout is
    kept too, a copy of the weight where the table has none of it), while ``mode`` says
    the step is one."""

    __slots__ = ("table", "greedy_table", "runs", "bias", "shape", "invariant", "mode")

    def __init__(self, w: torch.Tensor, table: list[tuple[int, str]],
                 runs: dict, bias: torch.Tensor | None = None,
                 greedy_table: list[tuple[int, str]] | None = None,
                 invariant: str | None = None, mode: StepMode | None = None) -> None:
        self.shape = tuple(w.shape)
        layouts: dict[str, object] = {}            # one copy per layout (amx runs native's)
        extra = [invariant] if invariant is not None else []
        for c in {c for _, c in table + (greedy_table or [])} | set(extra):
            if tuning.layout_of(c) not in layouts:
                layouts[tuning.layout_of(c)] = PREPARE[c](w)
        self.table = [(m, c, layouts[tuning.layout_of(c)]) for m, c in table]
        # the lm_head's table for greedy rows (GREEDY_HEAD; None: the table's)
        self.greedy_table = None if greedy_table is None else \
            [(m, c, layouts[tuning.layout_of(c)]) for m, c in greedy_table]
        self.invariant = None if invariant is None else \
            (invariant, layouts[tuning.layout_of(invariant)])
        self.mode = mode
        self.runs, self.bias = runs, bias

    def pick(self, m: int, greedy: bool = False) -> tuple[str, object]:
        """The candidate the plan runs ``m`` rows with, and the weight in its layout
        (``greedy``: for :meth:`argmax`, from the greedy table where there is one); in a
        deterministic step the invariant candidate, whatever ``m``."""
        if self.invariant is not None and self.mode is not None and self.mode.invariant:
            return self.invariant
        table = self.greedy_table if greedy and self.greedy_table else self.table
        for up_to, cand, w in table:
            if m <= up_to:
                return cand, w
        _, cand, w = table[-1]
        return cand, w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        cand, w = self.pick(x.shape[0])
        return self.runs[cand](x, w, self.bias)

    def float32(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()``: on the AMX tiles in one pass (``runs["amx+f32"]``: each
        output rounded to the model's dtype, then widened; the same bits), else the linear
        then the cast."""
        cand, w = self.pick(x.shape[0])
        if cand == "amx":
            return self.runs["amx+f32"](x, w, self.bias)
        return self.runs[cand](x, w, self.bias).float()

    def argmax(self, x: torch.Tensor, native: bool) -> torch.Tensor:
        """Each row's greedy token, [M] long: the first maximum of its float32 logits, by
        the greedy table's candidate (the plan's own timing of this use): on the AMX tiles
        without the logits (``runs["amx+argmax"]``), else the logits then the argmax (the
        native one where ``native``)."""
        cand, w = self.pick(x.shape[0], greedy=True)
        if cand == "amx":
            return self.runs["amx+argmax"](x, w, self.bias)
        return greedy(self.runs[cand](x, w, self.bias).float(), native)

    def silu_mul(self, x: torch.Tensor, ops: ElementwiseOps) -> torch.Tensor:
        """``ops.silu_mul(self(x))`` for a fused gate_up weight: in one pass where the
        plan runs these rows on the AMX tiles (``runs["amx+silu"]``, the same bits without
        the [M, 2 x inter] intermediate) or on oneDNN with SiLU x up in its epilogue
        (``runs["onednn_silu+silu"]``: within an ulp, not the same bits), else the linear
        then the elementwise op."""
        cand, w = self.pick(x.shape[0])
        if cand == "amx" and self.bias is None and ops.fused is cpu_native:
            return self.runs["amx+silu"](x, w)
        if cand in SILU_FUSED:              # SiLU x up in the GEMM's epilogue
            return self.runs[cand + "+silu"](x, w, self.bias)
        m, rows = x.shape[0], silu_block_rows(self.shape[0], x.element_size())
        if m > rows and ops.fused is cpu_native:
            # the [M, 2 x inter] intermediate a block of rows at a time (SILU_BLOCK_BYTES)
            out = x.new_empty(m, self.shape[0] // 2)
            for i in range(0, m, rows):
                cpu_native.silu_mul(self.runs[cand](x[i:i + rows], w, self.bias),
                                    out[i:i + rows])
            return out
        return ops.silu_mul(self.runs[cand](x, w, self.bias))
