"""CopyQueue: the demand-first, cancellable queue both CPU engines share (thread.py copies, disk.py reads).

A job is (dst, src, ticket). Demand jobs (priority 0) go before every queued prefetch (1), and those
before every queued ahead prefetch (1.5: for the layer after the next, Ticket.ahead), FIFO within each; a job into a slot supersedes a prefetch into that slot still queued; a prefetch
not yet started can be cancelled, and ``bytes_moved`` then forgets its bytes. Sentinels use
priorities 2 (synchronize) and 3 (stop). The engine's workers pop under ``_cv``.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

from moespec.runtime.transfer.base import Ticket

DEMAND, PREFETCH, AHEAD = 0, 1, 1.5  # heap priorities (module docstring); sentinels use 2 and 3


def priority(ticket: Ticket) -> float:
    """The heap priority of ``ticket``'s job: DEMAND, PREFETCH or AHEAD."""
    return (AHEAD if ticket.ahead else PREFETCH) if ticket.prefetch else DEMAND


class CopyQueue:
    """The queue state and its two operations that need the lock (mixed into an engine)."""

    def _init_queue(self) -> None:
        self.bytes_moved = 0
        self._heap: list = []  # (priority, sequence, job)
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._queued: dict[int, Ticket] = {}  # slot -> its prefetch still in the queue

    def _enqueue_locked(self, dst, src, ticket: Ticket) -> None:
        """Queue one job (holding ``_cv``): drops a queued prefetch into the same slot, counts its bytes."""
        # Why: a demand job into this slot would run before a queued prefetch into it (priority),
        # which would then overwrite it; the queued one is unwanted (its slot was taken), drop it.
        old = self._queued.pop(ticket.slot, None)
        if old is not None:
            self._cancel_locked(old)
        if ticket.prefetch:
            self._queued[ticket.slot] = ticket
        self.bytes_moved += ticket.nbytes
        heapq.heappush(self._heap, (priority(ticket), next(self._seq), (dst, src, ticket)))
        self._cv.notify()

    def _cancel_locked(self, ticket: Ticket) -> bool:
        if ticket.started or ticket.cancelled or ticket.done.is_set():
            return False
        ticket.cancelled = True
        self.bytes_moved -= ticket.nbytes
        return True

    def cancel(self, ticket: Ticket) -> bool:
        """Drop a job that has not started; True when it will never run (its bytes are not moved)."""
        with self._cv:
            return self._cancel_locked(ticket)

    def landed(self, ticket: Ticket) -> bool:
        """Finished, waited or cancelled (never blocks)."""
        return ticket.cancelled or ticket.waited or ticket.done.is_set()

    def mark(self) -> float:
        """perf_counter seconds: the CPU engines' clock."""
        return time.perf_counter()
