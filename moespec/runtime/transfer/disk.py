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

Three rules keep the disk busy with what compute waits for (issue 27: decode reached 60 % of the
reader's own GB/s, and prefetch made the router arm slower than on-demand):

- A row is read in chunks of ``chunk_bytes`` (2 MiB), each its own read on any free reader, so the
  two or three rows a layer misses still keep ``readers`` reads in flight (one 9 MiB row read alone
  is a queue depth of 1-3 on the device), and a read ahead never holds the disk longer than one
  chunk.
- A wrong prefetch whose layer came is cut: its chunks not started are dropped (``abort``), so
  the layer's demand reads do not queue behind the rest of a row nobody reads.
- While a demand read is queued or running no prefetch chunk starts (the disk has no priorities:
  a prefetch read beside a demand read halves the demand read's speed); prefetch chunks fill the
  disk only while compute needs nothing from it. An ahead read (Ticket.ahead: a prediction of the
  layer after the next, runtime/layer/ahead.py) starts only when no demand or next-layer prefetch
  chunk is queued (queue.py's AHEAD priority), and never beside a demand chunk.

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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moespec.errors import CheckpointError
from moespec.integrity import new_hasher
from moespec.runtime.transfer.base import Span, Ticket, TransferEngine
from moespec.runtime.transfer.queue import DEMAND, PREFETCH, CopyQueue, priority

DEFAULT_READERS = 8  # reads in flight: what saturates this machine's SSD (README, "Experts on disk")
CHUNK_BYTES = 2 << 20  # one read of a row; a multiple of the O_DIRECT alignment (module docstring)
_ALIGN = 4096


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


@dataclass(eq=False)
class _Read:
    """One submitted row read: its chunks not finished yet (``left``), the first error, when it began."""

    ticket: Ticket
    dst: torch.Tensor
    row: object
    left: int
    error: str | None = None
    t0: float = 0.0
    cut: bool = False  # its chunks not started were dropped (abort): no row lands, nothing to check


class DiskReadEngine(CopyQueue, TransferEngine):
    """Reads rows of the store file ``path`` into RAM slots on ``readers`` threads (module docstring).

    The ``src`` of :meth:`submit` is a row's place (host/disk_store.DiskRow: ``key``, ``offset``,
    ``nbytes`` of data, ``length`` to read, a multiple of the O_DIRECT alignment, and ``digest``); its
    ``dst`` slot must be aligned and at least ``length`` bytes long (DiskStore.slot_rows).

    Args:
        path: the store file.
        forget: called when a row fails its checksum (removes the file: the next start rebuilds it).
        readers: threads, i.e. reads (chunks) in flight at most.
        verify: check every row's checksum as it lands.
        chunk_bytes: bytes of one read (rounded up to 4096); a row is read in ceil(length / chunk) reads.
        prefetch_beside: prefetch chunks that may run beside running demand chunks (0: none).

    Raises (in :meth:`wait`): CheckpointError for a read that failed (I/O error, short read, checksum).
    """

    def __init__(self, path, forget: Callable[[], None] = lambda: None, readers: int = DEFAULT_READERS,
                 verify: bool = True, chunk_bytes: int = CHUNK_BYTES, prefetch_beside: int = 0) -> None:
        self.path, self._forget = path, forget
        self.fd, self.direct = open_direct(path)
        self.verify = verify
        self.chunk_bytes = max(_ALIGN, -(-chunk_bytes // _ALIGN) * _ALIGN)
        self.prefetch_beside = prefetch_beside
        self._init_queue()  # demand reads before queued prefetches, cancellable (queue.py)
        self.reads = 0
        self.cut_reads = 0  # started reads whose chunks not started were dropped (abort)
        self._busy_s = 0.0  # wall seconds with at least one read running (the link's busy time)
        self._running = 0  # chunks being read
        self._demand_running = 0  # of them, chunks of demand reads (no prefetch chunk starts beside one)
        self._busy_since = 0.0
        self._errors: dict[int, str] = {}  # id(ticket) -> why its read failed
        self._failed: list[Ticket] = []  # failed reads not yet reported by cancel_pending (their slots are bad)
        self._pending = 0  # queued + running reads
        self._active: dict[int, _Read] = {}  # slot -> the read writing it (started, not finished)
        self._later: dict[int, list] = {}  # slot -> chunks of other reads into it, held back until it ends
        self.fault: Callable | None = None  # tests: called with each row before it is read; may raise OSError
        self._threads = [threading.Thread(target=self._loop, name=f"moespec-disk-{i}", daemon=True)
                         for i in range(max(1, readers))]
        for t in self._threads:
            t.start()

    # --- the readers -----------------------------------------------------------------------------
    def _next_locked(self):
        """The next heap entry a reader may start (popped), or None: nothing queued, or only prefetch
        chunks while a demand chunk is running and ``prefetch_beside`` prefetch chunks run (module docstring)."""
        heap = self._heap
        busy = self._demand_running and self._running - self._demand_running >= self.prefetch_beside
        if not heap or (heap[0][0] != DEMAND and heap[0][2] is not None and busy):
            return None
        return heapq.heappop(heap)

    def _loop(self) -> None:
        while True:
            with self._cv:
                entry = self._next_locked()
                while entry is None:
                    self._cv.wait()
                    entry = self._next_locked()
                job = entry[2]
                if job is None:
                    return
                rd, start, n = job
                ticket = rd.ticket
                if ticket.cancelled:
                    rd.left -= 1
                    if rd.left == 0:
                        self._pending -= 1
                        ticket.done.set()
                        self._cv.notify_all()
                    continue
                active = self._active.get(ticket.slot)
                if active is not None and active is not rd:
                    # Why: a read into a slot whose earlier read is still running would race it (and
                    # could land first); it waits for that one and then runs, so the newest row wins.
                    self._later.setdefault(ticket.slot, []).append(entry)
                    continue
                first = not ticket.started
                if first:
                    ticket.started = True
                    self._active[ticket.slot] = rd
                    if self._queued.get(ticket.slot) is ticket:
                        del self._queued[ticket.slot]
                    rd.t0 = time.perf_counter()
                if self._running == 0:
                    self._busy_since = time.perf_counter()
                self._running += 1
                demand = entry[0] == 0  # a prefetch waited for runs as demand (wait)
                self._demand_running += demand
            error = self._read_chunk(rd, start, n, first)
            with self._cv:
                t1 = time.perf_counter()
                self._running -= 1
                self._demand_running -= demand
                if self._running == 0:
                    self._busy_s += t1 - self._busy_since
                if error is not None and rd.error is None:
                    rd.error = error
                rd.left -= 1
                last = rd.left == 0
                self._cv.notify_all()  # a prefetch chunk may start now
            if last:
                self._finish(rd)

    def _finish(self, rd: _Read) -> None:
        """The last chunk of ``rd`` has landed: check the row, then hand it over (or its error)."""
        error = None if rd.cut else rd.error if rd.error is not None else self._check(rd.dst, rd.row)
        t1 = time.perf_counter()
        ticket = rd.ticket
        with self._cv:
            del self._active[ticket.slot]
            for later in self._later.pop(ticket.slot, []):  # back in the queue with their first place
                heapq.heappush(self._heap, later)
            if error is not None:
                self._errors[id(ticket)] = error
                self._failed.append(ticket)
            self.reads += not rd.cut  # rows that landed
            self._pending -= 1
            ticket.start, ticket.end, ticket.copy_s = rd.t0, t1, t1 - rd.t0
            ticket.done.set()
            self._cv.notify_all()

    @staticmethod
    def _row(row) -> str:
        return f"layer {row.key[0]} expert {row.key[1]}"

    def _where(self, row) -> str:
        return f"{self._row(row)} of {self.path}"

    def _read_chunk(self, rd: _Read, start: int, n: int, first: bool) -> str | None:
        """Bytes [start, start + n) of ``rd``'s row into its slot; None, or why it failed (one line)."""
        row = rd.row
        try:
            if first and self.fault is not None:
                self.fault(row)
            got = read_into(self.fd, rd.dst.data_ptr() + start, n, row.offset + start)
            if not self.direct:
                os.posix_fadvise(self.fd, row.offset + start, n, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            return f"reading {self._where(row)} failed: {exc.strerror or exc}"
        except Exception as exc:  # why: a reader thread must never die (every later wait would hang)
            return f"reading {self._where(row)} failed: {exc}"
        need = min(n, row.nbytes - start)
        if got < need:
            return f"{self.path} is truncated: {self._row(row)} ends after {start + got} of {row.nbytes} bytes"
        return None

    def _check(self, dst: torch.Tensor, row) -> str | None:
        """``row``'s checksum over the bytes now in ``dst``: None, or why it fails (the file is forgotten)."""
        if not self.verify:
            return None
        data = (ctypes.c_char * row.nbytes).from_address(dst.data_ptr())
        h = new_hasher()
        h.update(memoryview(data).cast("B"))
        if h.hexdigest() != row.digest:
            self._forget()
            return f"{self.path} changed under the running model ({self._row(row)} fails its checksum)"
        return None

    def _enqueue_locked(self, dst, src, ticket: Ticket) -> None:
        """Queue one row read as chunks (holding ``_cv``); the queue's rules (queue.py) per read."""
        old = self._queued.pop(ticket.slot, None)
        if old is not None:  # a read into this slot supersedes a queued prefetch into it (queue.py)
            self._cancel_locked(old)
        if ticket.prefetch:
            self._queued[ticket.slot] = ticket
        self.bytes_moved += ticket.nbytes
        total = src.length if self.direct else src.nbytes
        step = self.chunk_bytes
        starts = range(0, max(total, 1), step)
        rd = _Read(ticket, dst, src, len(starts))
        level = priority(ticket)
        for start in starts:
            heapq.heappush(self._heap, (level, next(self._seq), (rd, start, min(step, total - start))))
        self._cv.notify_all()

    # --- the TransferEngine contract ---------------------------------------------------------------
    def submit(self, dst: torch.Tensor, src, slot: int, prefetch: bool = False, ahead: bool = False) -> Ticket:
        ticket = Ticket(nbytes=src.nbytes, slot=slot, done=threading.Event(), prefetch=prefetch,
                        ahead=prefetch and ahead)
        with self._cv:
            self._pending += 1
            self._enqueue_locked(dst, src, ticket)
        return ticket

    def cancel_pending(self) -> list[Ticket]:
        with self._cv:
            jobs = [job for _, _, job in self._heap if job is not None]
            jobs += [entry[2] for held in self._later.values() for entry in held]
            tickets = list({id(job[0].ticket): job[0].ticket for job in jobs}.values())
            dropped = [t for t in tickets if self._cancel_locked(t)]
        self.synchronize()
        with self._cv:  # a failed read's slot holds no valid row either: the cache forgets it as a dropped one
            failed, self._failed = self._failed, []
            for t in failed:
                self._errors.pop(id(t), None)
        return dropped + failed

    def wait(self, ticket: Ticket) -> Span:
        t0 = time.perf_counter()
        if ticket.prefetch and not ticket.done.is_set():
            self.promote(ticket)
        ticket.done.wait()
        ticket.waited = True
        with self._cv:
            error = self._errors.pop(id(ticket), None)
        if error is not None:
            raise CheckpointError(error, "run the request again; if it persists, restart moespec to rebuild the file")
        return Span(t0, time.perf_counter())

    def abort(self, ticket: Ticket) -> int:
        """Drop the queued chunks of the started read ``ticket`` (base.py); the row bytes they held."""
        with self._cv:
            rd = self._active.get(ticket.slot)
            if rd is None or rd.ticket is not ticket or ticket.done.is_set():
                return 0  # not started (cancel it instead), finished, or superseded
            keep, saved, dropped = [], 0, 0
            for entry in self._heap:
                job = entry[2]
                if job is not None and job[0] is rd:
                    dropped += 1
                    saved += max(0, min(job[2], rd.row.nbytes - job[1]))  # data bytes, not the alignment pad
                else:
                    keep.append(entry)
            if not dropped:
                return 0
            heapq.heapify(keep)
            self._heap[:] = keep
            rd.cut, rd.left = True, rd.left - dropped
            self.bytes_moved -= saved
            self.cut_reads += 1
            last = rd.left == 0  # every chunk that started has ended already
        if last:
            self._finish(rd)
        return saved

    def promote(self, ticket: Ticket) -> None:
        """Compute needs ``ticket`` (its layer settled it, or waits for it): its chunks still queued go
        with the demand reads, in their first queue place (so before the layer's demand misses)."""
        self._move(ticket, DEMAND)

    def confirm(self, ticket: Ticket) -> None:
        """The ahead read ``ticket`` is the next layer's prediction now: its queued chunks go with the
        next layer's prefetch reads (base.py), in their first queue place."""
        self._move(ticket, PREFETCH)

    def _move(self, ticket: Ticket, to: int) -> None:
        """``ticket``'s chunks still queued at a lower priority than ``to`` get ``to`` (same sequence)."""
        ticket.ahead = False
        if ticket.done.is_set():
            return
        with self._cv:
            heap = self._heap
            for i, (level, seq, job) in enumerate(heap):
                if level > to and job is not None and job[0].ticket is ticket:
                    heap[i] = (to, seq, job)
            heapq.heapify(heap)
            self._cv.notify_all()

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
