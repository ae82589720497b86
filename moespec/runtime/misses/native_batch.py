"""NativeExpertBatch: one layer's host experts as ONE native call per thread, claimed expert by expert.

Shapes: n experts, t_i tokens of expert i, H hidden, I expert intermediate.

The host pool's batch (moespec.kernels.expert_batch.ExpertBatch) runs each expert unit through
Python: its bookkeeping, the layout's forward, the checks of moespec.kernels.swiglu, a ctypes call.
Measured on this project's 2-core VM (one thread, 24 cold Qwen3-30B-A3B-shaped experts, 8 per
dispatch): that costs 25-35 us an expert over the kernel itself (int4 181.7 against 143.2 us per
expert for one C call over the 8), as much as the int4 kernel loses to the memory bound. Here the
whole batch is one C function (csrc/expert.c ``host_experts``): every thread that runs the batch
(the pool's workers, a helping caller) makes ONE ctypes call, the GIL released, that claims experts
from one atomic counter until none is left and runs ``expert_swiglu`` on each, the same code
:func:`moespec.kernels.swiglu.swiglu_expert` calls, so an expert's output is the same bits
whichever thread computes it and equals the layout's forward on a pool worker (tests).

Where it applies (:func:`native_plan`): the native kernels are loaded, the layout computes its
experts by ExpertLayout.forward with the one-call kernel (SwiGLU with SiLU; float32, bfloat16 or
int8 / int4 rows: ``ExpertLayout.native_parts``), every expert has at most FUSED_MAX_TOKENS tokens in
float32 or bfloat16. Elsewhere (GPT-OSS, GGUF blocks, another activation, prefill chunks) the pool
keeps ExpertBatch, the reference this is tested against. Only whole experts: a batch cut by rows
(fewer experts than workers) stays an ExpertBatch.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Callable

import torch

from moespec.kernels import native
from moespec.kernels.expert_batch import ExpertDone
from moespec.kernels.linear import FUSED_MAX_TOKENS, FUSED_MAX_TOKENS_F32
from moespec.kernels.swiglu import is_silu
from moespec.models.layout import ExpertLayout

SPIN_NS = 2_000_000  # a waiter spins this long (ns) before it sleeps on the future


def native_plan(layout, row_dtype: torch.dtype, xs: list[torch.Tensor], act):
    """(kind, offsets, group size) of ``layout``'s one-call kernel for rows of ``row_dtype`` and the
    tokens ``xs`` ([t_i, H] each), or None where a NativeExpertBatch does not apply (module docstring)."""
    if native.library() is None or type(layout).forward is not ExpertLayout.forward or not is_silu(act) or not xs:
        return None
    dtype = xs[0].dtype
    if dtype not in (torch.float32, torch.bfloat16) or any(x.dtype != dtype or x.dim() != 2 for x in xs):
        return None
    most = FUSED_MAX_TOKENS_F32 if row_dtype == torch.float32 else FUSED_MAX_TOKENS
    if any(x.shape[0] > most or x.shape[0] < 1 for x in xs):
        return None
    return layout.native_parts(row_dtype, dtype)


class _Outputs:
    """The batch's result as ExpertBatch gives it: item i is ExpertDone(y [t_i, H], start, end, busy)."""

    def __init__(self, ys: list[torch.Tensor], times) -> None:
        self._ys, self._times = ys, times

    def __getitem__(self, i: int) -> ExpertDone:
        start, end = self._times[2 * i], self._times[2 * i + 1]
        return ExpertDone(self._ys[i], start, end, end - start)

    def __len__(self) -> int:
        return len(self._ys)


class NativeExpertBatch:
    """The experts of one layer for threads that each call :meth:`run` once (module docstring).

    Args:
        layout: the layer's ExpertLayout (hidden H, intermediate I, ``act_int8``).
        plan: :func:`native_plan`'s (kind, offsets, group size).
        xs: each expert's tokens [t_i, H] (float32 or bfloat16, any device: ``load`` brings them here).
        rows: each expert's host row address (int: the row tensor's data_ptr; the store keeps it alive).
        load: x -> host tokens (e.g. a d2h copy); None: ``xs`` are host tensors already.
        store: y [sum t_i, H] in x's dtype -> the outputs as the caller wants them (e.g. one h2d
            copy), run by the thread that finishes the last expert; None: y itself.

    With host tokens (``load`` None) the batch is made ready here, on the submitting thread, so a
    worker's run is the C call alone (its Python would run with cold caches after the experts'
    stream, measured 70-100 us a batch on a worker against 19 us warm). The :attr:`future`
    resolves to a sequence of ExpertDone in ``xs`` order (or the first error).
    """

    def __init__(self, layout, plan, xs: list[torch.Tensor], rows: list[int], load: Callable | None = None,
                 store: Callable | None = None) -> None:
        self.future: Future = Future()
        self.num_units = len(xs)
        self._layout, self._plan, self._xs, self._rows = layout, plan, xs, rows
        self._load, self._store = load, store
        self._lock = threading.Lock()
        self._args: tuple | None = None
        self._state = (ctypes.c_int64 * 3)()  # next item, finished items, first error code
        self._times = (ctypes.c_double * (2 * len(xs)))()
        if load is None:
            self._prepare()

    def _prepare(self) -> tuple:
        """The C call's arguments (once: the host tokens, the output, the item table)."""
        with self._lock:
            if self._args is None:
                load = self._load or (lambda x: x)
                hosts = [load(x).float().contiguous() for x in self._xs]  # [t_i, H] float32
                ts = [h.shape[0] for h in hosts]
                y = torch.empty(sum(ts), self._layout.hidden)  # [sum t_i, H] float32
                items, at, ptr, step = [], 0, y.data_ptr(), self._layout.hidden * 4
                for h, t, row in zip(hosts, ts, self._rows):
                    items += [h.data_ptr(), t, row, ptr + at * step]
                    at += t
                table = (ctypes.c_int64 * len(items))(*items)
                kind, offsets, group = self._plan
                bf16 = int(self._xs[0].dtype == torch.bfloat16)
                call = (kind, int(self._layout.act_int8), bf16, table, len(hosts), *offsets, self._layout.hidden,
                        self._layout.intermediate, group, self._times, self._state)
                self._args = (call, hosts, y, ts, table)
            return self._args

    def run(self) -> None:
        """Claim and compute experts until none is left; the thread that finishes the last one
        resolves :attr:`future` (a thread arriving after every expert was claimed returns at once)."""
        if self.future.done():
            return
        try:
            call = self._prepare()[0]
            if native.library().host_experts(*call):
                self._resolve()
        except BaseException as exc:  # the caller re-raises it from the future
            with contextlib.suppress(InvalidStateError):  # another thread's error came first
                self.future.set_exception(exc)

    def _resolve(self) -> None:
        """Set :attr:`future` from the finished outputs (once, whichever thread gets here first)."""
        with self._lock:
            if self.future.done():
                return
            _, _, y, ts, _ = self._args
            try:
                if self._state[2] != 0:
                    raise MemoryError("the CPU expert kernel could not allocate its scratch memory")
                y = y if self._xs[0].dtype == torch.float32 else y.to(self._xs[0].dtype)
                out = y if self._store is None else self._store(y)
                self.future.set_result(_Outputs(list(out.split(ts)), self._times))
            except BaseException as exc:
                self.future.set_exception(exc)

    def result(self, spin: bool = False) -> _Outputs:
        """Wait for the batch (re-raises what a thread raised).

        ``spin`` (a caller that ran the batch itself, so at most the experts other threads hold
        are left) with host outputs: first spin in C (the GIL released, at most SPIN_NS) on the
        finished count and resolve here, with no wake-up; else, or for outputs a worker must copy
        (``store``), sleep on the future. A caller that only waits sleeps: spinning for a whole
        batch measured no faster (one worker, int8 0.301 against 0.285 ms an expert)."""
        if spin and not self.future.done() and self._store is None and self._args is not None:
            if native.library().host_experts_wait(self._state, self.num_units, SPIN_NS):
                self._resolve()
        return self.future.result()
