"""CUDA transfer engine: demand copies never queue behind prefetches; queued prefetches can be cancelled.

Shapes: S slots, P packed elements per expert (a copy moves one [P] row into one slot).

Why not one copy stream: a CUDA stream runs in issue order and an issued copy cannot be withdrawn,
so with one stream a demand miss of layer l waits for every prefetch issued before it (wrong ones
included), and "cancelling" a mispredicted prefetch saves nothing. Stream priorities do not help:
they order kernel scheduling, not the copy engines. So the order is decided on the host:

- demand stream (highest priority): a demand copy is issued at once. It runs beside at most
  ``window`` prefetch copies (sharing the link with them) instead of behind all of them.
- prefetch stream: prefetch copies wait in a host-side FIFO and are released to the stream at most
  ``window`` at a time. A pump thread blocks (GIL released) on a marker event of the oldest released
  copy and releases the next when it lands, so the link stays busy while the host is blocked
  elsewhere (e.g. reading routing ids). A prefetch still in the host queue is truly cancellable: it
  never runs and its bytes are not counted. One the compute side waits for before its release is
  promoted: issued at once on the demand stream.
- ordering: every copy into slot s waits (on its stream) for the compute stream's last read of s
  (the slot's "free" event, recorded at release) and for the previous copy into s when that ran on
  the other stream; the compute stream waits on exactly the "done" event of the slot it reads.
- events: one "free" and one "done" event per slot, re-recorded for each use; ``window`` marker
  events for the pump. Timing events (copy start/end, stall spans) are made only while
  ``set_timing(True)`` (a recorder listens); they are resolved and dropped at ``synchronize()``.

Every CUDA call goes through :class:`CudaBackend`, so a fake with the same semantics (FIFO streams,
events, no cancellation of issued copies, delayed completion) tests this engine on CPU.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from moespec.runtime.transfer.base import Span, Ticket, TransferEngine


class CudaBackend:
    """The CUDA calls the engine makes, on one device (tests substitute a fake with the same semantics).

    Args:
        device: the CUDA device every stream, event and synchronize names.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stream(self, high_priority: bool):
        """A new stream; high priority maps to the device's highest (lower number = higher)."""
        with torch.cuda.device(self.device):  # why: the range query needs a context: this device's
            lo, hi = torch.cuda.Stream.priority_range()
            return torch.cuda.Stream(device=self.device, priority=hi if high_priority else lo)

    def event(self, timing: bool = False):
        """A new event (timing events cost more: only made while something records)."""
        return torch.cuda.Event(enable_timing=timing)

    def current_stream(self):
        """The compute stream (the current stream of the device)."""
        return torch.cuda.current_stream(self.device)

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)`` [P] on ``stream`` without blocking the host (``src`` is pinned)."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record(self, event, stream) -> None:
        """Record ``event`` on ``stream`` (re-recording moves it to the stream's current end)."""
        event.record(stream)

    def wait_event(self, stream, event) -> None:
        """Make ``stream`` wait for ``event`` (no host block)."""
        stream.wait_event(event)

    def query(self, event) -> bool:
        """True when ``event`` has completed (no host block)."""
        return bool(event.query())

    def event_synchronize(self, event) -> None:
        """Block the calling host thread until ``event`` completed (the GIL is released meanwhile)."""
        event.synchronize()

    def synchronize(self) -> None:
        """Block until all work on the device finished (names the device: right on cuda:1 too)."""
        torch.cuda.synchronize(self.device)

    def elapsed_ms(self, start, end) -> float:
        """Milliseconds between two completed timing events."""
        return float(start.elapsed_time(end))

    def device_context(self):
        """Context that makes this device current (for the pump thread)."""
        return torch.cuda.device(self.device)


@dataclass(eq=False)  # identity: deque.remove must not compare tensors
class _Job:
    dst: torch.Tensor
    src: torch.Tensor
    ticket: Ticket
    free: object  # the slot's free event to wait for (None: never read), captured at submit


def busy_ms(spans: list[tuple[object, object]], elapsed_ms: Callable[[object, object], float]) -> float:
    """Milliseconds covered by the union of copy spans (start, end events), on any streams.

    The demand and prefetch streams can copy at the same time; summing their spans would count the
    shared time twice and understate the link's GB/s. Each span is placed on one time axis by its
    offset from the first span's start (``elapsed_ms`` of two events; CUDA's may be negative when
    the second event came first), then overlapping spans are merged.
    """
    if not spans:
        return 0.0
    ref = spans[0][0]
    intervals = sorted((elapsed_ms(ref, a), elapsed_ms(ref, b)) for a, b in spans)
    total, run_start, run_end = 0.0, intervals[0][0], intervals[0][1]
    for a, b in intervals[1:]:
        if a > run_end:
            total += run_end - run_start
            run_start, run_end = a, b
        else:
            run_end = max(run_end, b)
    return total + run_end - run_start


class CudaTransferEngine(TransferEngine):
    """Demand stream + windowed prefetch stream with a host-side, cancellable prefetch queue.

    Args:
        device: the CUDA device.
        num_slots: S, number of cache slots (one free and one done event each).
        window: most prefetch copies released to the prefetch stream and not yet finished.
        backend: the CUDA calls (default: the real ones on ``device``).
        pump: run the pump thread; False releases prefetches only when the host calls the engine
            (polling, deterministic: for tests with a fake backend).
    """

    def __init__(self, device: torch.device, num_slots: int, window: int = 2, backend=None,
                 pump: bool = True) -> None:
        self.device = device
        self.backend = backend if backend is not None else CudaBackend(device)
        self.window = window
        self.bytes_moved = 0
        self.timing = False
        self.demand_stream = self.backend.stream(high_priority=True)
        self.prefetch_stream = self.backend.stream(high_priority=False)
        self._free: list[object | None] = [None] * num_slots  # recorded on the compute stream at release
        self._done = [self.backend.event() for _ in range(num_slots)]
        self._last: list[tuple[object, object] | None] = [None] * num_slots  # (stream, done event) of the last copy
        self._queue: deque[_Job] = deque()  # prefetches not released yet, FIFO
        self._queued: dict[int, _Job] = {}  # slot -> its queued prefetch
        self._inflight: deque[object] = deque()  # marker events of released prefetches, oldest first
        self._markers = [self.backend.event() for _ in range(window)]
        self._spans: list[tuple[object, object]] = []  # timing (start, end) of copies since synchronize
        self._busy_s = 0.0
        self._cv = threading.Condition()
        self._closing = False
        self._error: BaseException | None = None
        self._thread = None
        if pump:
            self._thread = threading.Thread(target=self._pump, name="moespec-h2d-pump", daemon=True)
            self._thread.start()

    # --- issuing (always under self._cv) ----------------------------------------------------
    def _issue(self, job: _Job, stream) -> None:
        b, t = self.backend, job.ticket
        slot = t.slot
        if job.free is not None:
            # Why: kernels already queued on the compute stream may still read this slot's old
            # expert; overwriting it before they ran would corrupt their result.
            b.wait_event(stream, job.free)
        last = self._last[slot] if 0 <= slot < len(self._last) else None
        if last is not None and last[0] is not stream:
            # Why: the previous copy into this slot ran on the other stream; without this wait the two
            # could land in either order and the slot would hold the wrong expert.
            b.wait_event(stream, last[1])
        if self.timing:
            t.start, t.end = b.event(timing=True), b.event(timing=True)
            b.record(t.start, stream)
            b.copy(stream, job.dst, job.src)
            b.record(t.end, stream)
            t.done = t.end
            self._spans.append((t.start, t.end))
        else:
            b.copy(stream, job.dst, job.src)
            t.done = self._done[slot] if 0 <= slot < len(self._done) else b.event()
            b.record(t.done, stream)
        t.started = True
        if 0 <= slot < len(self._last):
            self._last[slot] = (stream, t.done)

    def _release(self, retire: bool = True) -> None:
        """Retire finished released prefetches (``retire``) and release queued ones up to the window.

        Never blocks. With a pump thread only the pump retires: a marker it waits on is never re-recorded.
        """
        while retire and self._inflight and self.backend.query(self._inflight[0]):
            self._markers.append(self._inflight.popleft())
        while self._queue and self._markers:
            job = self._queue.popleft()
            del self._queued[job.ticket.slot]
            self._issue(job, self.prefetch_stream)
            marker = self._markers.pop()
            self.backend.record(marker, self.prefetch_stream)
            self._inflight.append(marker)

    def _pump(self) -> None:
        try:
            with self.backend.device_context(), torch.inference_mode():
                while True:
                    with self._cv:
                        self._release()
                        while not self._closing and not (self._queue and self._inflight):
                            self._cv.wait()
                            self._release()
                        if self._closing:
                            return
                        oldest = self._inflight[0]
                    # Outside the lock: the host waits for the link, the compute thread carries on.
                    self.backend.event_synchronize(oldest)
        except BaseException as exc:  # surfaced on the compute side in wait()
            self._error = exc

    # --- the TransferEngine interface ---------------------------------------------------------
    def submit(self, dst: torch.Tensor, src: torch.Tensor, slot: int, prefetch: bool = False,
               ahead: bool = False) -> Ticket:
        nbytes = src.numel() * src.element_size()
        ticket = Ticket(nbytes=nbytes, slot=slot, prefetch=prefetch)  # ahead: one prefetch queue here
        free = self._free[slot] if 0 <= slot < len(self._free) else None
        job = _Job(dst, src, ticket, free)
        with self._cv:
            old = self._queued.pop(slot, None)
            if old is not None:  # superseded: its slot was taken before it was released
                self._drop(old)
            self.bytes_moved += nbytes
            if prefetch:
                self._queue.append(job)
                self._queued[slot] = job
                self._release(retire=self._thread is None)
                self._cv.notify()
            else:
                self._issue(job, self.demand_stream)
        return ticket

    def _drop(self, job: _Job) -> None:
        self._queue.remove(job)
        job.ticket.cancelled = True
        self.bytes_moved -= job.ticket.nbytes

    def cancel(self, ticket: Ticket) -> bool:
        with self._cv:
            job = self._queued.get(ticket.slot)
            if job is None or job.ticket is not ticket:
                return False  # released to a stream (or a demand copy): it will run
            del self._queued[ticket.slot]
            self._drop(job)
            return True

    def cancel_pending(self) -> list[Ticket]:
        # Only prefetches still in the host queue can be dropped; copies released to a stream run.
        with self._cv:
            dropped = [job.ticket for job in self._queue]
            for job in list(self._queue):
                self._drop(job)
            self._queued.clear()
        return dropped

    def wait(self, ticket: Ticket) -> Span | None:
        if self._error is not None:
            raise self._error
        if ticket.cancelled:
            return None  # it never runs: nothing to wait for
        b = self.backend
        with self._cv:
            job = self._queued.get(ticket.slot)
            if job is not None and job.ticket is ticket:  # needed now: promote to the demand stream
                del self._queued[ticket.slot]
                self._queue.remove(job)
                self._issue(job, self.demand_stream)
            elif self._thread is None:
                self._release()
        compute = b.current_stream()
        a = None
        if self.timing:
            a = b.event(timing=True)
            b.record(a, compute)
        # Why: the compute stream must not read the slot before its copy landed; waiting on this
        # one event (not a whole stream) keeps later copies overlapping the compute.
        b.wait_event(compute, ticket.done)
        ticket.waited = True
        if a is None:
            return None
        end = b.event(timing=True)
        b.record(end, compute)
        return Span(a, end)

    def landed(self, ticket: Ticket) -> bool:
        if ticket.cancelled or ticket.waited:
            return True
        with self._cv:  # done is None while the copy waits in the host queue
            done = ticket.done
        return done is not None and self.backend.query(done)

    def slot_released(self, slot: int) -> None:
        if self._free[slot] is None:
            self._free[slot] = self.backend.event()
        # Re-recording is safe: copies issued earlier captured the previous record when they waited.
        self.backend.record(self._free[slot], self.backend.current_stream())

    def set_timing(self, on: bool) -> None:
        self.timing = bool(on)

    def mark(self):
        ev = self.backend.event(timing=True)
        self.backend.record(ev, self.backend.current_stream())
        return ev

    def synchronize(self) -> None:
        with self._cv:
            while self._queue:  # why: a queued prefetch must not land after this returns
                job = self._queue.popleft()
                del self._queued[job.ticket.slot]
                self._issue(job, self.prefetch_stream)
        self.backend.synchronize()
        with self._cv:
            self._release(retire=self._thread is None)
            if self._thread is not None:
                self._cv.notify()  # the pump retires the (now finished) released copies
            self._busy_s += busy_ms(self._spans, self.backend.elapsed_ms) / 1e3
            self._spans.clear()

    def busy_seconds(self) -> float:
        """Seconds the link was busy: the union of the timed copies' spans on both streams (copies that
        overlap count once, so bytes / busy_seconds is the link's GB/s); timed copies only."""
        return self._busy_s

    def close(self) -> None:
        if self._closing:
            return
        self.synchronize()  # why: the slots and the pinned store may be freed right after
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

