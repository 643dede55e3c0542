"""Executor step time on this machine, without the bus: SmolLM2 decode steps at several
batch sizes over a paged KV cache, against two floors, plus an optional operator profile.

- Bandwidth floor (batch 1): weight bytes / measured memory-copy bandwidth — a decode step
  must stream every weight once.
- Compute floor (larger batches): 2 x parameters x tokens / measured GEMM rate of the same
  dtype on a large matmul, through the fastest linear candidate this machine has.
- GEMM floor: the step's own linear layers (30 x qkv, o, gate_up, down, and the lm_head) at
  M = batch, each at the fastest linear candidate this machine has, over distinct weights
  that come from memory (the last-level cache evicted first: a decode step's weights and
  KV outgrow it); "x gemm" is the step's time over it. "warm": the same GEMMs with
  whatever the cache kept from the previous pass (on a host with a large shared L3 most
  of the weights), the step's time over that in "x warm".

    scripts/run bench/step --dtype bfloat16 --batches 1,8,64 --context 160 [--profile 64]
        [--breakdown 1] [--penalties 64]

Prints ms/step (median of ``--steps``), tokens/s, and each floor as a fraction achieved.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from components.executor.build import build_model
from components.executor.candidates import linear_candidates, shapes as weight_shapes
from components.executor.linear import PREPARE, RUN
from components.executor.loader import load_model
from components.executor.model import LlamaModel
from components.executor.runner import ModelRunner
from components.model.fetch import cache_dir, default_model_path
from kernels import cpu_forward, machine, native_lib, tuning
from kernels.kv_cache import cache_dtype, populate
from schemas.wire import NewSeq, Penalties, SeqStep, StepPlan, StructuredOutput


def copy_bandwidth(nbytes: int = 256 << 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times)          # read + write


def llc_bytes() -> int:
    """The last-level cache's size (sysfs), or 64 MiB where it does not say."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (d / "size").read_text().strip()
            n = int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0)
            best = max(best, n) if int((d / "level").read_text()) >= 2 else best
        except (OSError, ValueError):
            continue
    return best or 64 << 20


class Evict:
    """Reads a buffer of twice the last-level cache, so that what a timed call reads next
    comes from memory (a 2-core VM can sit on a host with a 480 MB L3: 64 MB of weight
    copies stay in it between rounds, which a decode step's ~500 MB of weights and KV do
    not)."""

    def __init__(self) -> None:
        self.buf = torch.ones(2 * llc_bytes() // 4, dtype=torch.float32)

    def __call__(self) -> None:
        self.buf.sum()


def gemm_floor_ms(model: LlamaModel, batch: int, evict: Evict | None,
                  rounds: int = 5, head_rows: int | None = None) -> tuple[float, float]:
    """The step's linear layers at the fastest candidate measured for each shape at M =
    ``batch`` (every candidate this machine has, not only the plan's), over distinct
    weights of each shape, one per layer, as in a step: what the GEMMs of a decode step of
    ``batch`` sequences cost here at best. Returns (cold, warm) ms: cold with the cache
    evicted before each pass over a role's weights (they come from memory, as in a step
    whose weights and KV outgrow the last-level cache), warm without (what is left in the
    cache from the previous pass). The native kernels (small-batch vector, AMX) run as
    one native call over a role's weights, as the native layer loop runs them: no Python
    call overhead (~10 us a call, ~1 ms over a step's 121 GEMMs); the others are called
    from Python, as the step calls them. ``head_rows``: the lm_head's M where it differs
    (a prefill step samples one row a sequence); ``evict`` None: the warm pass alone (cold
    is returned as the warm time: a prefill step's weights stay in the cache)."""
    shapes = weight_shapes(model.spec)
    g = torch.Generator().manual_seed(batch)
    total = {True: 0.0, False: 0.0}
    for role, (n, k) in shapes.items():
        layers = 1 if role == "lm_head" else model.spec.num_layers
        m = head_rows if role == "lm_head" and head_rows is not None else batch
        x = torch.randn(m, k, generator=g).to(model.dtype)
        fns = {}
        for c, limit in linear_candidates(model.dtype, model.device, (n, k)).items():
            if m > limit:
                continue
            ws = [PREPARE[c]((torch.randn(n, k, generator=g) * 0.05).to(model.dtype))
                  for _ in range(layers)]
            if c in cpu_forward.LINEAR_KINDS:     # offered only where the library runs
                fns[c] = lambda c=c, ws=ws, x=x: cpu_forward.linear_chain(x, ws, c)
            else:
                fns[c] = lambda c=c, ws=ws, x=x: [RUN[c](x, w) for w in ws]
        for cold in (True, False) if evict is not None else (False,):
            best = {c: float("inf") for c in fns}
            for _ in range(rounds):               # interleaved: drift hits all alike
                for c, fn in fns.items():
                    if cold:
                        evict()
                    else:
                        fn()                      # what the cache keeps of one pass
                    t0 = time.perf_counter()
                    fn()
                    best[c] = min(best[c], time.perf_counter() - t0)
            total[cold] += min(best.values())
    if evict is None:
        total[True] = total[False]
    return total[True] * 1e3, total[False] * 1e3


GEMM_N = 2048


def gemm_rate(dtype: torch.dtype, device: torch.device, n: int = GEMM_N) -> tuple[float, str]:
    """FLOP/s of an n x n x n GEMM of ``dtype`` through the fastest linear candidate this
    machine has (torch's own bf16 GEMM runs at ~0.2 GFLOP/s on an AVX2-only EPYC, which
    would make the compute floor meaningless and take minutes). Candidates are first timed
    at n / 8; only those within 4x of the best there are timed at n."""
    def best_of(name: str, size: int) -> float:
        limit = candidates[name]
        w = PREPARE[name](torch.randn(size, size).to(dtype))
        x = torch.randn(min(size, limit), size).to(dtype)
        return tuning.time_call(lambda: RUN[name](x, w)) / x.shape[0]   # per row

    candidates = linear_candidates(dtype, device, (n, n))
    small = {c: best_of(c, n // 8) for c in candidates}
    keep = [c for c, t in small.items() if t <= 4 * min(small.values())]
    full = {c: best_of(c, n) for c in keep}
    name = min(full, key=full.get)
    return 2 * n * n / full[name], name


class DecodeBench:
    """A runner with ``batch`` sequences prefilled to ``context`` tokens, stepping decode."""

    def __init__(self, model: LlamaModel, batch: int, context: int, block_size: int = 16,
                 penalties: Penalties | None = None, logprobs: int | None = None,
                 structured: StructuredOutput | None = None):
        blocks_per_seq = -(-(context + 64) // block_size)
        grammars = None
        if structured is not None:
            from components.executor.constraints import Grammars
            from components.model.structured import ll_tokenizer
            from components.model.vocab import load_tokenizer
            grammars = Grammars(lambda: ll_tokenizer(load_tokenizer(default_model_path()),
                                                     model.spec.vocab_size))
        kv = model.new_kv_cache(batch * blocks_per_seq, block_size)
        if kv.device.type == "cpu":
            populate(kv.data)            # as the executor does (kv.prefault): no page faults
        self.runner = ModelRunner(model, kv, grammars=grammars)
        g = torch.Generator().manual_seed(batch)
        news, steps = [], []
        for i in range(batch):
            toks = torch.randint(100, 40000, (context,), generator=g).tolist()
            table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            news.append(NewSeq(i + 1, toks, context, 0, table, 0.0, 1.0, 0, None, penalties,
                               logprobs, structured=structured))
            steps.append(SeqStep(i + 1, context, [], True))
        self.batch = batch
        self.step_id = 1
        # prefill in chunks of 512 tokens' worth of sequences
        per = max(1, 512 // context)
        for start in range(0, batch, per):
            self._run(StepPlan(self._next(), news[start:start + per], steps[start:start + per], []))

    def _next(self) -> int:
        self.step_id += 1
        return self.step_id

    def _run(self, plan: StepPlan):
        return self.runner.step(plan)

    def decode(self) -> float:
        plan = StepPlan(self._next(), [],
                        [SeqStep(i + 1, 1, [], True) for i in range(self.batch)], [])
        t0 = time.perf_counter()
        self._run(plan)
        return time.perf_counter() - t0


class PrefillBench:
    """A runner stepping one prefill step of ``tokens`` new tokens: sequences of ``chunk``
    new tokens each (the last one shorter), each after ``context`` tokens already in the
    cache (a prefix-cache hit or an earlier chunk), each sampling its last row, as a
    chunked prefill step does. Every timed step is the same step again, under fresh
    sequence ids over the same blocks (the last ones dropped)."""

    def __init__(self, model: LlamaModel, tokens: int, context: int, chunk: int,
                 block_size: int = 16):
        self.chunks = [min(chunk, tokens - s) for s in range(0, tokens, chunk)]
        per = -(-(context + chunk) // block_size)
        kv = model.new_kv_cache(len(self.chunks) * per, block_size)
        if kv.device.type == "cpu":
            populate(kv.data)
        self.runner = ModelRunner(model, kv)
        g = torch.Generator().manual_seed(tokens + context)
        self.toks = [torch.randint(100, 40000, (context + n,), generator=g).tolist()
                     for n in self.chunks]
        self.tables = [list(range(i * per, (i + 1) * per)) for i in range(len(self.chunks))]
        self.context, self.tokens = context, tokens
        self.step_id, self.next_seq, self.live = 1, 1, []
        if context:              # the context's KV, once (its values only need be finite)
            ids = self._ids()
            news = [NewSeq(sid, t[:context], context, 0, tb, 0.0, 1.0, 0, None)
                    for sid, t, tb in zip(ids, self.toks, self.tables)]
            self._run(news, [SeqStep(sid, context, [], False) for sid in ids])

    def _ids(self) -> list[int]:
        ids = list(range(self.next_seq, self.next_seq + len(self.chunks)))
        self.next_seq += len(ids)
        return ids

    def _run(self, news: list[NewSeq], steps: list[SeqStep]) -> None:
        self.step_id += 1
        drop, self.live = self.live, [s.seq_id for s in steps]
        self.runner.step(StepPlan(self.step_id, news, steps, drop))

    def step(self) -> float:
        ids = self._ids()
        news = [NewSeq(sid, t, len(t), self.context, tb, 0.0, 1.0, 0, None)
                for sid, t, tb in zip(ids, self.toks, self.tables)]
        steps = [SeqStep(sid, n, [], True) for sid, n in zip(ids, self.chunks)]
        t0 = time.perf_counter()
        self._run(news, steps)
        return time.perf_counter() - t0

    def attention_flops(self, spec) -> float:
        """Causal attention's FLOPs in this step: each new row of each head attends every
        key up to its own position (QK^T and PV: 4 x head_dim a key), in every layer."""
        c = self.context
        keys = sum(n * c + n * (n + 1) // 2 for n in self.chunks)
        return 4.0 * spec.head_dim * spec.num_heads * keys * spec.num_layers


def breakdown_line(model: LlamaModel, spent: dict[str, float], step, steps: int) -> str:
    """``steps`` calls of ``step`` with the timers of :func:`time_parts` (``spent``) around
    the model: each part's ms a step, largest first, then the rest (Python, the embedding,
    the logits' cast)."""
    spent.clear()
    model.layer_seconds.zero_()
    total = sum(step() for _ in range(steps))
    for part, sec in zip(cpu_forward.LAYER_PARTS, model.layer_seconds.tolist()):
        if sec:
            spent[f"layers: {part}"] = sec
    parts = sorted(spent.items(), key=lambda kv: -kv[1])
    return (f"total {total / steps * 1e3:.2f}; "
            + ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in parts)
            + f", rest {(total - sum(spent.values())) / steps * 1e3:.2f}")


def prefill_table(model: LlamaModel, sizes: list[int], contexts: list[int], chunk: int,
                  steps: int, rate: float, breakdown: bool) -> None:
    """Each prefill step's ms against its floor: the step's linear layers at the fastest
    candidate this machine has for M = its tokens (warm: a prefill step's weights stay in
    the cache over its rows) plus its attention FLOPs at the machine's GEMM rate."""
    print(f"prefill steps: sequences of at most {chunk} new tokens after the context; floor ="
          f" linears at the best candidate (warm) + attention FLOPs at {rate / 1e9:.0f} "
          f"GFLOP/s")
    print(f"{'tokens':>6} {'context':>7} {'ms/step':>9} {'tok/s':>8} {'linear floor':>12} "
          f"{'attn floor':>10} {'floor ms':>9} {'x floor':>7}")
    benches = []
    for n in sizes:
        floor_lin, _ = gemm_floor_ms(model, n, None, rounds=3, head_rows=-(-n // chunk))
        for c in contexts:
            if c + min(n, chunk) > model.spec.max_position:
                continue
            bench = PrefillBench(model, n, c, chunk)
            bench.step()
            ms = statistics.median(bench.step() for _ in range(steps)) * 1e3
            attn = bench.attention_flops(model.spec) / rate * 1e3
            floor = floor_lin + attn
            print(f"{n:>6} {c:>7} {ms:>9.1f} {n / ms * 1e3:>8.0f} {floor_lin:>12.1f} "
                  f"{attn:>10.1f} {floor:>9.1f} {ms / floor:>7.2f}")
            benches.append(bench)
    if not breakdown:
        return
    spent = time_parts(model)
    for bench in benches:
        print(f"{bench.tokens} tokens after {bench.context}, ms/step (mean of {steps}): "
              + breakdown_line(model, spent, bench.step, steps))


def interleaved(benches: dict[str, DecodeBench], steps: int) -> dict[str, list[float]]:
    """Each bench's decode step, in turns (drift hits each alike): two untimed rounds, then
    ``steps`` timed ones; seconds per step by name."""
    times: dict[str, list[float]] = {name: [] for name in benches}
    for i in range(2 + steps):
        for name, bench in benches.items():
            t = bench.decode()
            if i >= 2:
                times[name].append(t)
    return times


def time_parts(model: LlamaModel) -> dict[str, float]:
    """Wrap the forward's parts (native kernels, oneDNN GEMMs, metadata, sampling) with
    wall-clock timers; returns the dict they add seconds to. The native calls are invisible
    to torch.profiler (ctypes), so this is the step's profile. Where the layers run as one
    native call (``plan.layer_loop``), that call times its own parts into
    ``model.layer_seconds`` (added here as "layers: <part>")."""
    import components.executor.runner as runner_mod
    import kernels.metadata as meta_mod

    spent: dict[str, float] = {}
    model.layer_seconds = torch.zeros(len(cpu_forward.LAYER_PARTS), dtype=torch.float64)

    def timed(fn, label):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
        return call

    native = model.native
    if native is not None:
        for name, label in (("paged_attention", "attention"), ("add_rms_norm", "add+rmsnorm"),
                            ("rope_", "rope"), ("silu_mul", "silu*up"),
                            ("argmax", "argmax"), ("write_kv", "kv write"),
                            ("rope_write_kv_", "rope+kv write")):
            setattr(native, name, timed(getattr(native, name), label))
        if getattr(model.backend, "name", "") == "cpu":
            model.backend.write_kv = native.write_kv
    else:
        model.backend.paged_attention = timed(model.backend.paged_attention, "attention")
        model.backend.write_kv = timed(model.backend.write_kv, "kv write")
    for cand, fn in list(model.runs.items()):       # every weight calls through these
        model.runs[cand] = timed(fn, f"linear ({cand})")
    meta_mod.AttentionMetadata.build = timed(meta_mod.AttentionMetadata.build, "metadata")
    runner_mod.sample = timed(runner_mod.sample, "sampling")
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0,
                    help="print an operator profile at this batch")
    ap.add_argument("--backend", default="auto", help="attention backend (auto, cpu, torch)")
    ap.add_argument("--breakdown", type=int, default=0,
                    help="after the table, time each part of the step at this batch")
    ap.add_argument("--penalties", type=int, default=0,
                    help="after the table, time steps at this batch with presence, frequency "
                         "and repetition penalties and a logit bias on every sequence, with "
                         "logprobs (top 5) on every sequence, and with every sequence held "
                         "to a JSON object (structured output), beside the same steps with "
                         "none of them")
    ap.add_argument("--prefill", default="",
                    help="prefill steps of these token counts (e.g. 512,2048,8192) against "
                         "their floor, instead of the decode table")
    ap.add_argument("--prefill-context", default="0,2048",
                    help="tokens already cached before each prefill sequence")
    ap.add_argument("--chunk", type=int, default=2048,
                    help="a prefill sequence's new tokens at most (the scheduler's chunk)")
    ap.add_argument("--kv-dtype", default="auto",
                    help="the KV cache's element type (auto: the model's; fp8, fp8_e4m3, "
                         "fp8_e5m2); several, comma-separated, run side by side: one model "
                         "each, their steps interleaved, and the ratio printed")
    ap.add_argument("--kernels", default="",
                    help="forced choices, e.g. linear=onednn,elementwise=native (default: the "
                         "plan measured on this machine, as the executor uses it)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    spec, weights = load_model(default_model_path())
    forced = dict(kv.split("=", 1) for kv in args.kernels.split(",") if kv)
    models = {name: build_model(spec, weights, dtype=dtype, backend=args.backend,
                                kernels=forced, tuning_cache=cache_dir(),
                                max_seqs=max(256, *[int(x) for x in args.batches.split(",")]),
                                kv_dtype=cache_dtype(name, dtype))
              for name in args.kv_dtype.split(",")}
    model = next(iter(models.values()))     # the floors, the profile and the breakdown
    del weights
    elem = torch.finfo(dtype).bits // 8
    size = lambda t: t.numel() if isinstance(t, torch.Tensor) else t.shape[0] * t.shape[1]
    params = sum(size(t) for t in [model.embed, model.norm] + [
        getattr(layer, n) for layer in model.layers
        for n in ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")])
    nonembed = params - model.embed.numel()
    weight_bytes = params * elem            # tied lm_head: the embedding is read once per step
    bw, (rate, rate_by) = copy_bandwidth(), gemm_rate(dtype, model.device)
    print(f"machine: {machine.summary_line()}")
    if native_lib.variant() != "native":
        print(f"native kernels: the {native_lib.variant()} build (WEIR_CPU_KERNEL_PORTABLE), "
              f"not this CPU's own; torch's linears still use every ISA it has")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, dtype {args.dtype}, "
          f"context {args.context}, attention backend {model.backend.name}")
    for name, m in models.items():
        print(f"kv {name} ({str(m.kv_dtype).removeprefix('torch.')}): kernels "
              f"({m.plan.source}): " + ", ".join(
                  f"{k} {v}" for k, v in m.plan.summary().items() if k != "source"))
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s, {args.dtype} GEMM {rate / 1e9:.0f} GFLOP/s "
          f"({rate_by}, {GEMM_N}^3), "
          f"weights {weight_bytes / 1e6:.0f} MB ({params / 1e6:.1f}M params, "
          f"{nonembed / 1e6:.1f}M non-embedding)")
    if args.prefill:
        prefill_table(model, [int(x) for x in args.prefill.split(",")],
                      [int(x) for x in args.prefill_context.split(",")], args.chunk,
                      args.steps, rate, bool(args.breakdown))
        return
    evict = Evict()
    print(f"last-level cache {llc_bytes() >> 20} MiB; gemm floor: the step's GEMMs with the "
          f"weights from memory (the cache evicted), warm: left in the cache")
    print(f"{'batch':>5} {'kv':>8} {'ms/step':>9} {'tok/s':>8} {'bw floor ms':>11} {'of bw':>6} "
          f"{'flop floor ms':>13} {'of flops':>8} {'gemm floor ms':>13} {'x gemm':>6} "
          f"{'warm floor ms':>13} {'x warm':>6}")
    for b in [int(x) for x in args.batches.split(",")]:
        times = interleaved({name: DecodeBench(m, b, args.context)
                             for name, m in models.items()}, args.steps)
        flop_floor = 2 * params * b / rate * 1e3
        gemm, warm = gemm_floor_ms(model, b, evict)
        for name, m in models.items():
            ms = statistics.median(times[name]) * 1e3
            kv_elem = m.kv_dtype.itemsize
            kv_bytes = b * args.context * spec.num_layers * 2 * spec.num_kv_heads \
                * spec.head_dim * kv_elem
            bw_floor = (weight_bytes + kv_bytes) / bw * 1e3
            print(f"{b:>5} {name:>8} {ms:>9.2f} {b / ms * 1e3:>8.0f} {bw_floor:>11.2f} "
                  f"{bw_floor / ms:>6.0%} {flop_floor:>13.2f} {flop_floor / ms:>8.0%} "
                  f"{gemm:>13.2f} {ms / gemm:>6.2f} {warm:>13.2f} {ms / warm:>6.2f}")
        if len(models) > 1:
            first = next(iter(times))
            base = statistics.median(times[first])
            print(f"{'':>5} " + ", ".join(
                f"{name}/{first} {statistics.median(t) / base:.3f}"
                for name, t in times.items() if name != first))
        if b == args.profile:
            from torch.profiler import ProfilerActivity, profile
            bench = DecodeBench(model, b, args.context)
            bench.decode()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    bench.decode()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if args.penalties:
        b = args.penalties
        benches = {"plain": DecodeBench(model, b, args.context),
                   "penalized": DecodeBench(model, b, args.context,
                                            penalties=Penalties(0.5, 0.5, 1.2, [(5, 1.0)])),
                   "logprobs": DecodeBench(model, b, args.context, logprobs=5),
                   "structured": DecodeBench(model, b, args.context,
                                             structured=StructuredOutput(json_object=True))}
        times = interleaved(benches, args.steps)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"batch {b}, context {args.context}: {ms['plain']:.2f} ms/step plain, "
              f"{ms['penalized']:.2f} with penalties and a bias on every sequence "
              f"(+{ms['penalized'] - ms['plain']:.2f} ms), {ms['logprobs']:.2f} with logprobs "
              f"and the top 5 on every sequence (+{ms['logprobs'] - ms['plain']:.2f} ms), "
              f"{ms['structured']:.2f} with every sequence held to a JSON object "
              f"(+{ms['structured'] - ms['plain']:.2f} ms)")
    if args.breakdown:               # last: the timers stay wrapped around the model
        b = args.breakdown
        bench = DecodeBench(model, b, args.context)
        for _ in range(2):
            bench.decode()
        print(f"batch {b} breakdown ({model.plan.layer_loop} layer loop), ms/step (mean of "
              f"{args.steps}): " + breakdown_line(model, time_parts(model), bench.decode,
                                                    args.steps))


if __name__ == "__main__":
    main()
