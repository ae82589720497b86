"""DiskReadEngine: disk -> RAM slot reads of packed rows, O_DIRECT, several in flight (the disk tier's link).

On CPU the RAM tier is the device cache, so this engine stands where the ThreadTransferEngine stands:
the cache (runtime.cache.slots) asks it to fill a slot with a row, and a DiskRow (host/disk_store.py)
says where the row lies in the store file. The same contract as the other engines (base.py): a demand
read goes before every queued prefetch read (FIFO within each kind), a prefetch that has not started
can be cancelled (never read, its bytes not counted), a read into a slot supersedes a queued prefetch
into that slot, ``bytes_moved`` counts the bytes of the reads that run.

Why threads and ``os.preadv``, not io_uring: preadv releases the GIL, so ``readers`` threads keep that
many reads in flight on the device queue, which is what a 1.5 GB/s SSD needs (README: ~8 in flight
saturate it); the standard library has it on every Linux, where the Python io_uring bindings on PyPI
are thin, young and need a recent kernel. The file is opened with O_DIRECT (the page cache is
bypassed, so a memory cap counts only the RAM tier); where the filesystem refuses O_DIRECT (tmpfs) it
is read through the page cache with a note, and the read pages are dropped (POSIX_FADV_DONTNEED).

Each row is checked against its XXH3-128 checksum as it lands (moespec.integrity's hasher, ~10x the
disk's speed on one core): a row that does not match, a short read (the file was truncated) or an
I/O error fails the request that waits for it with a one-line StoreError, and the next request reads
again (a flipped row also removes the file so the next start rebuilds it).
"""

from __future__ import annotations

import ctypes
import heapq
import os
import threading
import time

import torch

from typing import Callable

from moespec.errors import CheckpointError
from moespec.integrity import new_hasher
from moespec.runtime.transfer.base import Span, Ticket, TransferEngine
from moespec.runtime.transfer.queue import CopyQueue

DEFAULT_READERS = 8  # reads in flight: what saturates this machine's SSD (README, "Experts on disk")


def open_direct(path) -> tuple[int, bool]:
    """A read-only descriptor of ``path`` with O_DIRECT where the filesystem takes it; (fd, direct)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except OSError:
        return os.open(path, os.O_RDONLY), False


def read_into(fd: int, address: int, length: int, offset: int) -> int:
    """Read ``length`` bytes at file ``offset`` into memory at ``address`` (preadv, GIL released); bytes read."""
    done = 0
    while done < length:
        view = memoryview((ctypes.c_char * (length - done)).from_address(address + done)).cast("B")
        n = os.preadv(fd, [view], offset + done)
        if n <= 0:
            break
        done += n
    return done


class DiskReadEngine(CopyQueue, TransferEngine):
    """Reads rows of the store file ``path`` into RAM slots on ``readers`` threads (module docstring).

    The ``src`` of :meth:`submit` is a row's place (host/disk_store.DiskRow: ``key``, ``offset``,
    ``nbytes`` of data, ``length`` to read, a multiple of the O_DIRECT alignment, and ``digest``); its
    ``dst`` slot must be aligned and at least ``length`` bytes long (DiskStore.slot_rows).

    Args:
        path: the store file.
        forget: called when a row fails its checksum (removes the file: the next start rebuilds it).
        readers: threads, i.e. reads in flight at most.
        verify: check every row's checksum as it lands.

    Raises (in :meth:`wait`): CheckpointError for a read that failed (I/O error, short read, checksum).
    """

    def __init__(self, path, forget: Callable[[], None] = lambda: None, readers: int = DEFAULT_READERS,
                 verify: bool = True) -> None:
        self.path, self._forget = path, forget
        self.fd, self.direct = open_direct(path)
        self.verify = verify
        self._init_queue()  # demand reads before queued prefetches, cancellable (queue.py)
        self.reads = 0
        self._busy_s = 0.0  # wall seconds with at least one read running (the link's busy time)
        self._running = 0
        self._busy_since = 0.0
        self._errors: dict[int, str] = {}  # id(ticket) -> why its read failed
        self._failed: list[Ticket] = []  # failed reads not yet reported by cancel_pending (their slots are bad)
        self._pending = 0  # queued + running reads
        self._reading: set[int] = set()  # slots with a read running
        self._later: dict[int, list] = {}  # slot -> reads into it held back until its running read ends
        self.fault: Callable | None = None  # tests: called with each row before it is read; may raise OSError
        self._threads = [threading.Thread(target=self._loop, name=f"moespec-disk-{i}", daemon=True)
                         for i in range(max(1, readers))]
        for t in self._threads:
            t.start()

    # --- the readers -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                entry = heapq.heappop(self._heap)
                job = entry[2]
                if job is None:
                    return
                dst, row, ticket = job
                if not ticket.cancelled and ticket.slot in self._reading:
                    # Why: a read into a slot whose earlier read is still running would race it (and
                    # could land first); it waits for that one and then runs, so the newest row wins.
                    self._later.setdefault(ticket.slot, []).append(entry)
                    continue
                if self._queued.get(ticket.slot) is ticket:
                    del self._queued[ticket.slot]
                if ticket.cancelled:
                    self._pending -= 1
                    ticket.done.set()
                    self._cv.notify_all()
                    continue
                ticket.started = True
                self._reading.add(ticket.slot)
                if self._running == 0:
                    self._busy_since = time.perf_counter()
                self._running += 1
            t0 = time.perf_counter()
            error = self._read(dst, row)
            t1 = time.perf_counter()
            with self._cv:
                self._reading.discard(ticket.slot)
                for later in self._later.pop(ticket.slot, []):  # back in the queue with their first place
                    heapq.heappush(self._heap, later)
                self._running -= 1
                if self._running == 0:
                    self._busy_s += t1 - self._busy_since
                if error is not None:
                    self._errors[id(ticket)] = error
                    self._failed.append(ticket)
                self.reads += 1
                self._pending -= 1
                ticket.start, ticket.end, ticket.copy_s = t0, t1, t1 - t0
                ticket.done.set()
                self._cv.notify_all()

    def _read(self, dst: torch.Tensor, row) -> str | None:
        """One row into ``dst``; None, or why it failed (one line)."""
        where = f"layer {row.key[0]} expert {row.key[1]} of {self.path}"
        length = row.length if self.direct else row.nbytes
        try:
            if self.fault is not None:
                self.fault(row)
            got = read_into(self.fd, dst.data_ptr(), length, row.offset)
            if not self.direct:
                os.posix_fadvise(self.fd, row.offset, length, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            return f"reading {where} failed: {exc.strerror or exc}"
        except Exception as exc:  # why: a reader thread must never die (every later wait would hang)
            return f"reading {where} failed: {exc}"
        if got < row.nbytes:
            return f"{self.path} is truncated: {where} ends after {got} of {row.nbytes} bytes"
        if self.verify:
            data = (ctypes.c_char * row.nbytes).from_address(dst.data_ptr())
            h = new_hasher()
            h.update(memoryview(data).cast("B"))
            if h.hexdigest() != row.digest:
                self._forget()
                return f"{self.path} changed under the running model ({where} fails its checksum)"
        return None

    # --- the TransferEngine contract ---------------------------------------------------------------
    def submit(self, dst: torch.Tensor, src, slot: int, prefetch: bool = False) -> Ticket:
        ticket = Ticket(nbytes=src.nbytes, slot=slot, done=threading.Event(), prefetch=prefetch)
        with self._cv:
            self._pending += 1
            self._enqueue_locked(dst, src, ticket)
        return ticket

    def cancel_pending(self) -> list[Ticket]:
        with self._cv:
            jobs = [job for _, _, job in self._heap if job is not None]
            jobs += [entry[2] for held in self._later.values() for entry in held]
            dropped = [job[2] for job in jobs if self._cancel_locked(job[2])]
        self.synchronize()
        with self._cv:  # a failed read's slot holds no valid row either: the cache forgets it as a dropped one
            failed, self._failed = self._failed, []
            for t in failed:
                self._errors.pop(id(t), None)
        return dropped + failed

    def wait(self, ticket: Ticket) -> Span:
        t0 = time.perf_counter()
        ticket.done.wait()
        ticket.waited = True
        with self._cv:
            error = self._errors.pop(id(ticket), None)
        if error is not None:
            raise CheckpointError(error, "run the request again; if it persists, restart moespec to rebuild the file")
        return Span(t0, time.perf_counter())

    def synchronize(self) -> None:
        with self._cv:
            while self._pending:
                self._cv.wait()

    def busy_seconds(self) -> float:
        with self._cv:
            extra = time.perf_counter() - self._busy_since if self._running else 0.0
            return self._busy_s + extra

    def close(self) -> None:
        if self.fd < 0:
            return
        self.synchronize()
        with self._cv:
            for _ in self._threads:
                heapq.heappush(self._heap, (3, next(self._seq), None))
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        os.close(self.fd)
        self.fd = -1
