"""Paged key/value cache storage: fixed-size blocks of token slots, one pool per layer."""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap

import torch

MADV_POPULATE_WRITE = 23          # Linux 5.14+

# The cache's element types besides the model's own (kv.dtype): fp8 holds a key or value
# element in one byte, so a decode step reads half the KV bytes and a pool of the same
# memory holds twice the tokens, at fp8's precision (E4M3: 3 mantissa bits, up to 448;
# E5M2: 2 bits, up to 57344). "fp8" is E4M3, as in vLLM.
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}
# each format's mantissa bits, exponent bias and largest finite code, for the writers'
# integer rounding (kernels/csrc/cpu_fp8.h, the Triton write); its largest value is
# torch.finfo's
FP8_FORMATS = {torch.float8_e4m3fn: (3, 7, 0x7E), torch.float8_e5m2: (2, 15, 0x7B)}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_FORMATS


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for ``kv.dtype`` ``name``: "auto" is the model's."""
    if name == "auto":
        return model_dtype
    if name not in FP8_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}; have auto, {', '.join(FP8_DTYPES)}")
    return FP8_DTYPES[name]


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: fp8 rounds to nearest even and saturates at the
    format's largest finite value (no infinities; NaN stays NaN); other types cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    m = torch.finfo(dtype).max
    return x.float().clamp(-m, m).to(dtype)


def populate(t: torch.Tensor) -> str:
    """Fault in every page of a CPU tensor's memory now, so that the first write to each
    block is not a page fault inside a step: one ``madvise(MADV_POPULATE_WRITE)`` where the
    kernel has it (returns "madvise"), else a write of each page's first byte, which keeps
    the values (returns "touch")."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return "none"
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(start, t.data_ptr() + nbytes - start, MADV_POPULATE_WRITE) == 0:
            return "madvise"
    except (OSError, AttributeError):
        pass
    flat = t.view(-1).view(torch.uint8)
    firsts = flat[(-t.data_ptr()) % page::page]      # one byte in each page
    firsts.copy_(firsts.clone())
    return "touch"


def zeroed_cpu(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor on a private anonymous mapping (page-aligned; its pages are
    the kernel's zero page until first written). The tensor keeps the mapping alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


class KVCache:
    """Keys and values for every layer, in one tensor of shape
    ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.

    Slot ``s`` of a layer is token ``s % block_size`` of block ``s // block_size``.
    """

    def __init__(self, data: torch.Tensor):
        if data.dim() != 6 or data.shape[1] != 2:
            raise ValueError(f"bad KV cache shape {tuple(data.shape)}")
        self.data = data

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> KVCache:
        """Allocate a zero-filled cache once; its size never changes afterwards. On the CPU
        its memory is an anonymous mapping: zero pages the kernel hands out as blocks are
        first written, so a pool of gigabytes costs nothing at startup (``torch.zeros``
        wrote 1.5 GB in 0.4-0.6 s on 2 cores) and the process holds only the blocks used."""
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        if torch.device(device).type != "cpu":
            return cls(torch.zeros(shape, dtype=dtype, device=device))
        return cls(zeroed_cpu(shape, dtype))

    @property
    def num_layers(self) -> int:
        return self.data.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    @property
    def block_size(self) -> int:
        return self.data.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def key(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys: a view ``[num_blocks, block_size, kv_heads, head_dim]``."""
        return self.data[layer, 0]

    def value(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s values, shaped like :meth:`key`."""
        return self.data[layer, 1]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks ``src[i] -> dst[i]`` in every layer (keys and values).

        All sources are read before any destination is written.
        """
        if len(src) != len(dst):
            raise ValueError("src and dst must have the same length")
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.data.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.data.device)
        data = self.data.view(torch.uint8) if is_fp8(self.dtype) else self.data
        data[:, :, d] = data[:, :, s]
