"""Native CPU kernels: paged decode attention (the ``cpu`` attention backend; the torch
reference does everything else) and token sampling.

``csrc/*.cpp`` are compiled into one library once per machine with the system C++
compiler (``-O3 -march=native -fopenmp``), cached under ``~/.cache/weir/kernels`` (or
``$WEIR_KERNEL_CACHE``) keyed by source, flags and CPU, and called through ctypes — no
torch headers (the attention kernels compile in three parts, in parallel: ~20 s on 2
cores, once per machine). It reads each sequence's keys and values
straight from its blocks (no gather into a padded copy) and shares torch's OpenMP runtime
(the same ``libgomp.so.1`` soname resolves to the copy torch already loaded).

If no compiler is available or the build fails, the backend refuses (ValueError) and
``get_backend("auto")`` falls back to ``torch``.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import torch_ref
from kernels.kv_cache import is_fp8
from kernels.metadata import AttentionMetadata

_CSRC = Path(__file__).with_name("csrc")
# the objects, compiled in parallel: the attention kernels in three parts, one family of
# cache types each (its instantiations were 31 s of a one-file build on 2 cores; ~15 s so)
_UNITS = [(_CSRC / "cpu_decode_attention.cpp", [f"-DWEIR_ATTN_PART={p}"]) for p in (1, 2, 3)] \
    + [(_CSRC / name, []) for name in ("cpu_sampling.cpp", "cpu_fused.cpp", "cpu_gemv.cpp",
                                       "cpu_forward.cpp")]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=c++17", "-shared",
          "-fPIC"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_KV_DTYPES = {**_DTYPES, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}   # the caches' too
_lib: ctypes.CDLL | None = None


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise ValueError("no C++ compiler found for the native CPU attention kernel")
    return cxx


def _flags() -> list[str]:
    flags = list(_FLAGS)
    # the kernels other CPUs run, built here for tests: "avx2" (no AVX-512), "scalar" (no
    # AVX2 either: what the compiler vectorizes by itself)
    portable = os.environ.get("WEIR_CPU_KERNEL_PORTABLE")
    if portable:
        flags.append("-mno-avx512f")
        if portable == "scalar":
            flags += ["-mno-avx2", "-mno-fma"]
    return flags


def build_key(cxx: str | None = None, flags: list[str] | None = None) -> str:
    """What the library is built from: its sources, the compiler, the flags and the CPU. A
    kernel choice measured on one build says nothing about another (autotune's cache)."""
    source = b"".join(p.read_bytes() for p in sorted(_CSRC.iterdir()) if p.suffix in (".cpp", ".h"))
    blob = " ".join([cxx or _compiler(), *(flags or _flags()), _cpu_key()]).encode()
    return hashlib.sha256(source + blob).hexdigest()[:16]


def build() -> Path:
    """Compile (or find the cached) shared library; raises ValueError if it cannot."""
    cxx, flags = _compiler(), _flags()
    key = build_key(cxx, flags)
    cache = Path(os.environ.get("WEIR_KERNEL_CACHE") or Path.home() / ".cache/weir/kernels")
    target = cache / f"weir_cpu_{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    compile_flags = [f for f in flags if f != "-shared"] + ["-c"]
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / target.name
        objs = [Path(tmp) / f"{i}_{src.stem}.o" for i, (src, _) in enumerate(_UNITS)]
        procs = [subprocess.Popen([cxx, *compile_flags, *extra, str(src), "-o", str(obj)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for (src, extra), obj in zip(_UNITS, objs)]
        errors = [err for p in procs if (err := p.communicate()[1]) and p.returncode != 0]
        if not errors:
            link = subprocess.run([cxx, *flags, *map(str, objs), "-o", str(out)],
                                  capture_output=True, text=True)
            errors = [link.stderr] if link.returncode != 0 else []
        if errors:
            raise ValueError(f"building the native CPU attention kernel failed: "
                             f"{errors[0][-2000:]}")
        os.replace(out, target)                  # atomic: concurrent builders agree
    return target


def load() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(build()))
        f = lib.weir_decode_attention
        f.restype = ctypes.c_int
        f.argtypes = ([ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 5
                      + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
                      + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int])
        lib.weir_amx_supported.restype = ctypes.c_int
        lib.weir_amx_supported.argtypes = []
        s = lib.weir_sample
        s.restype = None
        s.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 6
                      + [ctypes.c_int])
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        lib.weir_gemv_supported.restype = ctypes.c_int
        lib.weir_gemv_supported.argtypes = []
        lib.weir_gemv_bf16.restype = ctypes.c_int
        lib.weir_gemv_bf16.argtypes = [vp, i64, vp, vp, vp, i64, i64, i64, ctypes.c_int]
        lib.weir_gemm_amx_bf16.restype = ctypes.c_int
        lib.weir_gemm_amx_bf16.argtypes = [vp, i64, vp, vp, vp, i64, i64, i64, ctypes.c_int]
        lib.weir_gemm_amx_bf16_f32.restype = ctypes.c_int
        lib.weir_gemm_amx_bf16_f32.argtypes = [vp, i64, vp, vp, vp, i64, i64, i64, ctypes.c_int]
        lib.weir_gemm_amx_bf16_argmax.restype = ctypes.c_int
        lib.weir_gemm_amx_bf16_argmax.argtypes = [vp, i64, vp, vp, vp, i64, i64, i64,
                                                  ctypes.c_int]
        lib.weir_gemm_amx_bf16_silu_mul.restype = ctypes.c_int
        lib.weir_gemm_amx_bf16_silu_mul.argtypes = [vp, i64, vp, vp, i64, i64, i64,
                                                    ctypes.c_int]
        lib.weir_gemv_f32.restype = ctypes.c_int
        lib.weir_gemv_f32.argtypes = [vp, i64, vp, vp, vp, i64, i64, i64, ctypes.c_int]
        lib.weir_argmax.restype = None
        lib.weir_argmax.argtypes = [vp, i64, i64, vp, ctypes.c_int]
        lib.weir_apply_bitmask.restype = None
        lib.weir_apply_bitmask.argtypes = [vp, i64, vp, i64, vp, i64, ctypes.c_int]
        lib.weir_logprobs.restype = None
        lib.weir_logprobs.argtypes = [vp, i64, i64, i64, vp, vp, vp, ctypes.c_int]
        lib.weir_add_rms_norm.restype = None
        lib.weir_add_rms_norm.argtypes = [ctypes.c_int, vp, vp, vp, vp, i64, i64, ctypes.c_float,
                                          ctypes.c_int]
        lib.weir_rope.restype = None
        lib.weir_rope.argtypes = [ctypes.c_int, vp, i64, i64, i64, i64, vp, vp, vp, ctypes.c_int]
        lib.weir_write_kv.restype = None
        lib.weir_write_kv.argtypes = [vp, vp, i64, vp, vp, i64, vp, i64]
        lib.weir_write_kv_fp8.restype = ctypes.c_int
        lib.weir_write_kv_fp8.argtypes = [ctypes.c_int, ctypes.c_int, vp, vp, i64, vp, vp, i64,
                                          vp, i64]
        lib.weir_silu_mul.restype = None
        lib.weir_silu_mul.argtypes = [ctypes.c_int, vp, vp, i64, i64, ctypes.c_int]
        lib.weir_forward_layers.restype = ctypes.c_int
        lib.weir_forward_layers.argtypes = [vp, i64, vp]
        lib.weir_linear_chain.restype = ctypes.c_int
        lib.weir_linear_chain.argtypes = [vp, i64, ctypes.c_int32, vp, i64, vp, i64,
                                          ctypes.c_int32]
        _lib = lib
    return _lib


def available() -> bool:
    """Whether the native library builds and loads here (False: no compiler, or it failed;
    callers fall back to torch)."""
    try:
        load()
    except (ValueError, OSError):
        return False
    return True


def amx_supported() -> bool:
    """Whether the library has the AMX attention kernel and this process may use the
    tiles (built for a CPU with AMX-BF16; Linux granted the tile state)."""
    return available() and bool(load().weir_amx_supported())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, amx: bool = False) -> torch.Tensor:
    """Every new token at once, decode and prefill alike: the token at position p attends
    keys 0..p of its sequence (causal), read in place from the blocks. ``q``'s rows may be
    apart (a view into the fused qkv projection); its heads must be packed. ``amx``: the
    AMX kernel (bf16, block size a multiple of 16, :func:`amx_supported`). The caches are
    q's dtype, or fp8 (widened as read)."""
    if q.dtype not in _DTYPES or not (k_cache.dtype == q.dtype or is_fp8(k_cache.dtype)):
        raise ValueError(f"native attention needs q in one of {list(_DTYPES)} and the cache "
                         f"in q's dtype or fp8, not {q.dtype} and {k_cache.dtype}")
    if not (q.stride(2) == 1 and q.stride(1) == q.shape[2] and k_cache.is_contiguous()
            and v_cache.is_contiguous()):
        raise ValueError("native attention needs q's heads packed and contiguous caches")
    out = q.new_empty(q.shape)
    seqs, row_lens, tables = kernel_rows(meta)
    heads, dim = q.shape[1], q.shape[2]
    rc = load().weir_decode_attention(
        _DTYPES[q.dtype], _KV_DTYPES[k_cache.dtype], q.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), out.data_ptr(), seqs.data_ptr(), q.shape[0], tables.data_ptr(),
        tables.shape[1], row_lens.data_ptr(),
        heads, q.stride(0), k_cache.shape[2], dim, k_cache.shape[1], scale,
        torch.get_num_threads(), int(amx))
    if rc != 0:
        raise ValueError(f"native attention refused shapes: heads {heads}, kv heads "
                         f"{k_cache.shape[2]}, dim {dim}")
    return out


def kernel_rows(meta: AttentionMetadata):
    """The kernel's per-step arguments for every row of ``meta`` (:func:`_kernel_rows`),
    built once per step, not per layer."""
    args = meta.derived.get("cpu")
    if args is None:
        args = meta.derived["cpu"] = _kernel_rows(meta.token_seq, meta.positions, meta)
    return args


def _kernel_rows(token_seq: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
    """The kernel's per-step arguments for these rows: each row's sequence, its key count
    (position + 1), and the block tables."""
    return (token_seq.contiguous(), (positions + 1).to(torch.int32),
            meta.block_tables.contiguous())


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """:func:`torch_ref.write_kv` natively: rows of ``k``/``v`` [T, kv_heads, dim] may be
    views with a row stride (the fused qkv projection); other layouts go through torch. An
    fp8 cache gets the rows rounded as :func:`~kernels.kv_cache.quantize` rounds them."""
    row = k.shape[1] * k.shape[2]
    fp8 = is_fp8(k_cache.dtype) and k.dtype in _DTYPES
    if not ((k.dtype == k_cache.dtype or fp8) and k.dtype == v.dtype and k.shape == v.shape
            and k.stride(0) == v.stride(0) and k.stride(1) == k.shape[2] and k.stride(2) == 1
            and v.stride(1) == v.shape[2] and v.stride(2) == 1 and k_cache.is_contiguous()
            and v_cache.is_contiguous() and meta.slot_mapping.dtype == torch.long
            and row == k_cache.shape[2] * k_cache.shape[3]):
        return torch_ref.write_kv(k_cache, v_cache, k, v, meta)
    size = k.element_size()
    slots = meta.slot_mapping.contiguous()
    if fp8:
        load().weir_write_kv_fp8(_DTYPES[k.dtype], _KV_DTYPES[k_cache.dtype], k.data_ptr(),
                                 v.data_ptr(), k.stride(0), k_cache.data_ptr(),
                                 v_cache.data_ptr(), row, slots.data_ptr(), slots.numel())
        return
    load().weir_write_kv(k.data_ptr(), v.data_ptr(), k.stride(0) * size, k_cache.data_ptr(),
                         v_cache.data_ptr(), row * size, slots.data_ptr(), slots.numel())


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, u: torch.Tensor, keys: torch.Tensor | None = None
           ) -> torch.Tensor:
    """One token per row of float32 ``logits`` [S, vocab] (every temperature > 0): top-k,
    then top-p on the renormalised survivors, then a row with ``keys[r]`` >= 0 by the
    exponential race seeded by it, another by the inverse-CDF draw at ``u[r]``."""
    x = logits.contiguous()
    t = temperature.to(torch.float32).contiguous()
    k = top_k.to(torch.int64).contiguous()
    p = top_p.to(torch.float32).contiguous()
    uu = u.to(torch.float32).contiguous()
    kk = (torch.full((x.shape[0],), -1, dtype=torch.int64) if keys is None
          else keys.to(torch.int64).contiguous())
    out = torch.empty(x.shape[0], dtype=torch.int64)
    load().weir_sample(x.data_ptr(), x.shape[0], x.shape[1], t.data_ptr(), k.data_ptr(),
                       p.data_ptr(), uu.data_ptr(), kk.data_ptr(), out.data_ptr(),
                       torch.get_num_threads())
    return out


SMALL_BATCH_MAX = 256     # beyond this oneDNN's blocked GEMM is as fast or faster
_GEMV_BITS = {torch.bfloat16: 1, torch.float32: 2}


def small_batch_supported(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this CPU runs the small-batch linear kernel for ``dtype``: bf16 with
    AVX512-BF16 or AVX2 + FMA, float32 with AVX2 + FMA (csrc/cpu_gemv.cpp)."""
    return bool(load().weir_gemv_supported() & _GEMV_BITS.get(dtype, 0))


def small_batch_fits(dtype: torch.dtype, n: int, k: int) -> bool:
    """Whether a weight [N, K] of ``dtype`` has a small-batch layout: N % 16, and for bf16
    K % 2 (its k-pairs)."""
    return n % 16 == 0 and (dtype == torch.float32 or (dtype == torch.bfloat16 and k % 2 == 0))


def pack_small_batch(w: torch.Tensor) -> torch.Tensor | None:
    """A weight [N, K] in the small-batch kernel's layout: bf16 [N/16, K/2, 16, 2], float32
    [N/16, K, 16]; None when its dtype or shape does not fit (:func:`small_batch_fits`)."""
    n, k = w.shape
    if not small_batch_fits(w.dtype, n, k):
        return None
    if w.dtype == torch.bfloat16:
        return w.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.reshape(n // 16, 16, k).permute(0, 2, 1).contiguous()


def amx_linear_fits(dtype: torch.dtype, n: int, k: int) -> bool:
    """Whether a weight [N, K] runs on the AMX tiles (:func:`small_batch_linear` with
    ``tiles="amx"``): bf16, N % 16, K % 32, and a CPU and process with AMX."""
    return dtype == torch.bfloat16 and n % 16 == 0 and k % 32 == 0 and amx_supported()


def amx_silu_mul_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``silu_mul(F.linear(x, w))`` for a fused gate_up weight ``w`` [2 * inter, K] packed
    by ``pack_small_batch``, on AMX tiles in one pass: [M, inter], equal to the bit to
    :func:`small_batch_linear` (``tiles="amx"``) then :func:`silu_mul`, without the
    [M, 2 * inter] intermediate. bf16, and ``amx_linear_fits`` for the weight."""
    nb = packed.shape[0]
    k, inter = packed.shape[1] * 2, nb * 8
    y = x.new_empty(x.shape[0], inter)
    if x.shape[0] == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16 or packed.dim() != 4 \
            or nb % 2:
        raise ValueError(f"the fused AMX gate_up runs a bf16 gate_up weight, not {x.dtype} "
                         f"rows against {packed.dtype} {tuple(packed.shape)}")
    rc = load().weir_gemm_amx_bf16_silu_mul(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                            y.data_ptr(), x.shape[0], inter, k,
                                            torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the fused AMX gate_up refused {tuple(x.shape)} x {2 * inter}")
    return y


def small_batch_linear(x: torch.Tensor, packed: torch.Tensor,
                       bias: torch.Tensor | None = None, tiles: str = "vector",
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for ``x`` [M, K] against ``pack_small_batch(w)``, of the
    same dtype; M = 0 gives an empty [0, N] (as ``F.linear`` does). ``tiles="amx"``: the
    bf16 weights through AMX tile multiplies (:func:`amx_linear_fits`), any M at one pass
    over the weights; "vector": vdpbf16ps (or AVX2) rows against the same layout.
    ``out_dtype=torch.float32`` (AMX only): each output rounded to bf16 as always, then
    written widened, which is ``.float()`` of the bf16 result without a second pass (the
    lm_head's logits)."""
    nb = packed.shape[0]
    k = packed.shape[1] * 2 if packed.dim() == 4 else packed.shape[1]
    if out_dtype not in (None, x.dtype) and (tiles != "amx" or out_dtype != torch.float32):
        raise ValueError(f"small-batch linear: no {out_dtype} output for {tiles} tiles")
    y = x.new_empty(x.shape[0], nb * 16, dtype=out_dtype or x.dtype)
    if x.shape[0] == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dtype != packed.dtype or (bias is not None and bias.dtype != packed.dtype):
        raise ValueError(f"small-batch linear: {x.dtype} rows against {packed.dtype} weights")
    lib = load()
    run = lib.weir_gemv_bf16 if packed.dtype == torch.bfloat16 else lib.weir_gemv_f32
    if tiles == "amx":
        if packed.dtype != torch.bfloat16:
            raise ValueError(f"the AMX linear runs bf16 weights, not {packed.dtype}")
        run = lib.weir_gemm_amx_bf16_f32 if y.dtype == torch.float32 else \
            lib.weir_gemm_amx_bf16
    if bias is not None:
        bias = bias.contiguous()
    rc = run(x.data_ptr(), x.stride(0), packed.data_ptr(),
             None if bias is None else bias.data_ptr(), y.data_ptr(),
             x.shape[0], nb * 16, k, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"small-batch linear refused {tuple(x.shape)} x {nb * 16}")
    return y


def amx_argmax_linear(x: torch.Tensor, packed: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``argmax(small_batch_linear(x, packed, bias, "amx", torch.float32))`` without the
    logits: [M] int64, each row's first maximum (greedy decoding's lm_head; 64 x 49k logits
    are 12.6 MB written, then read again). bf16, and ``amx_linear_fits`` for the weight."""
    nb = packed.shape[0]
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0] == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16 or packed.dim() != 4 \
            or (bias is not None and bias.dtype != torch.bfloat16):
        raise ValueError(f"the AMX argmax linear runs bf16 rows and weights, not {x.dtype} "
                         f"against {packed.dtype}")
    if bias is not None:
        bias = bias.contiguous()
    rc = load().weir_gemm_amx_bf16_argmax(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                          None if bias is None else bias.data_ptr(),
                                          out.data_ptr(), x.shape[0], nb * 16,
                                          packed.shape[1] * 2, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the AMX argmax linear refused {tuple(x.shape)} x {nb * 16}")
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for float32 rows [S, vocab] (first maximum), rows in parallel:
    64 x 49k rows in ~0.2 ms where torch takes ~1.5 ms on 2 cores."""
    x = logits.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    load().weir_argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(),
                       torch.get_num_threads())
    return out


def apply_bitmask(logits: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor) -> None:
    """Structured output: in float32 ``logits`` [S, vocab] (contiguous; in place), row
    ``rows[j]``'s tokens whose bit is clear in ``masks[j]`` (int32 [n, words], token ``t``
    bit ``t % 32`` of word ``t // 32``) to -inf."""
    assert logits.is_contiguous() and logits.dtype == torch.float32
    assert masks.dtype == torch.int32 and masks.is_contiguous() and rows.dtype == torch.int64
    assert masks.shape[1] * 32 >= logits.shape[1] and masks.shape[0] == rows.numel()
    load().weir_apply_bitmask(logits.data_ptr(), logits.shape[1], masks.data_ptr(),
                              masks.shape[1], rows.data_ptr(), rows.numel(),
                              torch.get_num_threads())


def logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For float32 rows [S, vocab]: each row's log-sum-exp [S], and its ``k``
    largest logits [S, k] and their ids [S, k], largest first (ties: the earlier id)."""
    x = logits.contiguous()
    rows = x.shape[0]
    lse = torch.empty(rows, dtype=torch.float32)
    vals = torch.empty(rows, k, dtype=torch.float32)
    ids = torch.empty(rows, k, dtype=torch.int64)
    load().weir_logprobs(x.data_ptr(), rows, x.shape[1], k, lse.data_ptr(), ids.data_ptr(),
                         vals.data_ptr(), torch.get_num_threads())
    return lse, vals, ids


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 out: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` (in place, if given), then ``out = rmsnorm(h) * weight``; rows of
    ``h`` [T, hidden] contiguous, all in one dtype (float32 or bfloat16)."""
    load().weir_add_rms_norm(_DTYPES[h.dtype], h.data_ptr(),
                             None if delta is None else delta.contiguous().data_ptr(),
                             weight.data_ptr(), out.data_ptr(), h.shape[0], h.shape[1], eps,
                             torch.get_num_threads())
    return out


def rope_(qkv: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor,
          cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place on the first ``heads`` heads of each contiguous qkv row;
    ``cos``/``sin`` float32 tables [max_position, head_dim]."""
    pos = positions.contiguous()
    load().weir_rope(_DTYPES[qkv.dtype], qkv.data_ptr(), qkv.shape[0], qkv.stride(0), heads,
                     head_dim, pos.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                     torch.get_num_threads())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for contiguous fused rows [T, 2 * inter]."""
    inter = gate_up.shape[1] // 2
    out = gate_up.new_empty(gate_up.shape[0], inter)
    load().weir_silu_mul(_DTYPES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(),
                         gate_up.shape[0], inter, torch.get_num_threads())
    return out


class CpuBackend:
    """Every token through the native kernel (decode and prefill), the torch reference for
    shapes not compiled in. With ``fresh_prompts = "sdpa"`` (the executor's plan sets it
    where it measured faster), the rows of a prompt whose first chunk is in this step (no
    cached context: its keys are exactly this step's new keys) go through torch's fused
    causal attention on the new keys and values instead; on the 2-core AMX Xeon that was
    2x the vector kernel for 16 x 128-token prompts (oneDNN's tiles vs. its dot products).
    ``tiles = "amx"`` (the plan sets it where it measured faster) runs the paged kernel's
    q.k and P.V on the AMX tile unit (bf16 with blocks of a multiple of 16 keys; other
    steps keep the vector kernel): there it beats SDPA on those prompts (1.2 against 2.0
    ms a layer for 16 x 128)."""

    name = "cpu"
    takes_new_kv = True              # the model passes this step's k, v to paged_attention
    FRESH_MIN = 16                   # shorter fresh prompts stay on the native kernel

    def __init__(self, dtype: torch.dtype | None = None, **_opts) -> None:
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"the native CPU kernel supports {list(_DTYPES)}, not {dtype}")
        load()
        self.write_kv = write_kv
        self.fresh_prompts = "native"
        self.tiles = "vector"            # the paged kernel: "vector", or "amx" (bf16 only)

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        fp8 = is_fp8(k_cache.dtype)
        native = supports(q.shape[1], k_cache.shape[2], q.shape[2]) and (
            q.dtype == k_cache.dtype or fp8)
        if not (native and meta.token_seq is not None):
            return torch_ref.paged_attention(q, k_cache, v_cache, meta, scale)
        # (an fp8 cache: every row reads the stored keys, so a prompt attends the same
        # rounded keys whether its first chunk is fresh, cached or chunked)
        fresh = self._fresh(meta) if new_kv is not None and self.fresh_prompts == "sdpa" \
            and not fp8 else None
        amx = self.tiles == "amx" and q.dtype == torch.bfloat16 and k_cache.shape[1] % 16 == 0
        if not fresh:
            return paged_attention(q, k_cache, v_cache, meta, scale, amx)
        groups, rest = fresh
        k, v = new_kv
        out = q.new_empty(q.shape)
        for a, n, length in groups:   # n prompts of one length, rows a .. a + n * length
            def batch(x):             # [n * L, H, D] -> [n, H, L, D], a view
                return x[a:a + n * length].view(n, length, *x.shape[1:]).transpose(1, 2)
            o = F.scaled_dot_product_attention(batch(q), batch(k), batch(v), is_causal=True,
                                               scale=scale, enable_gqa=True)  # GQA inside
            batch(out).copy_(o)
        if rest is not None:
            sub = meta.derived["cpu_rest"]
            out[rest] = paged_attention(q[rest].contiguous(), k_cache, v_cache, sub, scale, amx)
        return out

    def paged_only(self, meta: AttentionMetadata) -> bool:
        """Whether :meth:`paged_attention` runs every row of this step through the paged
        kernel (no fresh prompt through SDPA): what the native layer loop runs."""
        return self.fresh_prompts != "sdpa" or self._fresh(meta) is None

    def _fresh(self, meta: AttentionMetadata):
        """Once per step: the fresh prompts (no cached context, at least FRESH_MIN tokens)
        as groups ``(first row, prompts, length)`` of neighbouring prompts of one length
        (one SDPA call each: on 2 AMX cores, 16 x 128 tokens at once is 1.4 ms a layer
        against 2.0 as 16 calls), and the rows left for the native kernel (None if none),
        with a metadata view of those rows."""
        if "cpu_fresh" not in meta.derived:
            starts = meta.query_start_loc.tolist()
            spans = [(starts[i], starts[i + 1]) for i, (c, n) in
                     enumerate(zip(meta.context_lens, meta.query_lens))
                     if c == 0 and n >= self.FRESH_MIN]
            groups: list[list[int]] = []
            for a, b in spans:
                last = groups[-1] if groups else None
                if last and last[2] == b - a and last[0] + last[1] * last[2] == a:
                    last[1] += 1
                else:
                    groups.append([a, 1, b - a])
            rest = None
            if spans and sum(b - a for a, b in spans) < meta.num_tokens:
                keep = torch.ones(meta.num_tokens, dtype=torch.bool)
                for a, b in spans:
                    keep[a:b] = False
                rest = keep.nonzero().squeeze(1)
                meta.derived["cpu_rest"] = dataclasses.replace(meta, derived={
                    "cpu": _kernel_rows(meta.token_seq[rest], meta.positions[rest], meta)})
            meta.derived["cpu_fresh"] = ([tuple(g) for g in groups], rest) if spans else None
        return meta.derived["cpu_fresh"]


def supports(heads: int, kv_heads: int, head_dim: int) -> bool:
    """The shapes compiled into the kernel (others decode through the torch reference)."""
    return (head_dim in (64, 128) and heads <= 64 and heads % kv_heads == 0
            and 1 <= heads // kv_heads <= 8)
