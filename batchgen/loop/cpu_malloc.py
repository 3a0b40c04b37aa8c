"""Keep glibc's malloc from handing a CPU forward pass's large buffers back to the kernel between rounds.

A forward on the CPU allocates and frees tens of megabytes of activations per layer (a prefill chunk's
``[rows, intermediate]`` float32 GEMM outputs). glibc's malloc serves such sizes with a fresh ``mmap`` (its
threshold starts at 128 KiB and only adapts upwards as chunks are freed) and trims the heap's top once more than
twice that is free, so every round touches new pages: on SmolLM2-135M, a 16 x 144-token prefill took 193,000-313,000
minor page faults (300 ms of 4.5-5 s) and none with the thresholds fixed. Fixing them (``mallopt``, what the
``GLIBC_TUNABLES`` ``glibc.malloc.mmap_threshold`` / ``trim_threshold`` settings do at startup) keeps freed memory
in the heap for the next round; the process's peak memory is unchanged, its resident memory stays near the peak.
"""

from __future__ import annotations

import ctypes
import functools

from batchgen.environment import malloc_tuned_by_user

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: allocations above it are mmap'd whatever the setting
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Fix glibc's mmap threshold at 32 MiB and its trim threshold at 1 GiB for this process (once); return
    whether both were set. Nothing is changed where malloc is not glibc's, or where ``$GLIBC_TUNABLES`` already
    sets a ``glibc.malloc`` value (the user's choice wins; ``GLIBC_TUNABLES=glibc.malloc.trim_threshold=131072``
    restores glibc's default behaviour)."""
    if malloc_tuned_by_user():
        return False
    process = ctypes.CDLL(None)  # the symbols already loaded: the C library's among them
    if not hasattr(process, "gnu_get_libc_version") or not hasattr(process, "mallopt"):
        return False
    mmap_set = process.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    trim_set = process.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return bool(mmap_set) and bool(trim_set)


def release_freed_memory() -> None:
    """Hand the memory glibc's malloc holds free back to the kernel now (``malloc_trim(0)``): once, after start-up
    freed what it will not allocate again (weights moved elsewhere), which the 1 GiB trim threshold of
    :func:`keep_freed_memory` would otherwise keep resident. Nothing happens where malloc is not glibc's."""
    process = ctypes.CDLL(None)
    if hasattr(process, "gnu_get_libc_version") and hasattr(process, "malloc_trim"):
        process.malloc_trim(0)
