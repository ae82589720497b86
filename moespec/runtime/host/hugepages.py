"""Host buffers on 2 MB pages: weight buffers the CPU kernels stream from (bound dense weights, the
expert store, the cache's slots) allocated 2 MB-aligned and ``madvise(MADV_HUGEPAGE)``'d before
their first touch.

Why: Linux's transparent huge pages are often in ``madvise`` mode (this project's VM:
/sys/kernel/mm/transparent_hugepage/enabled), so a buffer gets 4 KB pages unless it asks. A
decode step streams ~500 MB of weights once; on 4 KB pages every 4 KB is a TLB miss and a page
walk, and the hardware prefetcher stops at each 4 KB boundary. Measured on this project's AMD EPYC
VM, one thread, cold weights (scripts/dense_gemv_bench.py --pages both): the float32 GEMV 1024x576
15.4 -> 25.0 GB/s, 8192x576 18.2 -> 22.7, 576x1024 24.0 -> 29.7 (docs/decisions.md).

How: a private anonymous ``mmap`` of the size plus 2 MB (page-aligned, zero on first touch), advised as
huge over the whole mapping, and a tensor from its first 2 MB boundary (``torch.frombuffer`` keeps
the mapping alive as long as the tensor). Where the kernel refuses the advice (THP ``never``, no
``MADV_HUGEPAGE``) the buffer is an ordinary 4 KB-page one, same values. Buffers under
:data:`MIN_BYTES` and ``MOESPEC_HUGE_PAGES=0`` take ``torch.empty``.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

HUGE_BYTES = 2 << 20  # one x86-64 huge page
MIN_BYTES = HUGE_BYTES  # smaller buffers: torch.empty (a huge page would mostly be padding)
# Private anonymous memory: mmap's default MAP_SHARED mapping is shmem, whose huge pages follow
# shmem_enabled (often "never"), not the anonymous THP setting the advice asks.
PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


def enabled() -> bool:
    """True unless ``MOESPEC_HUGE_PAGES=0`` (read at each call, so a benchmark can A/B it)."""
    return os.environ.get("MOESPEC_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``, 2 MB-aligned on memory
    advised for 2 MB pages (module docstring); ``torch.empty`` when small or disabled."""
    shape = tuple(int(s) for s in shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes < MIN_BYTES or not enabled():
        return torch.empty(shape, dtype=dtype)
    raw = mmap.mmap(-1, nbytes + HUGE_BYTES, flags=PRIVATE)
    try:
        raw.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # THP off or unsupported: 4 KB pages, same buffer
    start = torch.frombuffer(raw, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_BYTES
    buf = torch.frombuffer(raw, dtype=torch.uint8, offset=offset, count=nbytes)
    return buf.view(dtype).view(shape)


def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` in a buffer from :func:`empty` (same dtype and shape)."""
    out = empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def huge_bytes() -> int:
    """This process's anonymous memory on huge pages, in bytes (/proc/self/smaps_rollup
    AnonHugePages; 0 where the file is missing): tests and benchmarks check the advice took."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
