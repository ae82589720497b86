"""ThreadTransferEngine: the CPU transfer engine, copies on one worker thread, optionally throttled.

Without a GPU the copies of packed experts still run beside the compute: a worker thread copies
(``Tensor.copy_``), optionally throttled to an emulated link (``link_gbps``), so overlap, stall and
bytes are real measurements. Its queue is a priority queue: a demand copy runs before every prefetch
copy that is still queued (FIFO within each kind); the copy that is running finishes first. A
prefetch that has not started can be cancelled: it never runs and its bytes are not counted.
"""

from __future__ import annotations

import heapq
import threading
import time

import torch

from moespec.runtime.transfer.base import Span, Ticket, TransferEngine
from moespec.runtime.transfer.queue import CopyQueue


class ThreadTransferEngine(CopyQueue, TransferEngine):
    """CPU: copies on one worker thread, FIFO like a copy stream, optionally throttled.

    Args:
        link_gbps: emulated link bandwidth in GB/s (10^9 bytes/s); None = as fast as memcpy.
    """

    def __init__(self, link_gbps: float | None = None) -> None:
        self.link_gbps = link_gbps
        self._init_queue()  # demand copies go before queued prefetches, FIFO within (queue.py)
        self._busy_s = 0.0
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

    def submit(self, dst: torch.Tensor, src: torch.Tensor, slot: int, prefetch: bool = False,
               ahead: bool = False) -> Ticket:
        nbytes = src.numel() * src.element_size()
        ticket = Ticket(nbytes=nbytes, slot=slot, done=threading.Event(), prefetch=prefetch, ahead=prefetch and ahead)
        with self._cv:
            self._enqueue_locked(dst, src, ticket)
        return ticket

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
