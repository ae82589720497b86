"""The OS page cache around the disk tier's store file: dropped before a profiled run, and the bytes
this process read from disk (issue 27: "page cache dropped before each arm").

Why both: the mmap baseline (DiskStore.mapped) uses the page cache as its expert cache, so a run
that starts with the file's pages cached measures RAM, not the disk; and its disk traffic is what
the page faults (and the kernel's read-around) fetched, not the rows it copied, so it is counted
from /proc/self/io (``read_bytes``: bytes this process, all threads, had the block layer read,
O_DIRECT reads included).

How the cache is dropped: the mapping's pages are unmapped first (MADV_DONTNEED: a page mapped by
a process is never dropped), the file's dirty pages written (fsync) and its pages advised out
(POSIX_FADV_DONTNEED, no root needed); as root, the whole clean page cache is dropped too
(/proc/sys/vm/drop_caches = 1), as scripts/disk_hold.sh does before each arm.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

DROP_CACHES = Path("/proc/sys/vm/drop_caches")
PROC_IO = Path("/proc/self/io")


def drop(path: str | os.PathLike | None, mapping: mmap.mmap | None = None) -> bool:
    """Drop the page cache of the store file ``path`` (and unmap ``mapping``'s pages of it first).

    Returns:
        True when the whole page cache was dropped (root), False when only the file's own pages
        were advised out (not root, or drop_caches not writable).
    """
    if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)  # the next touch faults again (from disk once dropped)
    if path is not None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a store written by this load) are never dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if os.geteuid() != 0:
        return False
    try:
        DROP_CACHES.write_text("1")
    except OSError:
        return False
    return True


def read_bytes() -> int | None:
    """Bytes this process has had read from storage so far (/proc/self/io read_bytes); None where
    the kernel does not count them (no task I/O accounting)."""
    try:
        for line in PROC_IO.read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
