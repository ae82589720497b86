"""Hand the C heap's freed memory back to the system (glibc ``malloc_trim``; a no-op elsewhere).

Why: loading frees hundreds of MB of heap (a tensor cloned out of the checkpoint's mapping and cast
by accelerate, the float weights the dense path copies onto 2 MB pages or fuses), and glibc keeps
freed heap chunks resident unless they sit at the top of the heap. Under a memory cgroup cap that
memory counts like live memory: measured on the disk tier's 8-layer int8 Qwen3-30B-A3B slice
(scripts/disk_tier_bench.py, 384 MiB RAM tier), RSS after load was 891 MiB (1136 with 2 MB
pages), of which 160 MiB (405) was freed heap; after the first token 1290 MiB (1593), above the
1200 MiB cap of the 4x hold, which then thrashed on the libraries' code pages (no swap). Trimmed:
731 MiB after load either way, 1126 after the first token (docs/decisions.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _trim():
    """glibc's ``malloc_trim`` (int -> int), or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)


def release_free_heap() -> bool:
    """Return the heap's free pages to the system (resident memory drops by them; live memory is
    untouched). True when glibc's ``malloc_trim(0)`` ran and released something, False otherwise."""
    trim = _trim()
    return bool(trim(0)) if trim is not None else False
