"""gpu_check's correctness checks, each against its reference, each recording into a
``Report`` (gpu_check's): the Triton and flash-attn kernels against the torch reference,
sampling's penalties, logprobs and structured-output masks against the CPU, CUDA-graph
replay against the eager forward in every bucket, and the fused elementwise ops against
torch's. Needs only torch, triton and numpy, like gpu_check itself."""
from __future__ import annotations

import random

from scripts.gpu.timing import _decode_batch, _eager_decode, _eager_verify, _verify_batch


def _attention_case(*args, **kwargs):
    """Random q/k/v, caches and metadata (see kernels/testing.py)."""
    from kernels.testing import random_paged_case
    return random_paged_case(*args, **kwargs)


def _tolerance(dtype) -> float:
    import torch
    return 1e-4 if dtype == torch.float32 else 2e-2


def _compare_backend(report, label: str, backend, case, dtype) -> None:
    """Write K/V and attend with ``backend``; the reference is the torch backend in fp32 on
    the same (rounded) inputs."""
    import torch

    from kernels import torch_ref
    q, k, v, kc, vc, meta = case
    kc_ref, vc_ref = kc.clone(), vc.clone()
    torch_ref.write_kv(kc_ref, vc_ref, k, v, meta)
    scale = q.shape[-1] ** -0.5
    want = torch_ref.paged_attention(q.float(), kc_ref.float(), vc_ref.float(), meta, scale)
    backend.write_kv(kc, vc, k, v, meta)
    kv_ok = _same_bytes(kc, kc_ref) and _same_bytes(vc, vc_ref)
    got = backend.paged_attention(q, kc, vc, meta, scale).float()
    tol = _tolerance(dtype)
    err = (got - want).abs().max().item()
    ok = kv_ok and torch.allclose(got, want, rtol=tol, atol=tol)
    report.check(label, ok,
                 f"max|err|={err:.2e} tol={tol:g}" + ("" if kv_ok else " KV WRITE DIFFERS"))


def _same_bytes(a, b) -> bool:
    import torch
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _kernel_cases(rng: random.Random, tiny: bool):
    """(kind, block_size, kv_heads, group, query_lens, context_lens) for the kernel checks."""
    out = []
    for bs in (16,) if tiny else (16, 32):
        for kvh, group in ((3, 1), (3, 3)) if not tiny else ((2, 1), (1, 3)):
            top = 100 if tiny else 2000
            edges = [0, bs - 1, bs, 2 * bs + 1, rng.randrange(top // 4, top // 2),
                     rng.randrange(top // 2, top - 1)]
            out.append(("decode", bs, kvh, group, [1] * len(edges), edges))
            out.append(("prefill", bs, kvh, group, [1, bs + 1, rng.randrange(2, 40)],
                        [rng.randrange(0, 60), 0, rng.randrange(top // 2, top * 3 // 5)]))
            out.append(("mixed", bs, kvh, group, [1, 1, rng.randrange(2, 70), 1],
                        [rng.randrange(0, top), bs - 1, rng.randrange(0, top // 6), 2 * bs]))
    return out


def check_triton(report, device, dtypes, tiny: bool = False) -> None:
    import torch

    from kernels import torch_ref
    from kernels.testing import padded_decode_buffers
    from kernels.triton_paged import TritonBackend
    backend = TritonBackend()
    rng = random.Random(0)
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        for kind, bs, kvh, group, qls, cls in _kernel_cases(rng, tiny):
            case = _attention_case(rng, device, dtype, bs, kvh, group, qls, cls)
            _compare_backend(report, f"triton {kind:<7} {name:<8} block {bs} gqa {group} "
                             f"ctx<={max(cls)}", backend, case, dtype)
        if dtype == torch.bfloat16:       # fp8 caches (kv.dtype) under a bf16 model
            for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
                for kind, bs, kvh, group, qls, cls in _kernel_cases(rng, tiny)[:3]:
                    q, k, v, kc, vc, meta = _attention_case(rng, device, dtype, bs, kvh,
                                                            group, qls, cls)
                    case = (q, k * 300, v, kc.to(fp8), vc.to(fp8), meta)   # some saturate
                    _compare_backend(report, f"triton {kind:<7} {name} kv "
                                     f"{str(fp8).replace('torch.', '')} block {bs} gqa "
                                     f"{group}", backend, case, dtype)
        # decode from static buffers: fixed grid for max_seq_len, padding rows (slot -1)
        for bs, kvh, group in ((16, 3, 3), (32, 3, 1)):
            long_ctx = rng.randrange(40, 90) if tiny else rng.randrange(500, 900)
            contexts = [0, bs - 1, 3 * bs, long_ctx]
            n, pad, max_len = len(contexts), 3, 128 if tiny else 2048
            q, k, v, kc, vc, meta = _attention_case(rng, device, dtype, bs, kvh, group,
                                                    [1] * n, contexts)
            kc_ref, vc_ref = kc.clone(), vc.clone()
            torch_ref.write_kv(kc_ref, vc_ref, k, v, meta)
            scale = q.shape[-1] ** -0.5
            want = torch_ref.paged_attention(q.float(), kc_ref.float(), vc_ref.float(), meta,
                                             scale)
            b, width = n + pad, -(-max_len // bs)
            static = padded_decode_buffers(
                meta, contexts, pad, torch.zeros(b, width, dtype=torch.int32, device=device),
                max_len)
            extra = lambda t, pad=pad: torch.cat([t, torch.randn_like(t[:pad])])
            backend.write_kv(kc, vc, extra(k), extra(v), static)
            kv_ok = torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
            got = backend.paged_attention(extra(q), kc, vc, static, scale).float()
            tol = _tolerance(dtype)
            ok = kv_ok and torch.allclose(got[:n], want, rtol=tol, atol=tol) \
                and bool(torch.isfinite(got).all())
            report.check(f"triton static-decode {name:<8} block {bs} gqa {group} pad {pad}", ok,
                         f"max|err|={(got[:n] - want).abs().max().item():.2e}"
                         + ("" if kv_ok else " PAD ROWS WROTE KV"))


def check_triton_invariant(report, device, dtypes, tiny: bool = False) -> None:
    """A deterministic step's attention (``invariant=True``: every row through the prefill
    kernel, no FlashDecoding split): each row of decode, prefill and mixed steps is bitwise
    what it is alone, as a one-row step at its position; and the plain kernel is within
    tolerance of the torch reference there too."""
    import torch

    from kernels import torch_ref
    from kernels.testing import rows_alone
    from kernels.triton_paged import TritonBackend
    backend = TritonBackend()
    rng = random.Random(50)
    attend = lambda q, kc, vc, m: backend.paged_attention(q, kc, vc, m, q.shape[-1] ** -0.5,
                                                          invariant=True)
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        for kind, bs, kvh, group, qls, cls in _kernel_cases(rng, tiny)[:3]:
            q, k, v, kc, vc, meta = _attention_case(rng, device, dtype, bs, kvh, group, qls,
                                                    cls)
            backend.write_kv(kc, vc, k, v, meta)
            got = attend(q, kc, vc, meta)
            alone = rows_alone(attend, q, kc, vc, meta)
            want = torch_ref.paged_attention(q.float(), kc.float(), vc.float(), meta,
                                             q.shape[-1] ** -0.5)
            tol = _tolerance(dtype)
            differ = int((got.view(torch.uint8) != alone.view(torch.uint8)).reshape(
                got.shape[0], -1).any(1).sum())
            err = (got.float() - want).abs().max().item()
            report.check(f"triton invariant {kind:<7} {name:<8} block {bs} gqa {group}: "
                         f"rows alone == in the step",
                         differ == 0 and torch.allclose(got.float(), want, rtol=tol, atol=tol),
                         f"{differ} of {got.shape[0]} rows differ, max|err| vs torch "
                         f"{err:.2e}")


def check_flash_attn(report, device, tiny: bool = False) -> None:
    import torch

    from kernels import get_backend
    from kernels.flash_attn_backend import FlashAttnBackend, is_installed
    if not is_installed():
        print("  flash-attn: skipped: not installed", flush=True)
        return
    try:
        fa = FlashAttnBackend(block_size=256, dtype=torch.bfloat16, device=device)
    except ValueError as e:
        report.check("flash-attn adapter constructs (block 256, bf16)", False, str(e))
        return
    report.check("auto picks flash_attn for block 256 bf16",
                 get_backend("auto", device, block_size=256, dtype=torch.bfloat16).name
                 == "flash_attn")
    report.check("auto falls back to triton for block 16",
                 get_backend("auto", device, block_size=16, dtype=torch.bfloat16).name == "triton")
    rng = random.Random(1)
    for kind, _, kvh, group, qls, cls in _kernel_cases(rng, tiny):
        case = _attention_case(rng, device, torch.bfloat16, 256, kvh, group, qls, cls)
        _compare_backend(report, f"flash-attn {kind:<7} bf16 block 256 gqa {group}", fa, case,
                         torch.bfloat16)


def check_logit_processing(report, device) -> None:
    """Sampling penalties and logprobs (the executor's torch code, which a GPU runs) on
    ``device`` against the CPU's own path: the native logprobs kernel where it builds."""
    import types

    import torch

    from components.executor.sampling import Logprobs, RowPenalties, apply_penalties
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 49152, generator=g) * 3
    rows = [(r, torch.randint(0, 49152, (200,), generator=g).tolist(), 150,
             types.SimpleNamespace(presence=0.5, frequency=0.25 * r, repetition=1.0 + 0.1 * r,
                                   bias=[(r, 5.0), (49151, -3.0)],
                                   # min_tokens: 50 tokens of output so far, so a ban holds
                                   # on the even rows (60) and is over on the odd ones (50)
                                   min_tokens=60 - 10 * (r % 2), stop_ids=[2, 0]))
            for r in range(6)]

    def run(dev, native: bool):
        x = logits.to(dev, copy=True)      # (the same tensor on the CPU without copy)
        lp = Logprobs(x, [0, 2, 5], [3, 0, 5], will_change=True, native=native)
        apply_penalties(x, [(r, ids, pl, RowPenalties(pen)) for r, ids, pl, pen in rows])
        return x.cpu(), lp.lse.cpu(), torch.tensor(lp.top[0][2]), lp.top[1]

    want, got = run("cpu", True), run(device, False)
    banned = want[0].isneginf()                    # min_tokens' bans: -inf on both sides
    err = max((got[0] - want[0])[~banned].abs().max().item(),
              (got[1] - want[1]).abs().max().item(), (got[2] - want[2]).abs().max().item())
    same_bans = torch.equal(got[0].isneginf(), banned) and int(banned.sum()) == 6
    report.check("penalties and logprobs vs the CPU",
                 err < 1e-4 and got[3] == want[3] and same_bans,
                 f"max|err|={err:.1e}, {int(banned.sum())} banned")
    check_structured_masks(report, device, logits, g)


def check_structured_masks(report, device, logits, g) -> None:
    """Structured output's token masks applied by torch on ``device`` against the CPU's
    native kernel: a random mask, one allowing EOS alone, one allowing everything."""
    try:
        import numpy  # noqa: F401 - the masks are made in numpy arrays
        import torch

        from components.executor.constraints import apply_constraints
    except ImportError as exc:
        print(f"  skip structured-output masks: {exc}", flush=True)
        return

    class Fixed:                     # a language whose mask is given
        def __init__(self, words):
            self.words = words

        def fill(self, row) -> None:
            row[:] = self.words

    words = torch.randint(-2**31, 2**31, (3, 1536), generator=g, dtype=torch.int64).to(
        torch.int32)
    words[1] = 0
    words[1, 0] = 4                  # token 2 (EOS) alone
    words[2] = -1                    # every token
    rows = [(r, Fixed(words[j].numpy())) for j, r in enumerate((0, 3, 5))]
    want = logits.clone()
    apply_constraints(want, rows, native=True)
    got = logits.to(device, copy=True)
    apply_constraints(got, rows, native=False)
    got, masked = got.cpu(), want.isneginf()
    ok = torch.equal(got.isneginf(), masked) and torch.equal(got[~masked], want[~masked])
    report.check("structured-output masks vs the CPU", ok and int(masked[3].sum()) == 49151
                 and int(masked[5].sum()) == 0, f"{int(masked.sum())} masked")


def check_graphs(report, label: str, model, max_len: int, max_batch: int,
                 block_size: int, tol: float, partials=(3, 13, 250), seed: int = 0):
    """Capture every bucket, then per bucket (and a few padded sizes) compare replayed logits
    with the eager forward; padded batches must change no KV outside their own slots."""
    import torch

    from components.executor.cuda_graphs import DecodeGraphs
    num_blocks = max_batch * (-(-max_len // block_size) + 2)
    kv = model.new_kv_cache(num_blocks, block_size)
    kv.data.normal_()
    graphs = DecodeGraphs(model, kv, max_model_len=max_len, max_batch=max_batch)
    info = graphs.capture()
    print(f"  {label}: captured {len(info['buckets'])} buckets in {info['seconds']} s, pool "
          f"reserved {info['pool_reserved_bytes'] / 2**20:.1f} MiB, allocated "
          f"{info['pool_allocated_bytes'] / 2**20:.1f} MiB, static buffers "
          f"{info['static_bytes'] / 2**20:.1f} MiB", flush=True)
    rng = random.Random(seed)
    sizes = list(graphs.buckets) + [p for p in partials
                                    if p <= max_batch and p not in graphs.buckets]
    worst = 0.0
    for n in sizes:
        ids, pos, tables = _decode_batch(rng, n, max_len, block_size, num_blocks,
                                         model.spec.vocab_size)
        want = _eager_decode(model, kv, ids, pos, tables)
        padded = graphs.bucket_for(n) != n
        before = kv.data[0].clone() if padded else None
        got = graphs.replay(ids, pos, tables)
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        worst = max(worst, err)
        ok = err <= tol and bool(torch.isfinite(got).all())
        detail = f"rel err {err:.2e}"
        if before is not None:
            changed = (kv.data[0] != before).flatten(3).any(-1).any(0).flatten()  # per slot
            real = torch.zeros_like(changed)
            slots = [t[p // block_size] * block_size + p % block_size
                     for p, t in zip(pos, tables)]
            real[torch.tensor(slots, device=real.device)] = True
            stray = int((changed & ~real).sum())
            ok = ok and stray == 0
            detail += f", padded to {graphs.bucket_for(n)}, stray KV writes {stray}"
        report.check(f"{label} graph == eager, batch {n}", ok, detail)
    print(f"  {label}: worst relative logits error {worst:.2e} (tol {tol:g})", flush=True)
    return graphs, kv, info


def check_fused_elementwise(report, label: str, device, shape, weights,
                            tol: float) -> None:
    """The model on Triton's fused elementwise ops (the GPU's default plan) against the same
    weights on torch's ops: eager decode logits of 8 sequences, and the KV they wrote."""
    import torch

    from components.executor.build import build_model
    out = {}
    for e in ("triton", "torch"):
        model = build_model(shape, weights, dtype=torch.float32, device=device,
                            backend="triton", kernels={"elementwise": e})
        kv = model.new_kv_cache(8 * 15 + 1, 16)
        kv.data.normal_(generator=torch.Generator(device).manual_seed(3))
        ids, pos, tables = _decode_batch(random.Random(5), 8, 200, 16, kv.num_blocks,
                                         shape.vocab_size)
        out[e] = (_eager_decode(model, kv, ids, pos, tables), kv.data)
        del model
    (lt, kt), (lr, kr) = out["triton"], out["torch"]
    err = ((lt - lr).abs().max() / lr.abs().max().clamp_min(1e-6)).item()
    kv_err = (kt - kr).abs().max().item()
    report.check(f"{label} fused elementwise (triton) == torch ops", err <= tol and
                 kv_err <= tol, f"logits rel err {err:.2e}, KV max|err| {kv_err:.2e} "
                 f"tol {tol:g}")


def check_verify(report, label: str, device, shape, weights, tol: float, ks=(1, 2, 4),
                 rows: int = 6, max_len: int = 256, block_size: int = 16) -> None:
    """Speculative decoding's verify steps through the whole model on the Triton backend
    (eager, as the executor runs them): for each ``k``, ``rows`` sequences of ``1 + k`` new
    tokens (contexts from empty to ``max_len``, the new tokens straddling block edges)
    beside one plain decode row, logits at every new token. Against the same step on the
    torch reference (torch attention and elementwise ops, same weights and cache), and
    against the Triton model decoding the same tokens one step at a time (what accepting
    the drafts must reproduce); the KV both verify steps wrote is compared too."""
    import torch

    from components.executor.build import build_model
    tri = build_model(shape, weights, dtype=torch.float32, device=device, backend="triton")
    ref = build_model(shape, weights, dtype=torch.float32, device=device, backend="torch",
                      kernels={"elementwise": "torch"})
    num_blocks = (rows + 1) * (-(-max_len // block_size) + 2) + 1
    kv = tri.new_kv_cache(num_blocks, block_size)
    kv.data.normal_(generator=torch.Generator(device).manual_seed(4))
    noise = kv.data.clone()
    kv_ref, kv_seq = ref.new_kv_cache(num_blocks, block_size), tri.new_kv_cache(num_blocks,
                                                                                 block_size)
    rng = random.Random(17)
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
    for k in ks:
        ids, pos, tables = _verify_batch(rng, [k] * rows + [0], max_len, block_size,
                                         num_blocks, shape.vocab_size)
        for cache in (kv, kv_ref, kv_seq):
            cache.data.copy_(noise)
        got = _eager_verify(tri, kv, ids, pos, tables)
        want = _eager_verify(ref, kv_ref, ids, pos, tables)
        err, kv_err = rel(got, want), (kv.data - kv_ref.data).abs().max().item()
        steps = []      # one token at a time: step j decodes each row's token j at pos + j
        for j in range(1 + k):
            live = [i for i, r in enumerate(ids) if j < len(r)]
            logits = _eager_decode(tri, kv_seq, [ids[i][j] for i in live],
                                   [pos[i] + j for i in live], [tables[i] for i in live])
            steps.append(dict(zip(live, logits)))
        stepwise = torch.stack([steps[j][i] for i, r in enumerate(ids) for j in range(len(r))])
        seq_err = rel(got, stepwise)
        ok = (err <= tol and kv_err <= tol and seq_err <= tol
              and bool(torch.isfinite(got).all()))
        report.check(f"{label} verify k={k}: triton == torch reference == one token at a "
                     f"time", ok, f"{rows} rows of {1 + k} + 1 decode row, contexts "
                     f"{min(pos)}..{max(pos)}: logits rel err {err:.2e}, stepwise "
                     f"{seq_err:.2e}, KV max|err| {kv_err:.2e} (tol {tol:g})")
    del tri, ref
