"""Transfer engines: the ONLY modules that touch CUDA streams and events (this one and transfer_cuda.py).

Host -> device copies of packed experts run beside the compute of the running layer; the compute
side waits only on the copy of the slot it is about to read. Two kinds of copy exist: a demand copy
(an expert the running layer needs now) and a prefetch copy (a predicted expert of a later layer).

What happens on each device:

- CPU (:class:`ThreadTransferEngine`): one worker thread copies (``Tensor.copy_``), optionally
  throttled to an emulated link (``link_gbps``), so overlap, stall and bytes are real measurements
  without a GPU. Its queue is a priority queue: a demand copy runs before every prefetch copy that is
  still queued (FIFO within each kind); the copy that is running finishes first. A prefetch that has
  not started can be cancelled (``cancel``): it never runs and its bytes are not counted.
- CUDA (:class:`moespec.runtime.transfer_cuda.CudaTransferEngine`): a CUDA stream is FIFO and an
  issued copy cannot be cancelled, so prefetches are held in a host-side queue and released to a
  prefetch stream at most ``window`` (2) at a time, by a pump thread that waits on the oldest
  released copy. Demand copies go at once to a separate demand stream, so they never queue behind
  prefetches: they start immediately and share the link with at most the ``window`` released
  prefetches. A prefetch still in the host queue can be cancelled for real; one that the compute
  side waits for before its release is promoted to the demand stream. See transfer_cuda.py.

On both, a copy into a slot supersedes a still-queued prefetch into the same slot, and
``bytes_moved`` counts exactly the bytes of the copies that run.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass
class Span:
    """A time interval on the compute timeline; ``ms()`` is valid after ``synchronize()``.

    CPU spans hold perf_counter seconds; CUDA spans hold timing events.
    """

    start: object
    end: object

    def ms(self) -> float:
        """Length in milliseconds."""
        if isinstance(self.start, float):
            return (self.end - self.start) * 1e3
        return float(self.start.elapsed_time(self.end))


@dataclass
class Ticket:
    """One issued host->device copy.

    Attributes:
        nbytes: bytes moved.
        slot: destination slot index.
        done: set when the copy finished (CPU) / a CUDA event recorded after the copy (None while
            a CUDA prefetch waits in the host queue).
        started: the copy was handed to the worker / a stream (it can no longer be cancelled).
        cancelled: dropped before it started (it never runs; its bytes are not counted).
        prefetch: issued as a prefetch (it may be reordered behind later demand copies).
        copy_s: measured duration of the copy itself in seconds (CPU only; 0 on CUDA).
        start, end: when the copy itself ran, on the ``mark()`` clock (perf_counter seconds on CPU,
            timing events on CUDA), so ``Span(start, end)`` places it on a timeline; None until known.
    """

    nbytes: int
    slot: int
    done: object = None
    copy_s: float = 0.0
    waited: bool = field(default=False)
    started: bool = False
    cancelled: bool = False
    start: object = None
    end: object = None
    prefetch: bool = False


class TransferEngine:
    """Common interface; use :func:`make_transfer_engine`."""

    bytes_moved: int = 0

    def submit(self, dst: torch.Tensor, src: torch.Tensor, slot: int, prefetch: bool = False) -> Ticket:
        """Start copying packed expert ``src`` [P] (host) into ``dst`` [P] (device slot ``slot``).

        ``prefetch`` copies yield to demand copies that were queued later, where the engine can reorder.
        """
        raise NotImplementedError

    def cancel(self, ticket: Ticket) -> bool:
        """Drop a copy that has not started; True when it will never run (its bytes are not moved)."""
        return False

    def cancel_pending(self) -> list[Ticket]:
        """Abort: drop every queued copy that has not started and cut short the emulated link time of
        the running one (its bytes have landed). Returns the dropped tickets, whose slots hold no
        valid expert. On CUDA only prefetches still in the host queue can be dropped; copies already
        released to a stream run to the end (synchronize waits for them).
        """
        return []

    def wait(self, ticket: Ticket) -> Span:
        """Make the compute side wait for ``ticket``; returns the stall span (0 when already done)."""
        raise NotImplementedError

    def landed(self, ticket: Ticket) -> bool:
        """True when ``ticket``'s copy can no longer write its slot (finished, waited or cancelled);
        a query, never blocks. The cache gives a prefetch only slots whose copy landed."""
        done = ticket.done
        return ticket.cancelled or ticket.waited or (done is not None and done.is_set())

    def slot_released(self, slot: int) -> None:
        """Compute has issued its last read of ``slot``: later copies into it must wait for that."""

    def set_timing(self, on: bool) -> None:
        """Time copies and stalls (True while a recorder listens); off, no timing event is made (CUDA)."""

    def mark(self) -> object:
        """A timestamp on the compute timeline (for Span)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block until all issued compute and copies are finished (before reading clocks)."""

    def busy_seconds(self) -> float:
        """Seconds the link spent copying since creation (for achieved GB/s)."""
        return 0.0

    def close(self) -> None:
        """Finish every issued copy, then stop background work."""


class ThreadTransferEngine(TransferEngine):
    """CPU: copies on one worker thread, FIFO like a copy stream, optionally throttled.

    Args:
        link_gbps: emulated link bandwidth in GB/s (10^9 bytes/s); None = as fast as memcpy.
    """

    def __init__(self, link_gbps: float | None = None) -> None:
        self.link_gbps = link_gbps
        self.bytes_moved = 0
        self._busy_s = 0.0
        # (priority, sequence, job): demand copies (0) go before queued prefetches (1), FIFO within.
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._queued: dict[int, Ticket] = {}  # slot -> its prefetch still in the queue
        self._hurry = threading.Event()  # set by cancel_pending: end the emulated link wait now
        self._thread = threading.Thread(target=self._run, name="moespec-h2d", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Inference mode is thread-local: the worker enters it too, so it may write slot views that
        # the compute thread created under inference mode.
        with torch.inference_mode():
            self._loop()

    def _put(self, priority: int, job) -> None:
        with self._cv:
            heapq.heappush(self._heap, (priority, next(self._seq), job))
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                job = heapq.heappop(self._heap)[2]
                if job is None:
                    return
                dst, src, ticket = job
                if self._queued.get(ticket.slot) is ticket:
                    del self._queued[ticket.slot]
                if ticket.cancelled:
                    ticket.done.set()
                    continue
                ticket.started = True
            t0 = time.perf_counter()
            try:
                dst.copy_(src)
            except BaseException as exc:  # surfaced on the compute side in wait()
                self._error = exc
            if self.link_gbps:
                # Emulated link: a copy takes at least nbytes / bandwidth.
                rest = ticket.nbytes / (self.link_gbps * 1e9) - (time.perf_counter() - t0)
                if rest > 0:
                    self._hurry.wait(rest)  # a sleep that cancel_pending can cut short
            ticket.start, ticket.end = t0, time.perf_counter()
            ticket.copy_s = ticket.end - t0
            self._busy_s += ticket.copy_s
            ticket.done.set()

    def submit(self, dst: torch.Tensor, src: torch.Tensor, slot: int, prefetch: bool = False) -> Ticket:
        nbytes = src.numel() * src.element_size()
        ticket = Ticket(nbytes=nbytes, slot=slot, done=threading.Event(), prefetch=prefetch)
        with self._cv:
            # Why: a demand copy into this slot would run before a queued prefetch into it (priority),
            # which would then overwrite it; the queued one is unwanted (its slot was taken), drop it.
            old = self._queued.pop(slot, None)
            if old is not None:
                self._cancel_locked(old)
            if prefetch:
                self._queued[slot] = ticket
            self.bytes_moved += nbytes
            heapq.heappush(self._heap, (1 if prefetch else 0, next(self._seq), (dst, src, ticket)))
            self._cv.notify()
        return ticket

    def _cancel_locked(self, ticket: Ticket) -> bool:
        if ticket.started or ticket.cancelled or ticket.done.is_set():
            return False
        ticket.cancelled = True
        self.bytes_moved -= ticket.nbytes
        return True

    def cancel(self, ticket: Ticket) -> bool:
        with self._cv:
            return self._cancel_locked(ticket)

    def cancel_pending(self) -> list[Ticket]:
        dropped = []
        with self._cv:
            for _, _, job in self._heap:
                if job is None:
                    continue
                ticket = job[2]
                if ticket.slot >= 0 and self._cancel_locked(ticket):
                    dropped.append(ticket)
            self._hurry.set()
        self.synchronize()  # the running copy (if any) and the dropped ones are done after this
        self._hurry.clear()
        return dropped

    def wait(self, ticket: Ticket) -> Span:
        t0 = time.perf_counter()
        ticket.done.wait()
        ticket.waited = True
        if self._error is not None:
            raise self._error
        return Span(t0, time.perf_counter())

    def landed(self, ticket: Ticket) -> bool:
        return ticket.cancelled or ticket.waited or ticket.done.is_set()

    def mark(self) -> float:
        return time.perf_counter()

    def synchronize(self) -> None:
        done = threading.Event()
        # A sentinel copy of nothing at the lowest priority: when it runs, everything queued is done.
        self._put(2, (torch.empty(0), torch.empty(0), Ticket(nbytes=0, slot=-1, done=done)))
        done.wait()

    def busy_seconds(self) -> float:
        return self._busy_s

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self.synchronize()  # why: the slots may be freed right after; no copy may still write them
        self._put(3, None)
        self._thread.join(timeout=5)


def make_transfer_engine(device: torch.device, num_slots: int, link_gbps: float | None) -> TransferEngine:
    """CUDA demand + prefetch streams on a CUDA device, else the (optionally throttled) worker thread."""
    if device.type == "cuda":
        from moespec.runtime.transfer_cuda import CudaTransferEngine

        return CudaTransferEngine(device, num_slots)
    return ThreadTransferEngine(link_gbps)
