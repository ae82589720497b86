"""Weights bound once to the native GEMV, and a pool of spinning native workers that split its rows.

Shapes: T tokens (1..16), R rows (output features), C columns (input features).

  - :class:`BoundWeight`: a float32 / bfloat16 [R, C] tensor or a LowBitWeight, bound once
    (csrc/spin.c ``spin_bind``: kind, pointers, sizes); :meth:`BoundWeight.linear` computes
    x [T, C] @ W.T -> [T, R] float32 in one ctypes call (the GIL released), with no per-call plan.
  - :class:`SpinPool`: N native threads that, after a product, spin for 2 ms on one atomic ticket
    and then sleep on a condition variable. Inside a decode step the products come tens of us apart,
    so the workers never sleep and a split costs no thread wake-up (the Python RowPool's ~50 us per
    wake-up made every split of a 1-5 MB product slower: kernels/linear.SPLIT_MIN_BYTES). Rows are
    cut into chunks of about 64 KB of weight (multiples of 8 rows), claimed by the caller and the
    workers from one counter: the product is bit-equal to the serial one (tests/test_spin.py).
  - read-ahead: after each bound product through a pool, the pool's idle workers read the weight of
    the product that followed this one last time (``BoundWeight._next``, learned as the products run)
    into the caches while the caller runs the Python up to it (norms, attention, routing), so that
    product reads its weight from L3 rather than memory (csrc/spin.c ``read_ahead``; it never changes
    a value). The read-ahead loads: a slot keeps the next weight's tensors alive, and
    :meth:`SpinPool.quiet` (the end of every thread-plan step) returns when no worker reads ahead.
  - :func:`using` / :func:`active`: the pool of this thread's decode step (runtime/threads.ThreadPlan
    sets it; a context variable, so other threads see None and run serially).

One pool serves one caller thread at a time (its job record is shared with its workers): only the
decode thread of a ThreadPlan step uses it. The reference is :func:`moespec.kernels.linear.linear_reference`.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
from typing import Iterator

import torch

from moespec.kernels import native
from moespec.kernels.lowbit import LowBitWeight

_KIND = {torch.float32: native.KIND_F32, torch.bfloat16: native.KIND_BF16}
MAX_TOKENS = 16  # the kernels' token limit (kernels/linear.FUSED_MAX_TOKENS)
# Bound products of fewer weight bytes run on the caller alone (SpinPool.set_split_min_bytes; the
# thread plan applies it at every step). Measured: see docs/decisions.md (issue 33, the split's floor).
SPLIT_MIN_BYTES = 0
_RANGES = 3  # csrc/spin.c PF_RANGES: a weight's byte ranges (float: 1; low-bit: codes, scales, zeros)

_ACTIVE: contextvars.ContextVar["SpinPool | None"] = contextvars.ContextVar("moespec_spin_pool", default=None)


def active() -> "SpinPool | None":
    """The SpinPool this thread's decode step may use, or None (serial)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def using(pool: "SpinPool | None") -> Iterator[None]:
    """Within the block, :func:`active` returns ``pool`` in this thread."""
    token = _ACTIVE.set(pool)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def bindable(w) -> bool:
    """True when ``w`` can be bound here: the kernels are loaded and w is a CPU float32 / bfloat16
    contiguous [R, C] tensor or a CPU LowBitWeight."""
    if native.library() is None:
        return False
    if isinstance(w, LowBitWeight):
        return w.device.type == "cpu"
    return isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.dtype in _KIND and w.is_contiguous()


class BoundWeight:
    """One weight bound to the native GEMV (module docstring); keeps the tensors it points into alive.

    Args:
        w: a float32 / bfloat16 [R, C] CPU tensor (contiguous) or a CPU LowBitWeight.

    Raises:
        ValueError: ``w`` is not :func:`bindable` (a programming error: callers check first).
        MemoryError: the bound record could not be allocated.
    """

    def __init__(self, w) -> None:
        if not bindable(w):
            raise ValueError("BoundWeight needs the native kernels and a CPU float32/bf16 or low-bit weight")
        lib = native.library()
        self._lib = lib
        if isinstance(w, LowBitWeight):
            kind = native.KIND_Q4 if w.bits == 4 else native.KIND_Q8
            self._keep = (w.codes, w.scales, w.zeros)
            self.rows, self.cols = w.rows, w.cols
            handle = lib.spin_bind(kind, w.codes.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(), w.rows,
                                   w.cols, w.group_size)
        else:
            self._keep = (w,)
            self.rows, self.cols = w.shape
            handle = lib.spin_bind(_KIND[w.dtype], w.data_ptr(), None, None, self.rows, self.cols, 0)
        if not handle:
            raise MemoryError("could not allocate a bound weight")
        self._handle = handle
        self.weight = w
        parts = [t for t in self._keep if t is not None]
        # this weight's byte ranges as the read-ahead takes them (ints only: no reference to the tensors)
        self._ranges = ((ctypes.c_void_p * _RANGES)(*[t.data_ptr() for t in parts]),
                        (ctypes.c_int64 * _RANGES)(*[t.numel() * t.element_size() for t in parts]))
        # [(ranges, tensors) of the bound product that followed this one last time through a pool, or
        # None]: the tensors stay alive while a worker may read them ahead
        self._next: list = [None]

    def linear(self, x: torch.Tensor, pool: "SpinPool | None" = None) -> torch.Tensor:
        """x [T, C] float32 contiguous (T <= 16) @ W.T -> y [T, R] float32; rows split over ``pool``
        (None: this thread alone).

        Raises:
            MemoryError: a kernel could not allocate its scratch rows.
        """
        y = torch.empty(x.shape[0], self.rows)  # [T, R]
        ahead = (None, None)
        if pool is not None:
            last, pool._last = pool._last, self._next
            if last is not None and last is not self._next and (last[0] is None or last[0][0] is not self._ranges):
                last[0] = (self._ranges, self._keep)  # the product before this one now reads this one ahead
            if pool.read_ahead and self._next[0] is not None:
                ahead = self._next[0][0]
        rc = self._lib.spin_linear(pool._handle if pool is not None else None, self._handle, x.data_ptr(),
                                   x.shape[0], y.data_ptr(), self.rows, *ahead)
        if rc != 0:
            raise MemoryError("the CPU kernel could not allocate its scratch rows")
        return y

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.spin_unbind(handle)


class SpinPool:
    """``workers`` native threads that split bound products with the caller (module docstring).

    Args:
        workers: the native threads (the caller computes too).

    Attributes:
        read_ahead: after each bound product, the workers read the next one's weight ahead (module
            docstring); False: they only split products (the reference the read-ahead is timed against).

    Raises:
        ValueError: ``workers`` < 1, or no native kernels (a programming error: ThreadPlan checks).
        MemoryError: the pool could not be allocated.
    """

    def __init__(self, workers: int) -> None:
        lib = native.library()
        if workers < 1 or lib is None:
            raise ValueError(f"a SpinPool needs the native kernels and at least one worker, not {workers}")
        self.workers = workers
        self._lib = lib
        self._handle = lib.spin_pool_new(workers)
        if not self._handle:
            raise MemoryError("could not start the spin pool")
        self.read_ahead = True
        self._last: list | None = None  # the ``_next`` slot of the last bound product through this pool

    def quiet(self) -> None:
        """Return when no worker reads ahead any more (csrc/spin.c ``spin_quiet``)."""
        if self._handle:
            self._lib.spin_quiet(self._handle)

    def set_split_min_bytes(self, nbytes: int) -> None:
        """Split only products of at least ``nbytes`` weight bytes (smaller: the caller alone)."""
        if self._handle:
            self._lib.spin_pool_set_split_min_bytes(self._handle, int(nbytes))

    def close(self) -> None:
        """Stop and join the workers (idempotent)."""
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.spin_pool_free(handle)

    def __del__(self) -> None:
        self.close()
