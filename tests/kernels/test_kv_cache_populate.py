"""Faulting the CPU KV pool in at startup (kv.prefault): every page is resident afterwards
and the values are kept, by madvise where the kernel has MADV_POPULATE_WRITE and by a write
per page where it does not."""
import mmap

import torch

from kernels import kv_cache
from kernels.kv_cache import populate, zeroed_cpu


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of ``t`` the process holds (mincore on its range)."""
    import ctypes
    import ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = ctypes.create_string_buffer(-(-length // page))
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


def _check(t: torch.Tensor) -> str:
    pages = -(-t.numel() * t.element_size() // mmap.PAGESIZE)
    t.view(-1)[12345] = 7.0                                  # one page written before
    assert _resident_pages(t) < pages // 2                   # the rest are not yet held
    how = populate(t)
    assert _resident_pages(t) == pages
    assert t.view(-1)[12345] == 7.0 and t.view(-1)[:12345].abs().sum() == 0
    return how


def test_populate_faults_in_every_page_and_keeps_the_values():
    t = zeroed_cpu((64, 2, 16, 3, 64), torch.bfloat16)      # 768 KB: 192 pages
    assert _check(t) in ("madvise", "touch")


def test_populate_without_madvise_touches_each_page(monkeypatch):
    monkeypatch.setattr(kv_cache, "MADV_POPULATE_WRITE", -1)    # refused: EINVAL
    t = zeroed_cpu((64, 2, 16, 3, 64), torch.float32)
    assert _check(t) == "touch"
