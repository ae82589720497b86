"""The transfer engine interface: host -> device copies of packed experts (Span, Ticket, TransferEngine).

Host -> device copies of packed experts run beside the compute of the running layer; the compute
side waits only on the copy of the slot it is about to read. Two kinds of copy exist: a demand copy
(an expert the running layer needs now) and a prefetch copy (a predicted expert of a later layer).

What happens on each device:

- CPU (:class:`~moespec.runtime.transfer.thread.ThreadTransferEngine`, thread.py): one worker
  thread copies (``Tensor.copy_``), optionally throttled to an emulated link (``link_gbps``), so
  overlap, stall and bytes are real measurements without a GPU. Its queue is a priority queue: a demand copy runs before every prefetch copy that is
  still queued (FIFO within each kind); the copy that is running finishes first. A prefetch that has
  not started can be cancelled (``cancel``): it never runs and its bytes are not counted.
- CUDA (:class:`~moespec.runtime.transfer.cuda.CudaTransferEngine`, cuda.py): a CUDA stream is FIFO and an
  issued copy cannot be cancelled, so prefetches are held in a host-side queue and released to a
  prefetch stream at most ``window`` (2) at a time, by a pump thread that waits on the oldest
  released copy. Demand copies go at once to a separate demand stream, so they never queue behind
  prefetches: they start immediately and share the link with at most the ``window`` released
  prefetches. A prefetch still in the host queue can be cancelled for real; one that the compute
  side waits for before its release is promoted to the demand stream. See cuda.py.

On both, a copy into a slot supersedes a still-queued prefetch into the same slot, and
``bytes_moved`` counts exactly the bytes of the copies that run.
"""

from __future__ import annotations

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
        ahead: a prefetch for the layer after the next (l+2): it yields to every demand copy and to
            every prefetch for the next layer (engines with a priority queue; others treat it as a
            prefetch) until ``confirm`` or ``promote`` moves it up.
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
    ahead: bool = False


class TransferEngine:
    """Common interface; the loader makes one per model (runtime.load.make_transfer_engine)."""

    bytes_moved: int = 0

    def submit(self, dst: torch.Tensor, src: torch.Tensor, slot: int, prefetch: bool = False,
               ahead: bool = False) -> Ticket:
        """Start copying packed expert ``src`` [P] (host) into ``dst`` [P] (device slot ``slot``).

        ``prefetch`` copies yield to demand copies that were queued later, where the engine can reorder;
        ``ahead`` (with ``prefetch``) ones yield to those and to every other prefetch (Ticket.ahead).
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

    def abort(self, ticket: Ticket) -> int:
        """Stop a started copy that nobody will read (a wrong prefetch whose layer came): the parts of
        it not started are dropped. Returns the bytes they held, off ``bytes_moved`` (0: nothing
        dropped, the copy runs to its end, the default). The destination then holds no valid expert;
        a later copy into its slot still waits for the parts running now."""
        return 0

    def promote(self, ticket: Ticket) -> None:
        """A queued prefetch ``ticket`` is needed by the layer about to run: what of it has not started
        goes with the demand copies, in its own queue place (before demand copies queued after it).
        Engines that cannot reorder keep it where it is (the default)."""

    def confirm(self, ticket: Ticket) -> None:
        """The ahead copy ``ticket`` is now the next layer's prediction too: what of it has not started
        goes with the other prefetches, in its own queue place. Engines without levels: nothing to do."""
        ticket.ahead = False

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
