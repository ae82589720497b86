"""FIFO of generation jobs served by one worker thread (batch 1).

The model runs one generation at a time, so one thread owns the Engine and takes jobs in
arrival order. Admission is bounded: one job runs and at most ``max_waiting`` wait; a job past
that is refused with QueueFull (HTTP 429) and a Retry-After estimate. A job cancelled while it
waits leaves the queue at once; a running job sees its ``cancelled`` event between tokens.
Events travel from the worker to the request's asyncio loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional


class QueueClosed(Exception):
    """Refused: the server is shutting down."""


class QueueFull(Exception):
    """Refused: ``waiting`` jobs wait already; retry after ``retry_after_s`` seconds."""

    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(f"{waiting} requests are waiting")
        self.waiting = waiting
        self.retry_after_s = retry_after_s


@dataclass
class Job:
    """One generation request on its way through the queue.

    Attributes:
        work: runs on the worker thread with this job (emits events, returns nothing).
        loop: the asyncio loop of the request; events are delivered into ``events`` there.
        events: (kind, payload) tuples: ("text", str), ("done", Outcome), ("error", Exception),
            ("gone", None) (the client disconnected).
        cancelled: set when the client went away; the worker stops between tokens.
        created_s: perf_counter seconds when the request arrived.
        started_s: perf_counter seconds when the worker took it (None while waiting).
        tokens: tokens generated so far (written by the worker).
        tokens_at_cancel: ``tokens`` when the cancel was requested (None: never cancelled).
        tokens_at_stop: ``tokens`` when the worker stopped generating.
        closed: the server shut down under this job (its answer is incomplete: 503).
        answered: its last event ("done" or "error") was emitted: admission no longer counts it,
            though the worker may still be tidying up after it (``counts`` still shows it running).
    """

    work: Callable[["Job"], None]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    created_s: float = field(default_factory=time.perf_counter)
    started_s: Optional[float] = None
    tokens: int = 0
    tokens_at_cancel: Optional[int] = None
    tokens_at_stop: Optional[int] = None
    closed: bool = False
    answered: bool = False

    def emit(self, kind: str, payload: object) -> None:
        """Deliver an event to the request (any thread)."""
        if kind in ("done", "error"):
            # Why before the delivery: a client that has its answer may ask again at once; the
            # queue's admission must not count this job then (a spurious 429 at --max-queue 0).
            self.answered = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass


class GenerationQueue:
    """One worker thread, FIFO, bounded admission.

    Args:
        max_waiting: most jobs that may wait while one runs (``--max-queue``).
        on_change: called (any thread) with (running, waiting) whenever they change.
    """

    def __init__(self, max_waiting: int, on_change: Callable[[int, int], None] = lambda r, w: None) -> None:
        self.max_waiting = max_waiting
        self.on_change = on_change
        self.running: Optional[Job] = None
        self.finished: list[Job] = []  # the last few finished jobs, newest last (for inspection)
        self._waiting: deque[Job] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._mean_s = 1.0  # running mean of a job's duration, for Retry-After
        self._thread = threading.Thread(target=self._loop, name="moespec-serve-worker", daemon=True)
        self._thread.start()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) now."""
        with self._cv:
            return int(self.running is not None), len(self._waiting)

    def _busy_running(self) -> bool:
        """A job runs and has not yet been answered (call with ``_cv`` held)."""
        return self.running is not None and not self.running.answered

    def submit(self, job: Job) -> None:
        """Append ``job`` to the queue.

        Raises:
            QueueFull: ``max_waiting`` jobs wait already (one more would exceed --max-queue).
            QueueClosed: the queue is closing (the server shuts down).
        """
        with self._cv:
            if self._closing:
                raise QueueClosed()
            # Why count the running job too: a job that arrived together with others must not be
            # refused only because the worker has not yet taken the first one off the queue.
            busy = len(self._waiting) + self._busy_running()
            if busy >= self.max_waiting + 1:
                raise QueueFull(len(self._waiting), max(1, math.ceil(self._mean_s * busy)))
            self._waiting.append(job)
            self._cv.notify()
        self._changed()

    def cancel(self, job: Job) -> None:
        """The client went away: drop ``job`` if it waits, else tell the worker to stop it."""
        if job.tokens_at_cancel is None:
            job.tokens_at_cancel = job.tokens
        job.cancelled.set()
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:
                return
        self._changed()

    def close(self, wait: bool = True) -> None:
        """Stop the worker: the running job stops at its next token, waiting jobs are dropped.

        Every job not finished is marked ``closed`` and hears "done" (its handler answers 503);
        ``wait`` joins the worker thread. Idempotent.
        """
        with self._cv:
            self._closing = True
            if self.running is not None:
                self.running.closed = True
                self.running.cancelled.set()
            for job in self._waiting:
                job.closed = True
                job.cancelled.set()
                job.emit("done", [])
            self._waiting.clear()
            self._cv.notify()
        if wait:
            self._thread.join(timeout=30)

    def _changed(self) -> None:
        self.on_change(*self.counts())

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                job = self._waiting.popleft()
                self.running = job
            self._changed()
            job.started_s = time.perf_counter()
            try:
                job.work(job)
            except BaseException as exc:  # answered to the client; the worker keeps serving
                job.emit("error", exc)
            took = time.perf_counter() - job.started_s
            with self._cv:
                self.running = None
                self._mean_s = 0.8 * self._mean_s + 0.2 * took
                self.finished = (self.finished + [job])[-16:]
            self._changed()
