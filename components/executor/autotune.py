"""The executor's kernel plan: measured on this machine at the model's shapes, or cached,
or forced by the config (see :mod:`kernels.tuning` for the candidates and the rules).

Measuring takes a few seconds on 2 cores (the SmolLM2 shapes, bf16) and happens once per
machine: the plan is cached under ``<cache>/tuning/<key>.json``. Timings use weights of
the model's shapes (random values: a GEMM's time does not depend on them), so no layout
of the real weights is made for a candidate that is not chosen.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels import (AttentionMetadata, KVCache, cpu_linear, cpu_native, get_backend, native_lib,
                     tuning)
from kernels.kv_cache import quantize
from kernels.tuning import KernelPlan

if TYPE_CHECKING:
    from schemas.model import ModelSpec

log = logging.getLogger(__name__)

ROLES = ("qkv", "o", "gate_up", "down", "lm_head")

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


# how each candidate lays its weights out, and runs them ("amx" runs "native"'s layout:
# tuning.SHARED_LAYOUT)
PREPARE = {"torch": lambda w: w, "onednn": onednn_pack, "native": cpu_linear.pack_small_batch,
           "amx": cpu_linear.pack_small_batch,
           "fp32": lambda w: w.float(), "fp32_onednn": lambda w: onednn_pack(w.float())}
RUN = {"torch": F.linear, "onednn": onednn_linear, "native": native_linear, "amx": amx_linear,
       "fp32": upcast(F.linear), "fp32_onednn": upcast(onednn_linear)}


# the lm_head of a step whose rows are all greedy (LlamaModel.forward(greedy=True)): its own
# dispatch table, timed as the tokens (the AMX kernel's argmax in its pass, the others'
# logits then the argmax). On the 2-core AMX Xeon the fused pass took 7.4 ms at 256 rows
# against 25.3 for oneDNN's logits and the argmax (4.7 against 8.5 at 128).
GREEDY_HEAD = "lm_head.greedy"


def run_as_used(role: str, cand: str, native_ops: bool = False):
    """``cand``'s linear as the model calls it for ``role``, so that what follows it is in
    its time: the lm_head's logits are float32 (``Linear.float32``: one pass on the AMX
    tiles, else the linear then the cast); with the native elementwise ops, gate_up is
    followed by SiLU x up (``Linear.silu_mul``: fused into the AMX kernel's pass, else the
    native op over the [M, 2 x inter] intermediate). Timed as the GEMM alone, gate_up went
    to oneDNN above 64 rows on the AMX Xeon, where with the SiLU pass the fused kernel is
    faster at 128-512 rows (a 512-token prefill step: 110 -> 93 ms) and slower at 2048."""
    run = RUN[cand]
    if role == GREEDY_HEAD:
        if cand == "amx":
            return lambda x, w, b=None: cpu_linear.amx_argmax_linear(x, w, b)
        from components.executor.sampling import greedy
        return lambda x, w, b=None: greedy(run(x, w, b).float(), native_ops)
    if role == "lm_head":
        return amx_linear_f32 if cand == "amx" else \
            lambda x, w, b=None: run(x, w, b).float()
    if role == "gate_up" and native_ops:
        return (lambda x, w, b=None: cpu_linear.amx_silu_mul_linear(x, w)) if cand == "amx" \
            else lambda x, w, b=None: cpu_native.silu_mul(run(x, w, b))
    return run


def shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Each linear weight's [out, in]."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * spec.intermediate_size, h),
            "down": (h, spec.intermediate_size), "lm_head": (spec.vocab_size, h)}


def linear_candidates(dtype: torch.dtype, device: torch.device,
                      shape: tuple[int, int]) -> dict[str, int]:
    """The candidates that can run a weight of ``shape`` here: name -> largest M."""
    if device.type != "cpu":
        return {"torch": 1 << 30}
    out = {"torch": 1 << 30}
    if can_pack(dtype):
        out["onednn"] = 1 << 30
    if dtype in (torch.bfloat16, torch.float16):
        out["fp32"] = 1 << 30
        if can_pack(torch.float32):
            out["fp32_onednn"] = 1 << 30
    n, k = shape
    if (cpu_linear.small_batch_fits(dtype, n, k) and native_lib.available()
            and cpu_linear.small_batch_supported(dtype)):
        out["native"] = cpu_linear.SMALL_BATCH_MAX
    if cpu_linear.amx_linear_fits(dtype, n, k):       # (it checks the library builds)
        out["amx"] = 1 << 30                # one pass over the weights for any M
    return out


def amx_possible(dtype: torch.dtype, block_size: int) -> bool:
    """Whether the cpu backend's AMX paged kernel can run: bf16, blocks of a multiple of 16
    keys, and a native build with AMX that this process may use."""
    return dtype == torch.bfloat16 and block_size % 16 == 0 and native_lib.amx_supported()


def native_ops_possible(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and spec.head_dim <= 256 and native_lib.available())


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
    cands = {role: linear_candidates(dtype, device, s) for role, s in shp.items()}
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
    native_ops = native_ops_possible(spec, dtype, device)
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
    plan = _cached_plan(path, key)
    if plan is None:
        with tuning.measuring(path) if path is not None else contextlib.nullcontext():
            plan = _cached_plan(path, key)         # another executor measured meanwhile
            if plan is None:
                t0 = time.perf_counter()
                plan = _measure(spec, dtype, shp, cands, native_ops, max_tokens, max_seqs,
                                kv_block_size or 16, skip, kv_dtype)
                plan.key, plan.seconds = key, round(time.perf_counter() - t0, 2)
                if path is not None:
                    tuning.store(path, {"key": key, "machine": machine, **plan.to_json()})
    return _apply_forced(plan, forced, cands, native_ops, attention, kv_block_size, dtype,
                         max_tokens)


def _cached_plan(path: Path | None, key: str) -> KernelPlan | None:
    cached = tuning.load_cached(path) if path is not None else None
    return KernelPlan.from_json(cached, key) if cached is not None and \
        cached.get("key") == key else None


def _apply_forced(plan: KernelPlan, forced: Mapping[str, str],
                  cands: Mapping[str, Mapping[str, int]], native_ops: bool, attention: str,
                  kv_block_size: int | None, dtype: torch.dtype,
                  max_tokens: int) -> KernelPlan:
    if "linear" in forced:
        only = forced["linear"]
        for role in cands:
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


def triton_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


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


def _measure(spec: ModelSpec, dtype: torch.dtype, shp: Mapping[str, tuple[int, int]],
             cands: Mapping[str, Mapping[str, int]], native_ops: bool, max_tokens: int,
             max_seqs: int, block_size: int, skip: set[str] = frozenset(),
             kv_dtype: torch.dtype | None = None) -> KernelPlan:
    """Time what is not in ``skip`` (the forced ops: "linear", "elementwise", "sampling",
    "attention"); a skipped op keeps KernelPlan's default, which :func:`_apply_forced`
    then replaces with the forced choice."""
    g = torch.Generator().manual_seed(0)
    kv_dtype = kv_dtype or dtype
    plan = KernelPlan(source="measured", layer_loop="native" if native_ops else "python")
    buckets = [b for b in tuning.M_BUCKETS if b < max_tokens] + [max_tokens]
    roles = {**shp, **({GREEDY_HEAD: shp["lm_head"]} if "lm_head" in shp else {})}
    for role, (n, k) in roles.items():
        if "linear" in skip:
            break
        head = role in ("lm_head", GREEDY_HEAD)      # its rows: the sampled ones, <= max_seqs
        w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
        use = [b for b in buckets if b <= max(max_seqs, 1)] if head else buckets
        if head and use[-1] < max_seqs:
            use.append(max_seqs)
        runs = {c: (run_as_used(role, c, native_ops), tuning.copies_for(w, PREPARE[c]), limit)
                for c, limit in cands["lm_head" if head else role].items()}
        timings = tuning.time_linear(runs, k, dtype, use)
        plan.linear[role] = tuning.choose_linear(timings)
        plan.timings[f"linear.{role}"] = {c: {str(m): round(s * 1e6, 1) for m, s in t.items()}
                                          for c, t in timings.items()}
        del runs, w
    timers = {"elementwise": lambda: _time_elementwise(spec, dtype, g),
              "sampling": lambda: _time_sampling(spec.vocab_size, max_seqs, g),
              "attention": lambda: _time_attention(spec, dtype, block_size, g, kv_dtype)}
    for op, timer in timers.items():
        if op in skip or (op != "attention" and not native_ops):
            continue                      # without native ops, torch is all there is
        t = timer()
        setattr(plan, op, tuning.choose_fastest(t))
        plan.timings[op] = {c: round(s * 1e6, 1) for c, s in t.items()}
    if "attention_tiles" not in skip and plan.attention == "cpu" \
            and amx_possible(dtype, block_size):
        t = _time_attention_tiles(spec, dtype, block_size, g, kv_dtype)
        plan.attention_tiles = tuning.choose_fastest(t)
        plan.timings["attention_tiles"] = {c: round(s * 1e6, 1) for c, s in t.items()}
    if "fresh_prompts" not in skip and plan.attention == "cpu" and kv_dtype == dtype:
        t = _time_fresh_prompts(spec, dtype, block_size, g, plan.attention_tiles)
        plan.fresh_prompts = tuning.choose_fastest(t)
        plan.timings["fresh_prompts"] = {c: round(s * 1e6, 1) for c, s in t.items()}
    return plan


def _time_attention_tiles(spec: ModelSpec, dtype: torch.dtype, block_size: int,
                          g: torch.Generator, kv_dtype: torch.dtype | None = None) -> dict:
    """The cpu backend's paged kernel, vector against AMX, on one layer: 64 sequences
    decoding at 160 keys of context (over 30 layers' worth of cache, so the keys come from
    memory, as in a step), a 128-token chunk after 32 cached tokens, and 8 fresh 128-token
    prompts."""
    kvh, d, layers = spec.num_kv_heads, spec.head_dim, 30
    seqs, ctx = 64, 160
    per = -(-(ctx + 1) // block_size)
    kv = KVCache.allocate(layers, seqs * per, block_size, kvh, d, kv_dtype or dtype, "cpu")
    kv.data[0].copy_(quantize(torch.randn(kv.data.shape[1:], generator=g), kv.dtype))
    kv.data[1:].copy_(kv.data[0].expand_as(kv.data[1:]))     # the time is not the values'
    tables = [list(range(i * per, (i + 1) * per)) for i in range(seqs)]
    steps = [(AttentionMetadata.build([1] * seqs, [ctx] * seqs, tables, block_size), layers),
             (AttentionMetadata.build([128], [32], tables[:1], block_size), 1),
             (AttentionMetadata.build([128] * 8, [0] * 8, tables[:8], block_size), 1)]
    qs = [torch.randn(meta.num_tokens, spec.num_heads, d, generator=g).to(dtype)
          for meta, _ in steps]

    def run(tiles: str):
        backend = get_backend("cpu", "cpu", block_size=block_size, dtype=dtype)
        backend.tiles = tiles

        def call():
            for (meta, n), q in zip(steps, qs):
                for i in range(n):
                    backend.paged_attention(q, kv.key(i), kv.value(i), meta, d ** -0.5)
        return call
    return tuning.time_interleaved({tiles: run(tiles) for tiles in ("vector", "amx")})


def _time_fresh_prompts(spec: ModelSpec, dtype: torch.dtype, block_size: int,
                        g: torch.Generator, tiles: str = "vector") -> dict:
    """One layer's attention over fresh prompts (no cached context): 8 x 128 and 1 x 512
    tokens, through the cpu backend's paged kernel (its ``tiles``) and through SDPA on the
    new keys."""
    out = {}
    backend = get_backend("cpu", "cpu", block_size=block_size, dtype=dtype)
    backend.tiles = tiles
    kvh, d = spec.num_kv_heads, spec.head_dim
    steps = []
    for n, length in ((8, 128), (1, 512)):
        per = -(-length // block_size)
        tables = [list(range(i * per, (i + 1) * per)) for i in range(n)]
        meta = AttentionMetadata.build([length] * n, [0] * n, tables, block_size)
        kv = KVCache.allocate(1, n * per, block_size, kvh, d, dtype, "cpu")
        k = torch.randn(n * length, kvh, d, generator=g).to(dtype)
        v = torch.randn(n * length, kvh, d, generator=g).to(dtype)
        backend.write_kv(kv.key(0), kv.value(0), k, v, meta)
        q = torch.randn(n * length, spec.num_heads, d, generator=g).to(dtype)
        steps.append((meta, kv, q, k, v))
    for impl in ("native", "sdpa"):
        backend.fresh_prompts = impl
        total = 0.0
        for meta, kv, q, k, v in steps:
            meta.derived.clear()
            total += tuning.time_call(lambda: backend.paged_attention(
                q, kv.key(0), kv.value(0), meta, d ** -0.5, new_kv=(k, v)))
        out[impl] = total
    return out


def _time_elementwise(spec: ModelSpec, dtype: torch.dtype, g: torch.Generator) -> dict:
    """One layer's add+RMSNorm (twice), RoPE and SiLU x up, at 1, 64 and 512 tokens."""
    from components.executor import model as model_mod
    h, d = spec.hidden_size, spec.head_dim
    width = (spec.num_heads + 2 * spec.num_kv_heads) * d
    out = {}
    for impl in ("native", "torch"):
        m = model_mod.ElementwiseOps(spec, dtype, torch.device("cpu"),
                                     cpu_native if impl == "native" else None)
        total = 0.0
        for t in (1, 64, 512):
            hid = torch.randn(t, h, generator=g).to(dtype)
            delta = torch.randn(t, h, generator=g).to(dtype)
            w = torch.ones(h, dtype=dtype)
            qkv = torch.randn(t, width, generator=g).to(dtype)
            gu = torch.randn(t, 2 * spec.intermediate_size, generator=g).to(dtype)
            pos = torch.arange(t) % spec.max_position
            rope = m.rope_tables(pos)

            def layer():
                m.add_norm(hid.clone(), delta, w)
                m.split_qkv(qkv.clone(), pos, rope)
                m.silu_mul(gu)
                m.add_norm(hid.clone(), delta, w)
            total += tuning.time_call(layer)
        out[impl] = total
    return out


def _time_sampling(vocab: int, rows: int, g: torch.Generator) -> dict:
    """The executor's sampler over float32 logits: greedy rows (argmax) and rows at
    temperature 0.8 with top-p 0.9, 1 and up to 64 rows of each. The logits are randn × 4:
    a language model's are peaked (SmolLM2's have a std of ~3.9 and a nucleus of 1-80
    tokens at T 0.8, p 0.9), and plain randn is flat (a ~25k-token nucleus), which would
    let the rare flat row decide the choice."""
    from components.executor.sampling import sample
    out = {}
    for impl in ("native", "torch"):
        total = 0.0
        for r in sorted({1, min(64, rows)}):
            x = torch.randn(r, vocab, generator=g) * 4
            for temp, top_p in ((0.0, 1.0), (0.8, 0.9)):
                args = ([temp] * r, [top_p] * r, [0] * r, list(range(r)), [0] * r)
                total += tuning.time_call(lambda: sample(x, *args, native=impl == "native"))
        out[impl] = total
    return out


def _time_attention(spec: ModelSpec, dtype: torch.dtype, block_size: int,
                    g: torch.Generator, kv_dtype: torch.dtype | None = None) -> dict:
    """One layer's attention: 16 sequences decoding at 256 tokens of context, and one
    256-token prompt."""
    seqs, ctx = 16, 256
    per = -(-(ctx + 1) // block_size)
    kv = KVCache.allocate(1, seqs * per + per, block_size, spec.num_kv_heads, spec.head_dim,
                          kv_dtype or dtype, "cpu")
    kv.data.copy_(quantize(torch.randn(kv.data.shape, generator=g), kv.dtype))
    tables = [list(range(i * per, (i + 1) * per)) for i in range(seqs + 1)]
    steps = [AttentionMetadata.build([1] * seqs, [ctx] * seqs, tables[:seqs], block_size),
             AttentionMetadata.build([ctx], [0], tables[seqs:], block_size)]
    out = {}
    for name in ("cpu", "torch"):
        try:
            backend = get_backend(name, "cpu", block_size=block_size, dtype=dtype)
        except ValueError:
            continue
        total = 0.0
        for meta in steps:
            q = torch.randn(meta.num_tokens, spec.num_heads, spec.head_dim,
                            generator=g).to(dtype)
            total += tuning.time_call(lambda: backend.paged_attention(
                q, kv.key(0), kv.value(0), meta, spec.head_dim ** -0.5))
        out[name] = total
    return out
