"""ExpertBatch: one layer's host experts computed by worker threads as ONE batch, split by experts or by rows.

Shapes: t tokens of one expert, H hidden, I expert intermediate.

A GLU expert is two Linear-shaped products around an elementwise step: h = glu(x @ W1.T) [t, I],
y = h @ W2.T [t, H] (moespec.kernels.linear computes each). The batch cuts a layer's experts into
units of work that idle workers pull from one shared list (no unit is bound to a thread):

  - ``Split.EXPERTS``: one unit per expert (both products and the GLU): no synchronisation at all.
  - ``Split.ROWS``: each product cut into ranges of output rows (one per worker), first every
    expert's W1 ranges, then every expert's W2 ranges; the worker that finishes an expert's last W1
    range runs its GLU and releases its W2 ranges. Use: fewer experts than workers (one expert on
    N workers takes ~1/N of its time instead of all of it).
  - ``Split.AUTO``: EXPERTS when the experts fill every worker evenly (as many as workers, or
    several per worker), else ROWS (measured: scripts/host_expert_bench.py, README "Host experts").

The batch's future resolves when the last unit ends, whichever worker runs it: the caller never
waits for a worker that has nothing left to do (a worker that arrives after the list is empty
returns at once, and nothing waits for it). Layouts without Linear-shaped weights (GPT-OSS) give a
``forward`` callable only: one unit per expert. An EXPERTS unit runs ``forward`` when given (the
layout's own, e.g. the one-call SwiGLU kernel), so it equals the device path bit for bit.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from moespec.kernels import linear as L

ROW_ALIGN = 8  # row ranges are multiples of 8 rows (the kernels' row blocks)


class Split(str, enum.Enum):
    """How a batch is cut into units (see the module docstring)."""

    AUTO = "auto"
    EXPERTS = "experts"
    ROWS = "rows"


@dataclass
class ExpertJob:
    """One expert of a batch.

    Attributes:
        x: [t, H] tokens (any device: ``load`` brings them to the host).
        weights: (W1 [2I, H], W2 [H, I]) as moespec.kernels.linear takes them (ROWS splits), or None.
        glu: [t, 2I] -> [t, I] (the layout's act_and_mul).
        act_int8: the CPU kernels quantise activations (not exact).
        forward: x -> [t, H], the whole expert (one unit; e.g. the one-call kernel, or a layout
            without Linear-shaped weights); None: the two products above.
        load: x -> host tokens (e.g. a d2h copy), run by the first unit of the expert.
        store: y -> the result as the caller wants it (e.g. an h2d copy), run by its last unit.
    """

    x: torch.Tensor
    weights: tuple | None
    glu: Callable | None = None
    act_int8: bool = False
    forward: Callable | None = None
    load: Callable = lambda x: x
    store: Callable = lambda y: y


@dataclass
class ExpertDone:
    """A finished expert: ``y`` (what ``store`` returned), its first start and last end
    (perf_counter s) and ``busy_s``, the seconds its units ran (summed over workers)."""

    y: torch.Tensor
    start: float
    end: float
    busy_s: float


_NO_LOCK = contextlib.nullcontext()  # an expert unit is its state's only user: no lock to take


@dataclass
class _State:
    """One expert's progress. ``lock`` and ``glu_ready`` are real only when it is cut by rows (its
    units run on several workers at once); an expert unit needs neither (a Lock and an Event cost
    ~6 us an expert to make, 2 % of an int4 expert)."""

    job: ExpertJob
    lock: threading.Lock | contextlib.nullcontext = _NO_LOCK
    xh: torch.Tensor | None = None  # host tokens
    p1: L.Prepared | None = None
    y1: torch.Tensor | None = None  # [t, 2I] float32
    h: torch.Tensor | None = None  # [t, I]
    p2: L.Prepared | None = None
    y2: torch.Tensor | None = None  # [t, H]
    left1: int = 0  # W1 ranges not finished
    left2: int = 0
    glu_ready: threading.Event | None = None
    start: float = float("inf")
    end: float = 0.0
    busy: float = 0.0


def _ranges(rows: int, parts: int) -> list[tuple[int, int]]:
    """``rows`` cut into at most ``parts`` ranges of multiples of ROW_ALIGN rows."""
    step = -(-rows // max(parts, 1))
    step = -(-step // ROW_ALIGN) * ROW_ALIGN
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def choose_split(split: Split, experts: int, workers: int) -> Split:
    """AUTO -> EXPERTS when ``experts`` fill ``workers`` evenly (a multiple, or at least 2 per worker), else ROWS."""
    if split != Split.AUTO:
        return split
    if workers <= 1 or experts % workers == 0 or experts >= 2 * workers:
        return Split.EXPERTS
    return Split.ROWS


class ExpertBatch:
    """The experts of one layer as units for ``workers`` threads (see the module docstring).

    Args:
        jobs: the experts, in the order of the results.
        split: how to cut them (AUTO resolves with :func:`choose_split`).
        workers: threads that will call :meth:`run`.
    """

    def __init__(self, jobs: list[ExpertJob], split: Split, workers: int) -> None:
        self.states = [_State(j) for j in jobs]
        self.future: Future = Future()
        kernel_jobs = all(j.weights is not None for j in jobs)  # only those can be cut by rows
        self.split = choose_split(split, len(jobs), workers) if kernel_jobs else Split.EXPERTS
        self.units: list[tuple] = []
        if self.split == Split.EXPERTS:
            self.units = [("expert", s) for s in self.states]
        else:
            for s in self.states:
                s.lock, s.glu_ready = threading.Lock(), threading.Event()
                w1, _ = s.job.weights
                s.left1 = len(r := _ranges(L.rows_of(w1), workers))
                self.units += [("w1", s, a, b) for a, b in r]
            for s in self.states:
                _, w2 = s.job.weights
                s.left2 = len(r := _ranges(L.rows_of(w2), workers))
                self.units += [("w2", s, a, b) for a, b in r]
        self._next = itertools.count()  # next() is atomic under the GIL: each unit is taken once
        self._left = len(self.units)
        self._lock = threading.Lock()
        self._failed = False
        if not self.units:
            self.future.set_result([])

    @property
    def num_units(self) -> int:
        return len(self.units)

    def run(self) -> None:
        """Worker body: take units until none is left; the last one resolves :attr:`future`."""
        with torch.inference_mode():
            while True:
                i = next(self._next)
                if i >= len(self.units) or self._failed:
                    return
                unit = self.units[i]
                t0 = time.perf_counter()
                try:
                    self._unit(unit)
                except BaseException as exc:  # the caller re-raises it from the future
                    self._failed = True
                    for st in self.states:  # release W2 units waiting for a GLU that will not come
                        if st.glu_ready is not None:
                            st.glu_ready.set()
                    if not self.future.done():
                        self.future.set_exception(exc)
                    return
                t1 = time.perf_counter()
                s = unit[1]
                with s.lock:
                    s.start, s.end, s.busy = min(s.start, t0), max(s.end, t1), s.busy + t1 - t0
                with self._lock:
                    self._left -= 1
                    last = self._left == 0
                if last:
                    self.future.set_result([ExpertDone(s.y2, s.start, s.end, s.busy) for s in self.states])

    def _host_x(self, s: _State) -> torch.Tensor:
        with s.lock:
            if s.xh is None:
                s.xh = s.job.load(s.job.x)
            return s.xh

    def _unit(self, unit: tuple) -> None:
        kind, s = unit[0], unit[1]
        job = s.job
        if kind == "expert":
            x = self._host_x(s)
            if job.forward is not None:
                s.y2 = job.store(job.forward(x))
                return
            w1, w2 = job.weights
            h = job.glu(L.linear(x, w1, job.act_int8))  # [t, I]
            s.y2 = job.store(L.linear(h, w2, job.act_int8))  # [t, H]
            return
        a, b = unit[2], unit[3]
        w1, w2 = job.weights
        if kind == "w1":
            x = self._host_x(s)
            with s.lock:
                if s.p1 is None:
                    s.p1 = L.prepare(x, w1, job.act_int8)
                    s.y1 = L.new_output(s.p1, L.rows_of(w1))
            L.run_rows(s.p1, w1, s.y1, a, b)
            with s.lock:
                s.left1 -= 1
                done = s.left1 == 0
            if done:  # this worker finished the expert's W1: its GLU, then its W2 ranges may start
                s.h = job.glu(L.finish(s.p1, s.y1))
                s.p2 = L.prepare(s.h, w2, job.act_int8)
                s.y2 = L.new_output(s.p2, L.rows_of(w2))
                s.glu_ready.set()
            return
        s.glu_ready.wait()  # W2 units come after every W1 unit: at most one W1 range is still running
        if self._failed:
            return
        L.run_rows(s.p2, w2, s.y2, a, b)
        with s.lock:
            s.left2 -= 1
            done = s.left2 == 0
        if done:
            s.y2 = job.store(L.finish(s.p2, s.y2))
