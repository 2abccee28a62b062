"""Keep the memory a training step frees for the next step, instead of returning it to the kernel.

A training step allocates and frees the same tens of MB of activations, gradients and
temporaries every iteration. glibc's ``malloc`` hands freed memory back to the kernel: blocks
above its mmap threshold (128 KiB at first, raised adaptively up to 32 MiB) are unmapped when
freed, and the top of the heap is trimmed once more than the trim threshold is free. The next
step then touches fresh pages, and each first touch is a page fault that zeroes the page.
Measured on the dev VM (2-stage GPT at the overhead benchmark's size, 4 layers of width 384):
~3200 minor faults per step per rank (``perf record -e minor-faults``); with the memory kept,
0.4-1.3 per step per training thread (the overhead benchmark's thread counters, 150 rounds). On
a VM whose balloon reports free pages to the host (virtio-balloon ``free page reporting``, on
there), a returned page can also be taken away by the host, and its next touch faults on the
host as well.

:func:`keep_freed_memory` raises both thresholds (``mallopt``), so freed blocks stay in the heap
and are reused: the process keeps its peak footprint, as PyTorch's CUDA caching allocator does
on a GPU. Training ranks call it at start-up (``TrainConfig.keep_heap``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["KEEP_BYTES", "keep_freed_memory"]

KEEP_BYTES = 1 << 30
"""Both thresholds: blocks up to 1 GiB come from the heap, and the heap is trimmed only when
more than 1 GiB of its top is free. (``mallopt`` takes a C ``int``: 2**31 and more would wrap.)"""

_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    # mallopt exists elsewhere too (musl accepts and ignores it); only glibc's is known here.
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def keep_freed_memory() -> bool:
    """Make this process's ``malloc`` keep freed memory for reuse (see the module docstring).

    Applies to allocations made after the call, on every thread; threads and processes forked
    later inherit it. Safe to call more than once.

    Returns:
        True if both thresholds were set; False where the C library is not glibc (nothing changed).
    """
    libc = _glibc()
    if libc is None:
        return False
    # Either call also turns glibc's adaptive thresholds off.
    mmap_ok = libc.mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES) == 1
    trim_ok = libc.mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES) == 1
    return mmap_ok and trim_ok
