"""gpu_check's timing: decode steps eager and replayed as CUDA graphs, their bytes against
the rooflines, where a step's time goes (torch's profiler), FlashDecoding partition sizes,
and the models they time. A ``report`` is gpu_check's ``Report``, a ``budget`` its
``Budget``. Needs only torch (and Triton for the GPU backend), like gpu_check itself."""
from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass


@dataclass
class Row:
    model: str
    batch: int
    mode: str
    ms: float
    bytes: int

    @property
    def tokens_per_s(self) -> float:
        return self.batch / (self.ms / 1e3)

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / (self.ms / 1e3)


def format_table(rows: list[Row], peak_bps: float, copy_bps: float) -> str:
    """The timing table: one line per (model, batch, mode)."""
    head = (f"{'model':<22} {'batch':>5} {'mode':<6} {'ms/step':>9} {'tokens/s':>10} "
            f"{'MB/step':>9} {'GB/s':>8} {'%peak':>6} {'%copy':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.model:<22} {r.batch:>5} {r.mode:<6} {r.ms:>9.3f} "
                     f"{r.tokens_per_s:>10.1f} {r.bytes / 1e6:>9.1f} "
                     f"{r.bytes_per_s / 1e9:>8.1f} {100 * r.bytes_per_s / peak_bps:>6.1f} "
                     f"{100 * r.bytes_per_s / copy_bps:>6.1f}")
    return "\n".join(lines)


def _sync(device) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device, nbytes: int, iters: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - t0)


def _decode_batch(rng: random.Random, n: int, max_len: int, block_size: int, num_blocks: int,
                  vocab: int, context: int | None = None):
    """n decode sequences on disjoint shuffled blocks (with spare lookahead blocks); each at
    position ``context`` or at a random / block-edge position below ``max_len``."""
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    edges = [0, block_size - 1, block_size, 2 * block_size - 1, max_len - 1]
    ids, pos, tables = [], [], []
    for i in range(n):
        p = context if context is not None else (
            edges[i] if i < len(edges) else rng.randrange(max_len))
        need = p // block_size + 1 + rng.randint(0, 1)
        tables.append([pool.pop() for _ in range(need)])
        ids.append(rng.randrange(vocab))
        pos.append(p)
    return ids, pos, tables


def _eager_decode(model, kv, ids, pos, tables):
    import torch

    from kernels.metadata import AttentionMetadata
    dev = kv.device
    meta = AttentionMetadata.build([1] * len(ids), pos, tables, kv.block_size, dev)
    return model.forward(torch.tensor(ids, device=dev), meta.positions, kv, meta,
                         torch.arange(len(ids), device=dev))


def _verify_batch(rng: random.Random, drafts: list[int], max_len: int, block_size: int,
                  num_blocks: int, vocab: int, context: int | None = None):
    """A speculative-decoding verify batch: row ``i`` runs ``1 + drafts[i]`` tokens (its last
    sampled token and its drafts) at positions ``context .. context + drafts[i]``, on
    disjoint shuffled blocks (with spare lookahead blocks). Without ``context`` the first
    rows' new tokens start at 0, straddle a block edge, end on a block's last slot and
    start on its first; the rest start at random, all ending below ``max_len``.
    Returns (ids: one list of ``1 + k`` tokens a row, contexts, tables)."""
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    ids, pos, tables = [], [], []
    for i, k in enumerate(drafts):
        edges = [0, block_size - 1 - k // 2, 2 * block_size - 1 - k, 3 * block_size,
                 max_len - 1 - k]
        p = context if context is not None else (
            edges[i] if i < len(edges) else rng.randrange(max_len - k))
        need = (p + k) // block_size + 1 + rng.randint(0, 1)
        tables.append([pool.pop() for _ in range(need)])
        ids.append([rng.randrange(vocab) for _ in range(1 + k)])
        pos.append(p)
    return ids, pos, tables


def _eager_verify(model, kv, ids, pos, tables):
    """One eager forward of a verify batch (rows of ``1 + k`` tokens, as
    :func:`_verify_batch`), with logits at every new token: ``[sum(1 + k), vocab]``."""
    import torch

    from kernels.metadata import AttentionMetadata
    dev = kv.device
    meta = AttentionMetadata.build([len(r) for r in ids], pos, tables, kv.block_size, dev)
    flat = [t for r in ids for t in r]
    return model.forward(torch.tensor(flat, device=dev), meta.positions, kv, meta,
                         torch.arange(len(flat), device=dev))


def time_steps(fn, device, steps: int, warmup: int = 2) -> float:
    """Mean ms per call of ``fn`` with a device sync after each (as a real step, which
    waits for its sampled tokens)."""
    for _ in range(warmup):
        fn()
        _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
        _sync(device)
    return (time.perf_counter() - t0) / steps * 1e3


def time_decode(report, label: str, model, shape, kv, graphs, batches,
                context: int, elem_bytes: int, steps: int, budget, reserve_s: float,
                tol: float = 5e-2) -> list[Row]:
    """Eager and graph decode steps at each batch size (every sequence at ``context``)."""
    from components.executor.synthetic import decode_bytes
    rows: list[Row] = []
    rng = random.Random(7)
    for b in batches:
        if budget.left() < reserve_s:
            print(f"  {label}: batch {b} and larger skipped (time budget)", flush=True)
            break
        ids, pos, tables = _decode_batch(rng, b, context + 1, kv.block_size, kv.num_blocks,
                                         shape.vocab_size, context=context)
        moved = decode_bytes(shape, [context + 1] * b, elem_bytes, kv.data.element_size())
        eager_logits = _eager_decode(model, kv, ids, pos, tables)
        ms = time_steps(lambda ids=ids, pos=pos, tables=tables:
                        _eager_decode(model, kv, ids, pos, tables), kv.device, steps)
        rows.append(Row(label, b, "eager", ms, moved))
        timed = f"eager {ms:.3f} ms"
        if graphs is not None and graphs.can_replay(b, context + 1):
            got = graphs.replay(ids, pos, tables)
            if report is not None:
                err = ((got - eager_logits).abs().max()
                       / eager_logits.abs().max().clamp_min(1e-6)).item()
                report.check(f"{label} bf16 graph == eager, batch {b}", err <= tol,
                             f"rel err {err:.2e} tol {tol:g}")
            ms = time_steps(lambda ids=ids, pos=pos, tables=tables:
                            graphs.replay(ids, pos, tables), kv.device, steps)
            rows.append(Row(label, b, "graph", ms, moved))
            timed += f", graph {ms:.3f} ms"
        print(f"  {label}: batch {b}: {timed} per step ({budget.elapsed():.0f} s elapsed)",
              flush=True)
    return rows


def time_verify(label: str, model, shape, kv, graphs, batches, k: int, context: int,
                steps: int, budget, reserve_s: float) -> list[tuple[int, float, float]]:
    """Speculative decoding's verify steps (every row ``1 + k`` tokens at ``context``, logits
    at all of them, one eager forward as the executor runs them) against plain decode steps
    of the same batch, eager (and the decode graph's replay, when there is one, for
    scale). Prints ms and the verify / decode ratio; returns (batch, decode ms, verify ms)."""
    out = []
    rng = random.Random(13)
    for b in batches:
        if budget.left() < reserve_s:
            print(f"  {label}: verify batch {b} and larger skipped (time budget)", flush=True)
            break
        vids, vpos, vtables = _verify_batch(rng, [k] * b, context + k + 1, kv.block_size,
                                            kv.num_blocks, shape.vocab_size, context=context)
        dids = [r[0] for r in vids]
        decode_ms = time_steps(lambda d=dids, p=vpos, t=vtables: _eager_decode(model, kv, d, p, t),
                               kv.device, steps)
        verify_ms = time_steps(lambda v=vids, p=vpos, t=vtables: _eager_verify(model, kv, v, p, t),
                               kv.device, steps)
        graph = ""
        if graphs is not None and graphs.can_replay(b, context + 1):
            ms = time_steps(lambda d=dids, p=vpos, t=vtables: graphs.replay(d, p, t), kv.device,
                            steps)
            graph = f"; decode graph {ms:.3f} ms, verify / graph {verify_ms / ms:.2f}x"
        print(f"  {label}: verify k={k} batch {b} context {context}: eager decode "
              f"{decode_ms:.3f} ms, eager verify {verify_ms:.3f} ms ({b * (1 + k)} tokens), "
              f"verify / decode {verify_ms / decode_ms:.2f}x{graph}", flush=True)
        out.append((b, decode_ms, verify_ms))
    return out


def sweep_decode_partitions(label: str, model, shape, kv, batches, context: int,
                            max_len: int, steps: int, sizes=(None, 2, 4, 8, 16)) -> None:
    """Whole decode steps as captured graphs (grids sized for ``max_len``) for each
    FlashDecoding partition size (KV blocks per program; None: the backend's choice by
    batch size): the model's backend set to each size in turn, its graphs captured again,
    each batch replayed ``steps`` times."""
    from components.executor.cuda_graphs import DecodeGraphs
    rng = random.Random(9)
    cases = [(b, *_decode_batch(rng, b, context + 1, kv.block_size, kv.num_blocks,
                                shape.vocab_size, context=context)) for b in batches]
    was = model.backend.partition_blocks
    rows = {b: [] for b in batches}
    for p in sizes:
        model.backend.partition_blocks = p
        graphs = DecodeGraphs(model, kv, max_model_len=max_len, max_batch=max(batches))
        graphs.capture()
        for b, ids, pos, tables in cases:
            ms = time_steps(lambda graphs=graphs, ids=ids, pos=pos, tables=tables:
                            graphs.replay(ids, pos, tables), kv.device, steps)
            rows[b].append(f"{p or 'auto':>4} {ms:6.3f} ms")
    model.backend.partition_blocks = was
    for b in batches:
        print(f"  {label} batch {b:>3} context {context}: " + ", ".join(rows[b]), flush=True)


def profile_decode(label: str, model, shape, kv, graphs, batches, context: int,
                   steps: int = 10, top: int = 8) -> None:
    """Where a decode step's time goes, from torch's profiler: per step, the wall time, the
    device's busy time (the sum of its kernels' times) and the kernels launched, then the
    ``top`` kernels by time; for the replayed graph when there is one, and for the eager
    forward. On the CPU (the dry run) the same table lists torch's CPU ops by self time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    dev = kv.device
    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rng = random.Random(11)
    for b in batches:
        ids, pos, tables = _decode_batch(rng, b, context + 1, kv.block_size, kv.num_blocks,
                                         shape.vocab_size, context=context)
        modes = [("eager", lambda ids=ids, pos=pos, tables=tables:
                  _eager_decode(model, kv, ids, pos, tables))]
        if graphs is not None and graphs.can_replay(b, context + 1):
            modes.insert(0, ("graph", lambda ids=ids, pos=pos, tables=tables:
                             graphs.replay(ids, pos, tables)))
        for mode, fn in modes:
            for _ in range(3):
                fn()
            _sync(dev)
            with profile(activities=activities) as prof:
                t0 = time.perf_counter()
                for _ in range(steps):
                    fn()
                    _sync(dev)
                wall = (time.perf_counter() - t0) / steps
            kind = DeviceType.CUDA if cuda else DeviceType.CPU
            per: dict[str, list[float]] = {}
            for e in prof.events():
                if e.device_type != kind:
                    continue
                us = e.time_range.elapsed_us() if cuda else e.self_cpu_time_total
                per.setdefault(e.name, []).append(us)
            busy = sum(sum(v) for v in per.values()) / steps
            launched = sum(len(v) for v in per.values()) / steps
            what = "kernels" if cuda else "ops"
            print(f"  {label} batch {b} {mode}: {wall * 1e3:.3f} ms/step wall, "
                  f"{busy / 1e3:.3f} ms {'device busy' if cuda else 'in ops'}, "
                  f"{launched:.0f} {what}/step", flush=True)
            ranked = sorted(per.items(), key=lambda kv_: -sum(kv_[1]))[:top]
            for name, times in ranked:
                print(f"      {sum(times) / steps:9.1f} us/step  {len(times) / steps:5.0f}x  "
                      f"{name[:90]}", flush=True)


def _free(device) -> None:
    import torch
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def build_timed(label, shape, weights, dtype, device, blocks: int, max_len: int,
                max_batch: int, kernels: dict[str, str] | None = None, kv=None,
                kv_dtype=None):
    """(model, KV cache of ``blocks`` 16-token blocks filled with noise, decode graphs up to
    ``max_batch`` when the backend is graph-safe, else None) for the timing sections;
    ``kernels`` forces plan choices, a given ``kv`` is used as it is, ``kv_dtype`` is the
    cache's element type (fp8) when it is not the model's."""
    import torch

    from components.executor.build import build_model
    from kernels.kv_cache import quantize
    model = build_model(shape, weights, dtype=dtype, device=device, kv_block_size=16,
                        kernels=kernels, kv_dtype=kv_dtype)
    print(f"  {label}: backend {model.backend.name}", flush=True)
    if kv is None:
        kv = model.new_kv_cache(blocks, 16)
        for layer in kv.data:                 # (one layer's noise at a time)
            layer.copy_(quantize(torch.randn(layer.shape, device=layer.device), kv.dtype))
    graphs = None
    if getattr(model.backend, "graph_safe", False):
        from components.executor.cuda_graphs import DecodeGraphs
        graphs = DecodeGraphs(model, kv, max_model_len=max_len, max_batch=max_batch)
        info = graphs.capture()
        print(f"  {label}: captured {len(info['buckets'])} buckets in {info['seconds']} s, "
              f"pool reserved {info['pool_reserved_bytes'] / 2**20:.1f} MiB", flush=True)
    return model, kv, graphs


def decode_blocks(batches: list[int], context: int) -> int:
    """KV blocks :func:`time_decode` needs: its batches draw disjoint tables with lookahead."""
    return max(batches) * (-(-(context + 1) // 16) + 1) + 1
