"""A CPU stand-in for the CUDA calls of CudaTransferEngine, with CUDA's semantics, that checks ordering.

Semantics modelled: each stream runs its operations in issue order (FIFO); an event records the point
of its stream it was recorded at and completes when the stream got there; ``wait_event`` orders a
stream after that point; an issued copy cannot be withdrawn; copy streams make progress only when
something needs them (a wait, a query, a synchronize) or, with ``advance_p`` > 0, at random moments
(delayed or early completion). Compute runs on the host at once (CPU tensors), so the compute
stream is always caught up: waiting on an event runs the copy streams up to that event.

A copy's destination is poisoned (NaN / 0xFF) when it is issued and written when it runs, so a read of
a slot whose copy has not run shows up in the numbers, and three orderings are checked as they are
issued (violations are collected in ``violations``):

A. compute reads slot s only after waiting on an event that follows the latest copy into s;
B. every copy into s is ordered after the compute's last read of s (a free event recorded after it);
C. every copy into s is ordered after the previous copy into s (same stream, or a wait on its event).
"""

from __future__ import annotations

import contextlib
import random
from collections import deque

import torch


class FakeEvent:
    def __init__(self, timing: bool) -> None:
        self.timing = timing
        self.complete = True  # CUDA: an event never recorded counts as complete
        self.stream: FakeStream | None = None
        self.covers: dict[str, int] = {}  # stream name -> last copy seq ordered before this event
        self.compute_pos = -1  # compute reads ordered before this event
        self.t = 0.0

    def query(self) -> bool:
        return self.complete

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.complete and end.complete, "elapsed_time of an unfinished event"
        return end.t - self.t


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: deque = deque()
        self.seq = 0  # copies enqueued
        self.covers: dict[str, int] = {}  # what the stream's tail is ordered after
        self.after_compute = -1


def _merge(into: dict[str, int], other: dict[str, int]) -> None:
    for k, v in other.items():
        into[k] = max(into.get(k, -1), v)


class FakeCudaBackend:
    """Implements CudaBackend's methods on CPU. ``slot_of`` maps a destination data_ptr to its slot.

    Args:
        advance_p: chance that a call lets one random copy stream run one operation early.
        seed: for the random advances.
    """

    def __init__(self, advance_p: float = 0.0, seed: int = 0) -> None:
        self.compute = FakeStream("compute")
        self.streams: list[FakeStream] = []
        self.rng = random.Random(seed)
        self.advance_p = advance_p
        self.slot_of: dict[int, int] = {}
        self.compute_pos = 0
        self.compute_known: dict[str, int] = {}
        self.last_read: dict[int, int] = {}
        self.latest_copy: dict[int, tuple[str, int]] = {}
        self.violations: list[str] = []
        self.bytes_copied = 0
        self.copies_run = 0
        self.clock = 0.0

    # --- helpers ---------------------------------------------------------------------------
    def _tick(self) -> float:
        self.clock += 1.0
        return self.clock

    def _step(self, s: FakeStream) -> None:
        op = s.ops.popleft()
        if op[0] == "copy":
            _, dst, src, nbytes = op
            dst.copy_(src)
            self.bytes_copied += nbytes
            self.copies_run += 1
        elif op[0] == "record":
            op[1].complete, op[1].t = True, self._tick()
        else:  # wait: the stream cannot pass until the event completed
            self._drive(op[1])

    def _drive(self, ev: FakeEvent) -> None:
        while not ev.complete:
            self._step(ev.stream)

    def _maybe_advance(self) -> None:
        busy = [s for s in self.streams if s.ops]
        if busy and self.rng.random() < self.advance_p:
            s = self.rng.choice(busy)
            if s.ops[0][0] != "wait" or s.ops[0][1].complete:
                self._step(s)

    # --- the CudaBackend interface ------------------------------------------------------------
    def stream(self, high_priority: bool) -> FakeStream:
        s = FakeStream(f"s{len(self.streams)}{'hi' if high_priority else 'lo'}")
        self.streams.append(s)
        return s

    def event(self, timing: bool = False) -> FakeEvent:
        return FakeEvent(timing)

    def current_stream(self) -> FakeStream:
        return self.compute

    def copy(self, stream: FakeStream, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._maybe_advance()
        stream.seq += 1
        stream.covers[stream.name] = stream.seq - 1  # FIFO: earlier copies of this stream come first
        slot = self.slot_of.get(dst.data_ptr())
        if slot is not None:
            if stream.after_compute < self.last_read.get(slot, -1):
                self.violations.append(f"B: copy into slot {slot} not ordered after its last read")
            prev = self.latest_copy.get(slot)
            if prev is not None and stream.covers.get(prev[0], -1) < prev[1]:
                self.violations.append(f"C: copy into slot {slot} may land before the previous one")
            self.latest_copy[slot] = (stream.name, stream.seq)
        stream.covers[stream.name] = stream.seq
        dst.fill_(float("nan") if dst.is_floating_point() else 255)  # undefined until the copy ran
        stream.ops.append(("copy", dst, src, src.numel() * src.element_size()))

    def record(self, ev: FakeEvent, stream: FakeStream) -> None:
        self._maybe_advance()
        ev.stream = stream
        if stream is self.compute:
            ev.complete, ev.t = True, self._tick()
            ev.covers, ev.compute_pos = dict(self.compute_known), self.compute_pos
            return
        ev.complete = False
        ev.covers, ev.compute_pos = dict(stream.covers), stream.after_compute
        stream.ops.append(("record", ev))

    def wait_event(self, stream: FakeStream, ev: FakeEvent) -> None:
        if ev.stream is None:
            return  # never recorded: nothing to wait for
        if stream is self.compute:
            self._drive(ev)
            _merge(self.compute_known, ev.covers)
            return
        _merge(stream.covers, ev.covers)
        stream.after_compute = max(stream.after_compute, ev.compute_pos)
        stream.ops.append(("wait", ev))

    def query(self, ev: FakeEvent) -> bool:
        self._maybe_advance()
        return ev.complete

    def event_synchronize(self, ev: FakeEvent) -> None:
        self._drive(ev)

    def synchronize(self) -> None:
        while any(s.ops for s in self.streams):
            for s in self.streams:
                while s.ops:
                    self._step(s)

    def elapsed_ms(self, a: FakeEvent, b: FakeEvent) -> float:
        assert a.complete and b.complete, "elapsed_time of an unfinished event"
        return b.t - a.t

    def device_context(self):
        return contextlib.nullcontext()

    # --- what the compute side does -----------------------------------------------------------
    def read(self, slot: int) -> None:
        """Compute is about to read ``slot`` (called from the cache's row())."""
        latest = self.latest_copy.get(slot)
        if latest is not None and self.compute_known.get(latest[0], -1) < latest[1]:
            self.violations.append(f"A: slot {slot} read before its latest copy was waited for")
        self.compute_pos += 1
        self.last_read[slot] = self.compute_pos

    def pending(self) -> int:
        """Operations not yet run on the copy streams."""
        return sum(len(s.ops) for s in self.streams)
