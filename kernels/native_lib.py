"""The native CPU library: ``csrc/*.cpp`` compiled once per machine and loaded through ctypes.

The sources are compiled into one shared library with the system C++ compiler
(``-O3 -march=native -fopenmp``), cached under ``~/.cache/weir/kernels`` (or
``$WEIR_KERNEL_CACHE``) keyed by source, flags and CPU — no torch headers (the attention
kernels compile in three parts, in parallel: ~20 s on 2 cores, once per machine). The
library shares torch's OpenMP runtime (the same ``libgomp.so.1`` soname resolves to the
copy torch already loaded). Its wrappers live beside it by what they do:
:mod:`kernels.cpu_native` (attention, sampling, the fused elementwise ops) and
:mod:`kernels.cpu_linear` (the small-batch and AMX linear layers).

If no compiler is available or the build fails, :func:`build` raises ValueError and
callers fall back to torch.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

_CSRC = Path(__file__).with_name("csrc")
# the objects, compiled in parallel: the attention kernels in three parts, one family of
# cache types each (its instantiations were 31 s of a one-file build on 2 cores; ~15 s so)
_UNITS = [(_CSRC / "cpu_decode_attention.cpp", [f"-DWEIR_ATTN_PART={p}"]) for p in (1, 2, 3)] \
    + [(_CSRC / name, []) for name in ("cpu_sampling.cpp", "cpu_fused.cpp", "cpu_gemv.cpp",
                                       "cpu_forward.cpp")]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-std=c++17", "-shared",
          "-fPIC"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}     # q, out, activations
KV_DTYPES = {**DTYPES, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}   # the caches' too
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
    portable = variant()
    if portable != "native":
        flags.append("-mno-avx512f")
        if portable == "scalar":
            flags += ["-mno-avx2", "-mno-fma"]
    return flags


def variant() -> str:
    """Which build of the library this process loads: "native" (-march=native), or the one
    ``WEIR_CPU_KERNEL_PORTABLE`` names ("avx2": no AVX-512; "scalar": no AVX2 either), built
    on any machine for tests and for benches run as such a CPU would."""
    return os.environ.get("WEIR_CPU_KERNEL_PORTABLE") or "native"


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
        lib.weir_rope_write_kv.restype = ctypes.c_int
        lib.weir_rope_write_kv.argtypes = ([ctypes.c_int, ctypes.c_int, vp] + [i64] * 5
                                           + [vp] * 6 + [ctypes.c_int])
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
