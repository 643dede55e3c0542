"""The kernel plan's measurements: every candidate timed on this machine at the model's
shapes, as the model runs it (:func:`run_as_used`), and the fastest kept
(:func:`measure_plan`; the rules are :mod:`kernels.tuning`'s). Timings use weights of the
model's shapes (random values: a GEMM's time does not depend on them)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from components.executor.candidates import amx_possible
from components.executor.elementwise import ElementwiseOps
from components.executor.linear import GREEDY_HEAD, PREPARE, RUN, SILU_FUSED, amx_linear_f32
from components.executor.plan_cut import linear_buckets
from components.executor.sampling import greedy, sample
from kernels import AttentionMetadata, KVCache, cpu_linear, cpu_native, get_backend, tuning
from kernels.kv_cache import quantize
from kernels.tuning import KernelPlan

if TYPE_CHECKING:
    from schemas.model import ModelSpec


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
        return lambda x, w, b=None: greedy(run(x, w, b).float(), native_ops)
    if role == "lm_head":
        return amx_linear_f32 if cand == "amx" else \
            lambda x, w, b=None: run(x, w, b).float()
    if cand in SILU_FUSED:            # gate_up with SiLU x up in the GEMM's epilogue
        return SILU_FUSED[cand]
    if role == "gate_up" and native_ops:
        return (lambda x, w, b=None: cpu_linear.amx_silu_mul_linear(x, w)) if cand == "amx" \
            else lambda x, w, b=None: cpu_native.silu_mul(run(x, w, b))
    return run


def measure_plan(spec: ModelSpec, dtype: torch.dtype, shp: Mapping[str, tuple[int, int]],
             cands: Mapping[str, Mapping[str, int]], native_ops: bool, max_tokens: int,
             max_seqs: int, block_size: int, skip: set[str] = frozenset(),
             kv_dtype: torch.dtype | None = None) -> KernelPlan:
    """Time what is not in ``skip`` (the forced ops: "linear", "elementwise", "sampling",
    "attention"); a skipped op keeps KernelPlan's default, which :func:`_apply_forced`
    then replaces with the forced choice."""
    g = torch.Generator().manual_seed(0)
    kv_dtype = kv_dtype or dtype
    plan = KernelPlan(source="measured", layer_loop="native" if native_ops else "python")
    roles = {**shp, **({GREEDY_HEAD: shp["lm_head"]} if "lm_head" in shp else {})}
    for role, (n, k) in roles.items():
        if "linear" in skip:
            break
        head = role in ("lm_head", GREEDY_HEAD)      # its rows: the sampled ones, <= max_seqs
        w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
        use = linear_buckets(max_tokens, max_seqs, head)
        runs = {c: (run_as_used(role, c, native_ops), tuning.copies_for(w, PREPARE[c]), limit)
                for c, limit in cands["lm_head" if head else role].items()}
        found: dict = {}
        timings = tuning.time_linear(runs, k, dtype, use, anomalies=found)
        if found:
            plan.anomalies[f"linear.{role}"] = found
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
            total += tuning.time_call(lambda meta=meta, kv=kv, q=q, k=k, v=v:
                                      backend.paged_attention(q, kv.key(0), kv.value(0), meta,
                                                              d ** -0.5, new_kv=(k, v)))
        out[impl] = total
    return out


def _time_elementwise(spec: ModelSpec, dtype: torch.dtype, g: torch.Generator) -> dict:
    """One layer's add+RMSNorm (twice), RoPE and SiLU x up, at 1, 64 and 512 tokens."""
    h, d = spec.hidden_size, spec.head_dim
    width = (spec.num_heads + 2 * spec.num_kv_heads) * d
    out = {}
    for impl in ("native", "torch"):
        m = ElementwiseOps(spec, dtype, torch.device("cpu"),
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

            def layer(m=m, hid=hid, delta=delta, w=w, qkv=qkv, pos=pos, rope=rope, gu=gu):
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
    out = {}
    for impl in ("native", "torch"):
        total = 0.0
        for r in sorted({1, min(64, rows)}):
            x = torch.randn(r, vocab, generator=g) * 4
            for temp, top_p in ((0.0, 1.0), (0.8, 0.9)):
                args = ([temp] * r, [top_p] * r, [0] * r, list(range(r)), [0] * r)
                total += tuning.time_call(lambda x=x, args=args, impl=impl:
                                          sample(x, *args, native=impl == "native"))
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
            total += tuning.time_call(lambda backend=backend, q=q, meta=meta:
                                      backend.paged_attention(q, kv.key(0), kv.value(0), meta,
                                                              spec.head_dim ** -0.5))
        out[name] = total
    return out
