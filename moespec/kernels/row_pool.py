"""RowPool: persistent worker threads that share one product's output rows (or one task) with the caller.

Shapes: R output rows of one Linear-shaped weight, cut into chunks of ROW_ALIGN-multiple rows.

Why not torch's intra-op threads: a decode step of a small model is hundreds of tiny ops (norms,
RoPE, routers, [1, 576] elementwise steps), and with two OpenMP threads many of them fork and join
a team (MKL and oneDNN thread even a 16 x 576 product); on this 2-core VM each fork/join costs more
than the op (measured: docs/decisions.md, "A thread plan for decode"). The plan (runtime/threads.py)
keeps torch at ONE intra-op thread during a decode step, and the work that can use a second core
comes here explicitly:

  - :meth:`RowPool.split`: a weight-reading product cut into row chunks that the caller and every
    idle worker pull from one counter (no chunk is bound to a thread: a worker that wakes late takes
    fewer, one that finds none left returns at once, and the caller waits only for a chunk a worker
    is still running). The native kernels release the GIL for each chunk (kernels/linear.run_rows),
    so chunks run at the same time.
  - :meth:`RowPool.start`: one whole task (the shared expert of an MoE layer) on an idle worker
    while the caller goes on; None when no worker is idle (the caller then runs it itself).

Each worker runs with one intra-op thread (torch.set_num_threads(1) on the worker), so a worker's
torch op never fans out over the caller's core. A task's exception is re-raised in the caller.
Results: a row's value does not depend on which thread computed it or where its chunk starts
(chunks start at multiples of ROW_ALIGN, the kernels' row blocks), so a split product is bit-equal
to the unsplit one (tests/test_thread_plan.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import queue
import threading
from typing import Callable, Iterator

import torch

ROW_ALIGN = 8  # chunk starts are multiples of 8 rows (the native kernels' row blocks)

# The pool of the decode step running in this thread (runtime/threads.ThreadPlan sets it for the
# step). A context variable, not a global: other threads (host-pool workers, this pool's own
# workers) see None, so their products never nest a split.
_ACTIVE: contextvars.ContextVar["RowPool | None"] = contextvars.ContextVar("moespec_row_pool", default=None)


def active() -> "RowPool | None":
    """The RowPool this thread's decode step may use, or None (run serially)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def using(pool: "RowPool | None") -> Iterator[None]:
    """Within the block, :func:`active` returns ``pool`` in this thread."""
    token = _ACTIVE.set(pool)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def chunks(rows: int, parts: int) -> list[tuple[int, int]]:
    """``rows`` cut into at most ``parts`` ranges whose starts are multiples of ROW_ALIGN."""
    step = -(-rows // max(parts, 1))
    step = max(ROW_ALIGN, -(-step // ROW_ALIGN) * ROW_ALIGN)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


class Ticket:
    """A task started on a worker (:meth:`RowPool.start`); :meth:`result` waits for it."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn = fn
        self._done = threading.Lock()
        self._done.acquire()  # released by the worker when fn has run
        self._value: object = None
        self._error: BaseException | None = None

    def _run(self, release: Callable[[], None]) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:  # re-raised in the caller
            self._error = exc
        finally:
            release()  # the worker is idle before the caller learns the result
            self._done.release()

    def result(self):
        """What the task returned (re-raises what it raised)."""
        with self._done:
            pass
        if self._error is not None:
            raise self._error
        return self._value


class _Split:
    """One product's chunks, pulled by the caller and the workers from one counter."""

    def __init__(self, fn: Callable[[int, int], None], ranges: list[tuple[int, int]]) -> None:
        self.fn, self.ranges = fn, ranges
        self._next = itertools.count()  # next() is atomic under the GIL: each chunk is taken once
        self._left = len(ranges)
        self._lock = threading.Lock()
        self._done = threading.Lock()
        self._done.acquire()  # released by whoever finishes the last chunk
        self.error: BaseException | None = None

    def work(self, release: Callable[[], None] | None = None) -> None:
        """Run chunks until none is left; a worker passes ``release`` (marks it idle: called once,
        before it signals the last chunk, so the caller's next product finds it idle)."""
        n = len(self.ranges)
        while (i := next(self._next)) < n:
            try:
                if self.error is None:
                    self.fn(*self.ranges[i])
            except BaseException as exc:
                self.error = exc
            finally:
                with self._lock:
                    self._left -= 1
                    last = self._left == 0
                if last:
                    if release is not None:
                        release()
                        release = None
                    self._done.release()
        if release is not None:
            release()

    def wait(self) -> None:
        with self._done:
            pass
        if self.error is not None:
            raise self.error


class RowPool:
    """``workers`` daemon threads that help the caller (module docstring).

    Args:
        workers: worker threads (the caller is one more: a pool for N cores has N - 1).

    Raises:
        ValueError: ``workers`` < 1 (a programming error: the plan makes no pool for one core).
    """

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a RowPool needs at least one worker, not {workers}")
        self.workers = workers
        self.beside = True  # False: start() refuses every task (the caller runs it; ThreadPlan.shared_beside)
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = workers  # workers with no task (read without the lock: a hint, never a wait)
        self._idle_lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._loop, name=f"moespec-rows-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    @property
    def idle(self) -> int:
        """Workers with no task right now."""
        return self._idle

    def _take(self, n: int) -> int:
        """Reserve up to ``n`` idle workers; returns how many were reserved."""
        with self._idle_lock:
            got = min(n, self._idle)
            self._idle -= got
        return got

    def _loop(self) -> None:
        torch.set_num_threads(1)  # this worker's torch ops use one thread: the pool is the parallelism
        while True:
            task = self._tasks.get()
            if task is None:
                return
            task(self._release)  # the task marks the worker idle (once) before it signals its caller

    def _release(self) -> None:
        with self._idle_lock:
            self._idle += 1

    def split(self, fn: Callable[[int, int], None], rows: int, chunk_count: int) -> None:
        """Run ``fn(r0, r1)`` over ``rows`` cut into ``chunk_count`` chunks (:func:`chunks`), the caller
        and every idle worker together; returns when every chunk has run. With no idle worker the
        caller runs them all (one ``fn(0, rows)`` call). Re-raises the first exception a chunk raised."""
        helpers = self._take(self.workers) if chunk_count > 1 and not self._closed else 0
        if helpers == 0:
            fn(0, rows)
            return
        job = _Split(fn, chunks(rows, chunk_count))
        for _ in range(helpers):
            self._tasks.put(job.work)
        job.work()
        job.wait()

    def start(self, fn: Callable[[], object]) -> Ticket | None:
        """Run ``fn()`` on an idle worker and return its Ticket, or None when no worker is idle (then
        the caller runs ``fn`` itself)."""
        if self._closed or not self.beside or self._take(1) == 0:
            return None
        ticket = Ticket(fn)
        self._tasks.put(ticket._run)  # run(release)
        return ticket

    def close(self) -> None:
        """Stop the workers after the tasks already queued (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads:
            t.join()
