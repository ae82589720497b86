"""Host memory: the RAM check before anything is allocated, and exact-size pinned buffers.

Why not ``torch.empty(..., pin_memory=True)``: it goes through PyTorch's caching host allocator,
which rounds every request up to a power of two, so Qwen3-30B-A3B's 54 GiB of experts would pin
64 GiB and an 84 GiB store 128 GiB (more than many hosts have). :class:`PinnedBuffer` instead maps
page-aligned anonymous memory of exactly the size (rounded to whole pages) and registers it with the
CUDA runtime (``cudaHostRegister`` through ``torch.cuda.cudart()``), under the asked device's context,
so no context is created on cuda:0 when cuda:1 is used. Copies from it are asynchronous DMA like any
pinned memory. ``close()`` (or garbage collection) unregisters it.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import weakref

import torch

from moespec.errors import BudgetError
from moespec.hub.sizes import HOST_HEADROOM_BYTES as HEADROOM_BYTES  # one number, also in `moespec models`


def available_bytes() -> int:
    """Host RAM that can be allocated without swapping, in bytes: Linux MemAvailable (else free pages),
    at most what the process's memory cgroup still allows (host/cgroup.py: a container's limit).

    ``MOESPEC_HOST_RAM_BYTES`` overrides it, for hosts whose memory grows on use (a VM balloon shows a
    small MemAvailable at start).
    """
    from moespec.runtime.host.cgroup import cgroup_free_bytes

    override = os.environ.get("MOESPEC_HOST_RAM_BYTES")
    if override:
        return int(override)
    have = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    have = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if have is None:
        have = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = cgroup_free_bytes()
    return have if limit is None else min(have, limit)


def headroom_bytes() -> int:
    """RAM left free beside what moespec allocates: HEADROOM_BYTES (512 MiB, for the other processes of
    the machine), or under a memory cgroup limit at most a tenth of that limit (host/cgroup.py: the
    limit is the process's own, so the machine's other processes do not draw on it; a 1.4 GiB
    container keeps 140 MiB, not a third of itself)."""
    from moespec.runtime.host.cgroup import cgroup_memory

    got = None if os.environ.get("MOESPEC_HOST_RAM_BYTES") else cgroup_memory()
    return HEADROOM_BYTES if got is None else min(HEADROOM_BYTES, got[1] // 10)


def check_host_memory(need_bytes: int, what: str) -> None:
    """Raise before allocating when ``need_bytes`` (+ headroom) do not fit in the available host RAM.

    Raises:
        BudgetError: one line naming both numbers.
    """
    have = available_bytes()
    if need_bytes + headroom_bytes() > have:
        raise BudgetError(f"{what} needs {need_bytes / 2**30:.1f} GiB of host RAM; "
                          f"{have / 2**30:.1f} GiB is available",
                          "free host memory or use a machine with more RAM (`moespec models` lists the "
                          "RAM each model needs; MOESPEC_HOST_RAM_BYTES overrides the check)")


def _unregister(ptr: int, device: torch.device) -> None:
    with torch.cuda.device(device):
        torch.cuda.cudart().cudaHostUnregister(ptr)


HUGE_PAGE = 2 << 20  # x86-64 transparent huge page (bytes)


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zero-filled host memory as a uint8 tensor [nbytes], asked to be backed by 2 MiB pages.

    An anonymous mapping, its start moved to a 2 MiB boundary, madvise(MADV_HUGEPAGE) on it: with
    transparent huge pages in ``madvise`` mode (this project's machine) nothing gets them unless
    asked. Weight rows read once per token then take one TLB entry per 2 MiB instead of 512 (a cold
    expert row read walks the page table every 4 KiB). Where the kernel refuses (THP ``never``, no
    madvise), the memory is ordinary 4 KiB pages: the same bytes, only slower.
    """
    # private: a shared anonymous mapping is shmem, which THP's madvise mode leaves on 4 KiB pages
    m = mmap.mmap(-1, max(nbytes, 1) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    off = -base % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            m.madvise(advice, off, (max(nbytes, 1) + HUGE_PAGE - off) // HUGE_PAGE * HUGE_PAGE)
    return torch.frombuffer(m, dtype=torch.uint8, count=max(nbytes, 1), offset=off)[:nbytes]  # keeps m alive


class PinnedBuffer:
    """``nbytes`` of page-locked host memory, exactly (whole pages), as a uint8 tensor ``tensor`` [nbytes].

    Args:
        nbytes: bytes to allocate.
        device: the CUDA device whose context registers the memory.

    Raises:
        BudgetError: the CUDA runtime refused to page-lock the memory (names the size and the error).
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device
        self._map = mmap.mmap(-1, max(nbytes, 1))  # anonymous, page-aligned, zero-filled on first touch
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes)  # [nbytes]
        ptr = self.tensor.data_ptr()
        with torch.cuda.device(device):  # why: register under the asked device, not cuda:0
            err = torch.cuda.cudart().cudaHostRegister(ptr, max(nbytes, 1), 0)
        if int(err) != 0:
            raise BudgetError(f"page-locking {nbytes / 2**30:.1f} GiB of host memory failed ({err})",
                              "free host memory, or raise the locked-memory limit (ulimit -l)")
        self._finalizer = weakref.finalize(self, _unregister, ptr, device)

    def close(self) -> None:
        """Unregister (the memory stays valid as ordinary pageable memory until the tensor is freed)."""
        self._finalizer()
