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

import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from moespec.errors import OptionError
from moespec.kernels.expert_batch import ExpertBatch, ExpertJob, Split, choose_split
from moespec.runtime.misses.native_batch import NativeExpertBatch, native_plan
from moespec.models.base import ExpertLayout
from moespec.runtime.host.store import ExpertStore


@dataclass(frozen=True)
class HostResult:
    """One expert computed on the host.

    Attributes:
        raw: [t, H] raw expert output (before its gate weight), on the compute device, in x's dtype.
        start, end: when the host computed it (perf_counter seconds; the host lane of a trace).
        tokens: t.
        busy_s: seconds its work ran, summed over the workers that shared it (None: end - start).
    """

    raw: torch.Tensor
    start: float
    end: float
    tokens: int
    busy_s: float | None = None

    @property
    def host_ms(self) -> float:
        """Host compute time of this expert in ms, as one worker would take it (the d2h / h2d of the
        activations included): the seconds its units ran, summed over workers (``busy_s``; an expert
        split by rows runs on several at once), else its wall span."""
        return (self.end - self.start if self.busy_s is None else self.busy_s) * 1e3


@dataclass
class HostJob:
    """A submitted host computation: the expert, the bytes it moves both ways, its batch's future
    (a list of ExpertDone, moespec.kernels.expert_batch), its place in that list (``index``), its
    tokens t, and the batch (``batch``: its units the caller may run itself; None: only wait)."""

    expert: int
    d2h_bytes: int
    h2d_bytes: int
    future: Future
    index: int
    tokens: int
    batch: ExpertBatch | NativeExpertBatch | None = None
    wait: Callable | None = None  # returns the future's result (NativeExpertBatch.result: spins first)

    def result(self) -> HostResult:
        """Wait for the host to finish (re-raises what the worker raised).

        The caller first runs the batch's units no worker has taken yet (ExpertBatch.run on this
        thread), so it waits only for units already running, never for a queued one while a core
        (its own) has nothing to do."""
        if self.batch is not None and not self.future.done():
            self.batch.run()
        d = (self.future.result() if self.wait is None else self.wait())[self.index]
        return HostResult(raw=d.y, start=d.start, end=d.end, tokens=self.tokens, busy_s=d.busy_s)


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
        split: how a layer's batch is cut over the workers (by experts, by output rows, or AUTO).

        caller_helps: a thread waiting for a result first runs the batch's units no worker has
            taken (HostJob.result); False: it only waits (the workers alone compute).

    Raises:
        OptionError: ``threads`` < 1 (names --host-threads).
    """

    def __init__(self, store: ExpertStore, device: torch.device, threads: int, split: Split = Split.AUTO,
                 caller_helps: bool = True) -> None:
        if threads < 1:
            raise OptionError(f"--host-threads {threads} must be at least 1")
        self.caller_helps = caller_helps
        self.store = store
        self.device = device
        self.threads = threads
        self.split = split
        caller_threads = torch.get_num_threads()
        if device.type == "cuda":
            # Why: each worker's matmul would otherwise fan out over every core (intra-op threads),
            # and N workers x all cores starve the thread that launches device work.
            torch.set_num_threads(1)
            caller_threads = 1
        buf = store.buffer  # [M, E, P]: a row's address without a view per expert (_native_batch)
        self._row_base = buf.data_ptr()
        self._layer_bytes, self._row_bytes = buf.stride(0) * buf.element_size(), buf.stride(1) * buf.element_size()
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

    def _job(self, layer: int, x: torch.Tensor, expert: int, act, rows: bool = True) -> ExpertJob:
        """The batch job of one expert: its store row's Linear-shaped weights (only when the batch
        may cut it by ``rows``: an expert unit runs the layout's own forward, and building the
        weight views cost 13-20 us an expert, 5 % of an int4 expert here), the d2h of its tokens and
        the h2d of its output, both on the worker."""
        layout, row = self.store.layout.for_layer(layer), self.store.expert(layer, expert)
        weights = layout.linear_weights(row) if rows else None  # None: the layout's forward (GPT-OSS: always)
        # Why on the worker: a d2h copy blocks until the device produced x; only this worker waits.
        load = (lambda t: t) if x.device.type == "cpu" else (lambda t: t.to("cpu"))  # [t, H] d2h
        store = (lambda y: y) if self.device.type == "cpu" else (lambda y: y.to(self.device))  # [t, H] h2d
        glu = None if weights is None else (lambda g: layout.act_and_mul(g, act))
        return ExpertJob(x, weights, glu=glu, act_int8=layout.act_int8, load=load, store=store,
                         forward=lambda xh: host_forward(layout, xh, row, act))

    def _native_batch(self, layer: int, items: list[tuple[int, torch.Tensor]], act) -> NativeExpertBatch | None:
        """The layer's experts as one native batch (moespec.runtime.misses.native_batch: one C call per
        thread, no Python per expert), or None where it does not apply (then ExpertBatch)."""
        layout = self.store.layout.for_layer(layer)
        xs = [x for _, x in items]
        plan = native_plan(layout, self.store.dtype, xs, act)
        if plan is None or self.store.buffer.device.type != "cpu":
            return None
        base = self._row_base + self.store.position[layer] * self._layer_bytes
        rows = [base + e * self._row_bytes for e, _ in items]  # store.expert(layer, e).data_ptr()
        load = None if all(x.device.type == "cpu" for x in xs) else (lambda t: t.to("cpu"))  # [t, H] d2h
        store = None if self.device.type == "cpu" else (lambda y: y.to(self.device))  # one h2d
        return NativeExpertBatch(layout, plan, xs, rows, load, store)

    def submit_layer(self, layer: int, items: list[tuple[int, torch.Tensor]], act) -> list[HostJob]:
        """Start computing the experts ``items`` = [(expert, x [t, H])] of decoder layer ``layer``.

        ONE dispatch for the layer: the experts go to the workers as one ExpertBatch
        (moespec.kernels.expert_batch), split by experts or by output rows (``self.split``); idle
        workers pull its units, and its one future resolves when the last unit ends (on 2 CPU cores
        a queue hand-off cost 0.15-0.3 ms, as much as a decode expert, so never one per expert).

        Returns:
            One HostJob per item, in ``items`` order, all on the batch's one future; d2h/h2d bytes are
            t x H x itemsize each.
        """
        if not items:
            return []
        rows = choose_split(self.split, len(items), self.threads) == Split.ROWS
        batch = None if rows else self._native_batch(layer, items, act)
        if batch is None:
            batch = ExpertBatch([self._job(layer, x, e, act, rows) for e, x in items], self.split, self.threads)
        for _ in range(min(self.threads, batch.num_units)):
            self._pool.submit(batch.run)
        helper = batch if self.caller_helps else None
        wait = None
        if isinstance(batch, NativeExpertBatch):  # a helping caller spins for the last experts
            wait = functools.partial(batch.result, spin=True) if helper is not None else batch.result
        return [HostJob(e, x.numel() * x.element_size(), x.numel() * x.element_size(), batch.future, i,
                        x.shape[0], helper, wait)
                for i, (e, x) in enumerate(items)]

    def submit(self, layer: int, expert: int, x: torch.Tensor, act) -> HostJob:
        """Start computing ``expert`` of decoder layer ``layer`` for its tokens ``x`` [t, H] (device).

        Returns:
            A HostJob; its d2h/h2d bytes are t x H x itemsize each.
        """
        return self.submit_layer(layer, [(expert, x)], act)[0]

    def run_on_worker(self, fn):
        """Run ``fn()`` on one worker thread and return what it returns (re-raises what it raised)."""
        return self._pool.submit(fn).result()

    def close(self) -> None:
        """Finish the queued jobs and stop the workers."""
        self._pool.shutdown(wait=True)
