"""HostExpertPool: cache misses computed on the host from their ExpertStore rows, on worker threads.

Shapes: t tokens routed to one expert, H hidden, P packed elements per expert.

A missed expert either moves to the device (a P-element copy into a cache slot) or stays where its
weights are: its t token rows go to the host (d2h, t x H), the host computes the expert from its
store row (pinned memory on CUDA; packed MXFP4 rows are dequantised there by the layout), and only
the [t, H] output comes back (h2d). Fiddler (Kamahori et al. 2024) and llama.cpp's ``--cpu-moe``
do the same for every routed expert; here it is chosen per miss (planner.py).

The pool runs beside the compute thread: the device computes the resident experts while the workers
compute the misses. On CPU "host" and "device" are the same processor, but the path is still its
own: the store row (never a slot), a worker thread, no expert copy, counted activation bytes; what
it saves is the emulated link (``--link-gbps``).

Threads. ``torch.inference_mode`` is thread-local, so each job enters it. On CUDA the default
thread count leaves two cores free (the thread that launches device work and the copy pump), and
torch's intra-op pool is set to one thread, so N workers use N cores, never the launcher's
(``--host-threads`` overrides the count; the launching thread runs no CPU-parallel op). On every
device each worker computes with one intra-op thread: OpenMP's thread count belongs to the calling
thread and a new thread starts at the machine's core count, so a worker's [16, H] matmul would fan
out over every core beside the compute thread (docs/decisions.md, 2026-11-30 "One intra-op thread").
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moespec.errors import OptionError
from moespec.models.base import ExpertLayout
from moespec.runtime.host.store import ExpertStore


@dataclass(frozen=True)
class HostResult:
    """One expert computed on the host.

    Attributes:
        raw: [t, H] raw expert output (before its gate weight), on the compute device, in x's dtype.
        start, end: when the host computed it (perf_counter seconds; the host lane of a trace).
        tokens: t.
    """

    raw: torch.Tensor
    start: float
    end: float
    tokens: int

    @property
    def host_ms(self) -> float:
        """Host compute time in ms (the d2h / h2d of the activations included)."""
        return (self.end - self.start) * 1e3


@dataclass
class HostJob:
    """A submitted host computation: the expert, the bytes it moves both ways, its future, and its
    place in the future's batch (``index``; None: the future holds this job alone)."""

    expert: int
    d2h_bytes: int
    h2d_bytes: int
    future: Future
    index: int | None = None

    def result(self) -> HostResult:
        """Wait for the host to finish (re-raises what the worker raised)."""
        got = self.future.result()
        return got if self.index is None else got[self.index]


def host_forward(layout: ExpertLayout, x: torch.Tensor, row: torch.Tensor, act) -> torch.Tensor:
    """Raw output [t, H] of the expert in the host ``row`` [P] for host tokens ``x`` [t, H].

    The layout's own forward on host tensors: the same ops as the device path, so float32 outputs
    equal the device path's on CPU and the top-k sum (experts.TopkSum) is unchanged.
    """
    return layout.forward(x, row, act)


def default_host_threads(device: torch.device) -> int:
    """Worker threads when ``--host-threads`` is not given, from the cores this process may use.

    CUDA: all but two cores (the launching thread and the copy pump keep theirs), at most 8.
    CPU: the cores torch's own threads leave free, at least 1 (they share one processor).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if device.type == "cuda":
        return max(1, min(cores - 2, 8))
    return max(1, min(cores - torch.get_num_threads(), 4))


def _one_intra_op_thread() -> None:
    """Worker initializer: this thread's matmuls use one thread (the pool's workers are the parallelism)."""
    torch.set_num_threads(1)


class HostExpertPool:
    """Worker threads that compute missed experts from their store rows.

    Args:
        store: the host expert store (rows are read in place, never copied).
        device: the compute device (where the outputs go back to).
        threads: worker threads (>= 1).

    Raises:
        OptionError: ``threads`` < 1 (names --host-threads).
    """

    def __init__(self, store: ExpertStore, device: torch.device, threads: int) -> None:
        if threads < 1:
            raise OptionError(f"--host-threads {threads} must be at least 1")
        self.store = store
        self.device = device
        self.threads = threads
        caller_threads = torch.get_num_threads()
        if device.type == "cuda":
            # Why: each worker's matmul would otherwise fan out over every core (intra-op threads),
            # and N workers x all cores starve the thread that launches device work.
            torch.set_num_threads(1)
            caller_threads = 1
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moespec-host",
                                        initializer=_one_intra_op_thread)
        self._start_workers()
        # The workers' set_num_threads(1) also set torch's default for threads started later; the
        # caller's count is its own and unchanged, this restores the default (no CPU thread changes).
        torch.set_num_threads(caller_threads)

    def _start_workers(self) -> None:
        """Start every worker now (each runs its initializer), so none starts mid-layer."""
        ready = threading.Barrier(self.threads)
        for f in [self._pool.submit(ready.wait) for _ in range(self.threads)]:
            f.result()

    def _work(self, layer: int, expert: int, x: torch.Tensor, act) -> HostResult:
        with torch.inference_mode():
            t0 = time.perf_counter()
            # Why on the worker: a d2h copy blocks until the device produced x; only this worker waits.
            xh = x if x.device.type == "cpu" else x.to("cpu")  # [t, H] d2h
            y = host_forward(self.store.layout, xh, self.store.expert(layer, expert), act)  # [t, H]
            if self.device.type != "cpu":
                y = y.to(self.device)  # [t, H] h2d: the only bytes that come back
            return HostResult(raw=y, start=t0, end=time.perf_counter(), tokens=x.shape[0])

    def _work_batch(self, layer: int, items: list[tuple[int, torch.Tensor]], act) -> list[HostResult]:
        return [self._work(layer, expert, x, act) for expert, x in items]

    def submit_layer(self, layer: int, items: list[tuple[int, torch.Tensor]], act) -> list[HostJob]:
        """Start computing the experts ``items`` = [(expert, x [t, H])] of decoder layer ``layer``.

        They go to the workers in at most ``threads`` batches (round robin, each computed in order),
        one queue hand-off per worker instead of one per expert: a hand-off costs as much as a decode
        expert (docs/decisions.md, 2026-11-30 "one batch per worker").

        Returns:
            One HostJob per item, in ``items`` order; d2h/h2d bytes are t x H x itemsize each.
        """
        n = min(self.threads, len(items))
        jobs: list[HostJob | None] = [None] * len(items)
        for w in range(n):
            batch = items[w::n]
            future = self._pool.submit(self._work_batch, layer, batch, act)
            for i, (expert, x) in enumerate(batch):
                nbytes = x.numel() * x.element_size()
                jobs[w + i * n] = HostJob(expert, nbytes, nbytes, future, i)
        return jobs

    def submit(self, layer: int, expert: int, x: torch.Tensor, act) -> HostJob:
        """Start computing ``expert`` of decoder layer ``layer`` for its tokens ``x`` [t, H] (device).

        Returns:
            A HostJob; its d2h/h2d bytes are t x H x itemsize each.
        """
        nbytes = x.numel() * x.element_size()
        return HostJob(expert, nbytes, nbytes, self._pool.submit(self._work, layer, expert, x, act))

    def close(self) -> None:
        """Finish the queued jobs and stop the workers."""
        self._pool.shutdown(wait=True)
