"""gpu_check's prefill and mixed steps under piecewise CUDA graphs
(components/executor/piecewise_graphs.py): the fused RoPE + KV write against the kernels
it replaces and torch, the pieces' logits and KV against the eager forward in every token
bucket, and eager against piecewise step times. A ``report`` is gpu_check's ``Report``, a
``budget`` its ``Budget``. Needs only torch and Triton, like gpu_check itself."""
from __future__ import annotations

import random

from scripts.gpu.timing import _sync, time_steps


def check_rope_kv(report, device, dtypes, tiny: bool = False) -> None:
    """``rope_write_kv`` on a mixed step's rows plus padding rows (slot -1): the same bytes
    as ``rope_`` then ``write_kv``, and RoPE within rounding of torch's float32 RoPE."""
    import torch

    from kernels.metadata import AttentionMetadata
    from kernels.triton_fused import rope_, rope_write_kv
    from kernels.triton_paged import write_kv
    rng = random.Random(3)
    for dtype in dtypes:
        for heads, kv_heads, dim, bs in ((6, 2, 16, 16), (9, 3, 64, 16), (8, 8, 64, 32)):
            if tiny and dim > 32:
                continue
            query, context = [1, 1, 3 * bs + 5, 7], [bs - 1, 5 * bs, 0, 2 * bs + 3]
            need = [-(-(q + c) // bs) for q, c in zip(query, context)]
            pool = list(range(sum(need) + 1))
            rng.shuffle(pool)
            tables = [[pool.pop() for _ in range(n)] for n in need]
            meta = AttentionMetadata.build(query, context, tables, bs, device)
            pad = 5
            slots = torch.cat([meta.slot_mapping,
                               torch.full((pad,), -1, dtype=torch.long, device=device)])
            pos = torch.cat([meta.positions, torch.zeros(pad, dtype=torch.long, device=device)])
            t, width = len(slots), (heads + 2 * kv_heads) * dim
            g = torch.Generator().manual_seed(rng.randrange(1 << 30))
            noise = lambda *shape, g=g, dt=dtype: torch.randn(*shape, generator=g).to(device, dt)
            qkv = noise(t, width)
            cache = (sum(need) + 1, bs, kv_heads, dim)
            kc, vc = noise(*cache), noise(*cache)
            d = dim
            inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
            emb = torch.outer(torch.arange(4096, dtype=torch.float32), inv).repeat(1, 2)
            cos, sin = emb.cos().to(device), emb.sin().to(device)
            kc2, vc2, ref = kc.clone(), vc.clone(), qkv.clone()
            q = rope_write_kv(qkv, heads, kv_heads, dim, pos, cos, sin, kc, vc, slots)
            rope_(ref, heads + kv_heads, dim, pos, cos, sin)
            n_q, n_kv = heads * dim, kv_heads * dim
            padded = AttentionMetadata(num_tokens=t, query_lens=[], context_lens=[],
                                       block_size=bs, positions=pos, slot_mapping=slots,
                                       seq_lens=slots, query_start_loc=slots,
                                       block_tables=slots)
            write_kv(kc2, vc2, ref[:, n_q:n_q + n_kv].view(t, kv_heads, dim),
                     ref[:, n_q + n_kv:].view(t, kv_heads, dim), padded)
            same = torch.equal(q.view(t, n_q), ref[:, :n_q]) and torch.equal(kc, kc2) \
                and torch.equal(vc, vc2)
            x = qkv[:, :n_q].view(t, heads, dim).float()
            rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
            want = x * cos[pos][:, None] + rot * sin[pos][:, None]
            # within one ulp of the output dtype (bf16: 2^-7 of the value; the interpreter's
            # casts are a ulp off where a GPU's round to nearest)
            err = ((q.float() - want).abs() / want.abs().clamp_min(1.0)).max().item()
            tol = 1e-5 if dtype == torch.float32 else 2 ** -7
            report.check(f"fused rope+kv write {str(dtype)[6:]:<8} heads {heads}/{kv_heads} "
                         f"dim {dim} block {bs}", same and err <= tol,
                         f"same bytes as rope_ + write_kv: {same}, rel err vs torch "
                         f"{err:.1e}")


def mixed_step(rng: random.Random, tokens: int, max_len: int, block_size: int, vocab: int):
    """A step of exactly ``tokens`` tokens: up to 8 decode rows at random contexts, then
    prefill chunks of up to ``max_len / 2`` tokens, each after a random cached prefix (some
    fresh). Returns (ids, query_lens, context_lens, blocks each sequence needs)."""
    decode = min(8, tokens // 4) if tokens > 1 else 1
    query = [1] * decode
    context = [rng.randrange(1, max_len - 1) for _ in range(decode)]
    rest, half = tokens - decode, max_len // 2
    while rest:
        q = min(rest, rng.randrange(1, half + 1))
        query.append(q)
        context.append(rng.choice([0, rng.randrange(0, half)]))
        rest -= q
    need = [-(-(q + c) // block_size) for q, c in zip(query, context)]
    return [rng.randrange(vocab) for _ in range(tokens)], query, context, need


def _tables(rng: random.Random, need: list[int], num_blocks: int) -> list[list[int]]:
    """Disjoint shuffled tables, never block 0 (padding must not touch it either)."""
    pool = list(range(1, num_blocks))
    rng.shuffle(pool)
    return [[pool.pop() for _ in range(n)] for n in need]


def check_piecewise(report, label: str, model, buckets, max_len: int, block_size: int,
                    tol: float, seed: int = 0):
    """Capture the pieces for ``buckets``, then per bucket a full and a padded mixed step:
    logits at every row against the eager forward on a copy of the cache, the step's KV
    against the eager step's, and no other slot changed (padding rows store nothing)."""
    import torch

    from components.executor.piecewise_graphs import PiecewiseGraphs
    from kernels.metadata import AttentionMetadata
    rng = random.Random(seed)
    vocab = model.spec.vocab_size
    sizes = []
    for b in buckets:
        sizes += [b] + ([b - rng.randrange(1, b // 4 + 1)] if b >= 4 else [])
    steps = [(n, *mixed_step(rng, n, max_len, block_size, vocab)) for n in sizes]
    num_blocks = max(sum(s[-1]) for s in steps) + 1
    kv = model.new_kv_cache(num_blocks, block_size)
    kv.data.normal_()
    pieces = PiecewiseGraphs(model, kv, buckets=buckets)
    info = pieces.capture()
    print(f"  {label}: captured {len(info['buckets'])} buckets x {info['pieces']} pieces in "
          f"{info['seconds']} s, pool reserved {info['pool_reserved_bytes'] / 2**20:.1f} MiB, "
          f"allocated {info['pool_allocated_bytes'] / 2**20:.1f} MiB, static buffers "
          f"{info['static_bytes'] / 2**20:.1f} MiB", flush=True)
    worst = 0.0
    for n, ids, query, context, need in steps:
        meta = AttentionMetadata.build(query, context, _tables(rng, need, num_blocks),
                                       block_size, kv.device)
        ids_t = torch.tensor(ids, device=kv.device)
        rows = torch.arange(n, device=kv.device)
        eager = type(kv)(kv.data.clone())
        want = model.forward(ids_t, meta.positions, eager, meta, rows)
        before = kv.data[0].clone()
        got = pieces.forward(ids_t, meta.positions, kv, meta, rows)
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        kv_err = ((kv.data - eager.data).abs().max()
                  / eager.data.abs().max().clamp_min(1e-6)).item()
        worst = max(worst, err)
        changed = (kv.data[0] != before).flatten(3).any(-1).any(0).flatten()   # per slot
        real = torch.zeros_like(changed)
        real[meta.slot_mapping] = True
        stray = int((changed & ~real).sum())
        ok = err <= tol and kv_err <= tol and stray == 0 and bool(torch.isfinite(got).all())
        report.check(f"{label} piecewise == eager, {n} tokens", ok,
                     f"bucket {pieces.bucket_for(n)}, {len(query)} seqs "
                     f"({query.count(1)} decode): logits rel err {err:.2e}, KV rel err "
                     f"{kv_err:.2e}, stray KV writes {stray}")
    print(f"  {label}: worst relative logits error {worst:.2e} (tol {tol:g})", flush=True)
    return pieces, kv


def time_prefill(label: str, model, kv, pieces, cases, steps: int, budget,
                 reserve_s: float) -> list[tuple[str, int, float, float]]:
    """Eager against piecewise steps, each case ``(name, decode rows, decode context, chunk
    tokens)``: one prefill chunk of ``chunk`` tokens from an empty context beside ``decode``
    rows at ``decode context``; the last row of each sequence sampled (logits). Prints ms
    and the speedup; returns (name, tokens, eager ms, piecewise ms)."""
    import torch

    from kernels.metadata import AttentionMetadata
    rng = random.Random(21)
    dev = kv.device
    out = []
    for name, decode, ctx, chunk in cases:
        if budget.left() < reserve_s:
            print(f"  {label}: {name} and later skipped (time budget)", flush=True)
            break
        query, context = [1] * decode + [chunk], [ctx] * decode + [0]
        need = [-(-(q + c) // kv.block_size) for q, c in zip(query, context)]
        tables = _tables(rng, need, kv.num_blocks)
        tokens = sum(query)
        ids = torch.tensor([rng.randrange(model.spec.vocab_size) for _ in range(tokens)],
                           device=dev)
        rows = torch.tensor([i for i in range(decode)] + [tokens - 1], device=dev)

        def step(fn, query=query, context=context, tables=tables, ids=ids, rows=rows):
            meta = AttentionMetadata.build(query, context, tables, kv.block_size, dev)
            return fn(ids, meta.positions, kv, meta, rows)

        want = step(model.forward)
        got = step(pieces.forward) if pieces.fits(tokens) else None
        _sync(dev)
        eager_ms = time_steps(lambda: step(model.forward), dev, steps)
        if got is None:
            print(f"  {label}: {name} ({tokens} tokens): eager {eager_ms:.3f} ms; past the "
                  f"largest bucket {pieces.max_tokens}", flush=True)
            continue
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        piece_ms = time_steps(lambda: step(pieces.forward), dev, steps)
        print(f"  {label}: {name} ({tokens} tokens, bucket {pieces.bucket_for(tokens)}): "
              f"eager {eager_ms:.3f} ms, piecewise {piece_ms:.3f} ms, "
              f"{eager_ms / piece_ms:.2f}x (logits rel err {err:.1e})", flush=True)
        out.append((name, tokens, eager_ms, piece_ms))
    return out


# the timed steps: prefill chunks of 128, 512 and 2048 tokens, and 64 decode rows
# at 512 tokens of context beside a 512-token chunk
GPU_PREFILL_CASES = (("prefill 128", 0, 0, 128), ("prefill 512", 0, 0, 512),
                     ("prefill 2048", 0, 0, 2048), ("mixed 64 + 512", 64, 512, 512))
TINY_PREFILL_CASES = (("prefill 16", 0, 0, 16), ("prefill 40", 0, 0, 40),
                      ("mixed 4 + 16", 4, 24, 16))
