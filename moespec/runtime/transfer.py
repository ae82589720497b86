"""Transfer engine: the ONLY module that touches CUDA streams and events.

Host -> device copies of packed experts run on a separate copy stream (CUDA) or a worker thread
(CPU), so they overlap the compute of the running layer. The compute side waits only on the
ticket of the slot it is about to read. On CPU the worker can be throttled to an emulated link
bandwidth (``link_gbps``), so overlap, stall and bytes are real measurements without a GPU.
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
        done: set when the copy finished (CPU) / a CUDA event recorded after the copy.
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

    def finished(self) -> bool:
        """True once the copy has completed (never blocks)."""
        if isinstance(self.done, threading.Event):
            return self.done.is_set()
        return bool(self.done.query())


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
        valid expert. An in-order CUDA copy stream cannot drop copies: returns [] (synchronize waits).
        """
        return []

    def wait(self, ticket: Ticket) -> Span:
        """Make the compute side wait for ``ticket``; returns the stall span (0 when already done)."""
        raise NotImplementedError

    def slot_released(self, slot: int) -> None:
        """Compute has issued its last read of ``slot``: later copies into it must wait for that."""

    def mark(self) -> object:
        """A timestamp on the compute timeline (for Span)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block until all issued compute and copies are finished (before reading clocks)."""

    def busy_seconds(self) -> float:
        """Seconds the link spent copying since creation (for achieved GB/s)."""
        return 0.0

    def close(self) -> None:
        """Stop background work."""


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
        ticket = Ticket(nbytes=nbytes, slot=slot, done=threading.Event())
        self.bytes_moved += nbytes
        self._put(1 if prefetch else 0, (dst, src, ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> bool:
        with self._cv:
            if ticket.started or ticket.done.is_set():
                return False
            ticket.cancelled = True
            self.bytes_moved -= ticket.nbytes
            return True

    def cancel_pending(self) -> list[Ticket]:
        dropped = []
        with self._cv:
            for _, _, job in self._heap:
                if job is None:
                    continue
                ticket = job[2]
                if not ticket.started and not ticket.cancelled and not ticket.done.is_set() and ticket.slot >= 0:
                    ticket.cancelled = True
                    self.bytes_moved -= ticket.nbytes
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
        self._put(3, None)
        self._thread.join(timeout=5)


class CudaTransferEngine(TransferEngine):
    """CUDA: a high-priority copy stream, one event per copy, and one "slot free" event per slot.

    Args:
        device: the CUDA device.
        num_slots: number of cache slots (for the slot-free events).
    """

    def __init__(self, device: torch.device, num_slots: int) -> None:
        self.device = device
        self.bytes_moved = 0
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self._free: list[torch.cuda.Event | None] = [None] * num_slots
        self._copy_spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._busy_s = 0.0

    def submit(self, dst: torch.Tensor, src: torch.Tensor, slot: int, prefetch: bool = False) -> Ticket:
        # One in-order copy stream: issued copies cannot be reordered or cancelled here.
        nbytes = src.numel() * src.element_size()
        self.bytes_moved += nbytes
        with torch.cuda.stream(self.stream):
            # Why: kernels already queued on the compute stream may still read this slot's old
            # expert; overwriting it before they ran would corrupt their result.
            if self._free[slot] is not None:
                self.stream.wait_event(self._free[slot])
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        self._copy_spans.append((start, done))
        return Ticket(nbytes=nbytes, slot=slot, done=done, start=start, end=done)

    def wait(self, ticket: Ticket) -> Span:
        compute = torch.cuda.current_stream(self.device)
        a = torch.cuda.Event(enable_timing=True)
        a.record(compute)
        # Why: the compute stream must not read the slot before its copy landed; waiting on this
        # one event (not the whole copy stream) keeps later prefetches overlapping.
        compute.wait_event(ticket.done)
        b = torch.cuda.Event(enable_timing=True)
        b.record(compute)
        ticket.waited = True
        return Span(a, b)

    def slot_released(self, slot: int) -> None:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._free[slot] = ev

    def mark(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
        for start, done in self._copy_spans:
            self._busy_s += start.elapsed_time(done) / 1e3
        self._copy_spans.clear()

    def busy_seconds(self) -> float:
        return self._busy_s


def make_transfer_engine(device: torch.device, num_slots: int, link_gbps: float | None) -> TransferEngine:
    """CUDA copy stream on a CUDA device, else the (optionally throttled) worker thread."""
    if device.type == "cuda":
        return CudaTransferEngine(device, num_slots)
    return ThreadTransferEngine(link_gbps)
