"""ThreadPlan: who runs where during a forward on the CPU, so a second core helps instead of hurting.

Shapes: T tokens of one forward.

``--threads N`` (torch's intra-op thread count when a forward starts) keeps its meaning: the
process computes on N cores. How they are used depends on the step:

  - prefill (T > ``DECODE_MAX_TOKENS``): torch's N intra-op threads, as before: a [T, H] GEMM
    splits well and each op is big enough to pay for a fork/join of the OpenMP team.
  - decode (T <= ``DECODE_MAX_TOKENS``) with N > 1 on the CPU: the compute thread runs with ONE
    intra-op thread (the hundreds of tiny ops of a step stay on it and never fork a team), and
    N - 1 native spinning workers (kernels/spin.SpinPool) split every dense product bound by
    runtime/dense.py (attention projections, fused q/k/v and gate/up, lm_head) by output rows (from
    ``split_min_bytes``) and a layer's routed experts one per chunk: they spin between the products
    of a step, so a split costs no thread wake-up; between two products they read the next one's
    weight into the shared L3 (``read_ahead``: the compute thread's Python between products is the
    time a second core has; the product then reads L3, 55 us against 96 us from memory for a 2.2 MB
    q/k/v here), and the step's end waits until no worker reads ahead; and N - 1 persistent
    Python workers (kernels/row_pool.RowPool) take the rest of the work that can use another core:
      * the weight-reading products of at least ``linear.SPLIT_MIN_BYTES`` through
        moespec.kernels.linear that are not bound, cut by output rows, the caller and
        the workers pulling chunks from one counter;
      * with ``shared_beside`` (off by default: measured slower), an MoE layer's shared expert runs
        on an idle worker while the compute thread routes and computes the routed experts
        (runtime/layer/runner.py), joined before they are summed.
    The host pool (``--on-miss host``, runtime/misses/host_pool.py) keeps its own workers; with the
    default --host-threads they and the row workers share the second core in turn (a host job runs
    inside the MoE block, a row split in a dense product).
  - N == 1, or a CUDA device: nothing changes (on CUDA the host pool's rule applies: the launching
    thread runs no CPU-parallel op).

Why (measured, docs/decisions.md "A thread plan for decode"): with two intra-op threads every
configuration of the default model decoded 8-46 % slower than with one; most ops of a decode step
are too small to split, yet the libraries fork and join their team for them.

The serial reference: ``ThreadPlan.enabled = False`` runs every step as before (torch's N threads,
no workers); tests/test_thread_plan.py checks the plan's logits equal the one-thread serial path's
bit for bit (every product and every op runs the same kernel on one thread; only where it runs
changes).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from moespec.kernels import native, row_pool, spin
from moespec.kernels.linear import FUSED_MAX_TOKENS_F32

DECODE_MAX_TOKENS = FUSED_MAX_TOKENS_F32  # up to here every product takes the native (one-thread) kernels


class ThreadPlan:
    """The thread plan of one model instance (module docstring).

    Args:
        device: the compute device (the plan applies on the CPU only).

    Attributes:
        enabled: False runs every forward serially with torch's own threads (the reference).
        shared_beside: run an MoE layer's shared expert on a worker beside the routed experts. Off by
            default: measured slower (the worker's Python and the compute thread's pass the GIL back
            and forth at every op; docs/decisions.md 2026-12-02 "A thread plan for decode").
        read_ahead: the spinning workers read the next bound product's weight into the caches while
            this thread runs the Python between products (kernels/spin.py); False: they only split.
        split_min_bytes: bound products of fewer weight bytes run on this thread alone
            (kernels/spin.SPLIT_MIN_BYTES by default).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = True
        self.shared_beside = False
        self.read_ahead = True
        self.split_min_bytes = spin.SPLIT_MIN_BYTES
        self._pools: dict[int, row_pool.RowPool] = {}
        self._spins: dict[int, spin.SpinPool] = {}

    def applies(self, tokens: int, threads: int) -> bool:
        """True when a forward of ``tokens`` tokens at ``threads`` intra-op threads runs by the plan."""
        return self.enabled and self.device.type == "cpu" and threads > 1 and tokens <= DECODE_MAX_TOKENS

    def pool(self, workers: int) -> row_pool.RowPool:
        """The pool of ``workers`` workers (started once, kept for the model's life)."""
        if workers not in self._pools:
            self._pools[workers] = row_pool.RowPool(workers)
        return self._pools[workers]

    def spin_pool(self, workers: int) -> spin.SpinPool | None:
        """The native spinning pool of ``workers`` workers (started once), or None without the kernels."""
        if native.library() is None:
            return None
        if workers not in self._spins:
            self._spins[workers] = spin.SpinPool(workers)
        return self._spins[workers]

    @contextlib.contextmanager
    def step(self, tokens: int) -> Iterator[row_pool.RowPool | None]:
        """Run one forward of ``tokens`` tokens by the plan; yields the pool in use (None: serial).

        torch's thread count is put back when the block ends (also when it raises).
        """
        threads = torch.get_num_threads()
        if not self.applies(tokens, threads):
            yield None
            return
        pool = self.pool(threads - 1)
        pool.beside = self.shared_beside
        spinning = self.spin_pool(threads - 1)
        if spinning is not None:
            spinning.read_ahead = self.read_ahead
            spinning.set_split_min_bytes(self.split_min_bytes)
        torch.set_num_threads(1)
        try:
            with row_pool.using(pool), spin.using(spinning):
                yield pool
        finally:
            if spinning is not None:
                spinning.quiet()  # no read-ahead runs between steps (its loads need live weights)
            torch.set_num_threads(threads)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        for p in self._pools.values():
            p.close()
        self._pools.clear()
        for s in self._spins.values():
            s.close()
        self._spins.clear()
