"""Abort support: leave the runtime clean after a generation stopped between tokens.

A decode step pins the slots it prefetched for the next layer (or the next token) and may
leave those copies queued on the link. When a generation ends early (a client went away, a
stop string matched), nothing will read them: queued copies are dropped before they start
(no bytes move) and every prefetch pin is released, so the next request starts with the
whole cache evictable and an idle link.
"""

from __future__ import annotations

from moespec.runtime.moe_layer import MoeLayerRunner


def abort_pending(runner: MoeLayerRunner) -> int:
    """Drop the prefetches a stopped generation left behind; returns copies cancelled before they ran.

    Copies already running (or finished) stay in their slots as ordinary cached experts; only
    their prefetch pins are dropped. Safe to call when nothing is pending (returns 0).
    """
    cancelled = 0
    for slots in runner.prefetch_pins.values():
        for slot in slots:
            if runner.cache.cancel_prefetch(slot):
                cancelled += 1
            else:
                runner.cache.unused_prefetch(slot)
            runner.cache.release(slot)
    runner.prefetch_pins.clear()
    runner.predicted.clear()
    runner.residual.clear()
    return cancelled
