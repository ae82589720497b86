"""Keep freed memory for reuse during the conversion (glibc only; a no-op elsewhere).

The conversion allocates and frees tensors of hundreds of MB per layer. glibc serves each
allocation above its mmap threshold with a fresh mmap and returns it with munmap on free, so every
new tensor page-faults its pages in again (measured on one layer, 29.5k float64 tokens: 2.5M minor
page faults, 9.5 s of system time, 15.3 s wall). Serving them from the heap and keeping freed
memory there (mallopt: no mmap, no trimming) gave the same results in 12.0 s (0.77M faults).
Peak memory is unchanged (3.04 vs 3.14 GB); the settings are restored and the heap trimmed after.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from typing import Iterator

# mallopt parameters and glibc's defaults (malloc.h; glibc 2.26+).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
DEFAULTS = {M_TRIM_THRESHOLD: 128 * 1024, M_TOP_PAD: 128 * 1024, M_MMAP_MAX: 65536}
KEEP = {M_TRIM_THRESHOLD: 2**31 - 1, M_TOP_PAD: 64 * 2**20, M_MMAP_MAX: 0}


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


@contextlib.contextmanager
def keep_freed_memory() -> Iterator[bool]:
    """Within the block, large allocations come from the heap and freed memory stays there.

    Yields:
        True when glibc's mallopt applied the settings, False where it is unavailable (no change).
    """
    libc = _libc()
    applied = libc is not None and all(libc.mallopt(key, value) == 1 for key, value in KEEP.items())
    try:
        yield applied
    finally:
        if libc is not None:
            for key, value in DEFAULTS.items():
                libc.mallopt(key, value)
            libc.malloc_trim(0)  # hand the kept memory back to the system
