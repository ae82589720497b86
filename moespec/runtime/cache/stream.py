"""The layer protocol: one call streams a layer's experts through the cache in the order their copies land.

Shapes: P packed elements per expert.

The layer runner (runtime/layer/runner.py) and the policy replay (replay.py) both run a layer this
way: the ledger settles the layer's prefetch pins (ledger.py), then :func:`stream` acquires the
layer's experts (hits pinned, misses copied on demand, as many as slots allow), lets the next
layer's prefetch go behind those demand copies, and hands out one slot at a time.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator

from moespec.errors import BudgetError
from moespec.runtime.cache.slots import ExpertCache
from moespec.runtime.stats import LayerStats, StatsRecorder


def stream(cache: ExpertCache, layer: int, experts: list[int], stats: LayerStats, recorder: StatsRecorder,
           kept: list[int] | None = None, queued: Callable[[], None] | None = None) -> Iterator[tuple[int, int]]:
    """Yield (expert, slot) for ``experts`` of ``layer`` in the order their copies land.

    Resident experts come first (no wait), then the misses, each group in the given order. Each is
    yielded once compute may read its slot (the stall is recorded as ``stall_ms``); the slots are
    released, in expert order, once the layer is done, or as soon as a missing expert finds no free
    slot: a layer that needs more experts than there are free slots (a prefill touching every
    expert) streams through a small cache in one pass. Counts hits (and first uses of prefetches), misses
    and their bytes into ``stats``.

    Args:
        kept: this layer's prefetch pins the ledger kept (``PrefetchLedger.settle``), released once
            the layer's own pins hold them.
        queued: called once the layer's demand copies are queued (the next layer's prefetch goes
            there, behind them).

    Raises:
        BudgetError: every slot is pinned and an expert of the layer is still missing.
    """
    cache.begin_visit(layer)
    pending = deque(cache.resident_first(layer, experts))
    in_flight: deque[tuple[int, int]] = deque()
    done: list[tuple[int, int]] = []  # (expert, slot) computed, still pinned
    _fill(cache, layer, pending, in_flight, stats)
    for slot in kept or ():  # now pinned by acquire as well
        cache.release(slot)
    cache.rule.commit()  # rankings move scores here only: the next layer's prefetch picks as its misses will
    if queued is not None:
        queued()
    while in_flight:
        e, slot = in_flight.popleft()
        recorder.span(stats, "stall_ms", cache.wait(slot))
        yield e, slot
        done.append((e, slot))
        if pending:
            _fill(cache, layer, pending, in_flight, stats)
            if pending:  # out of slots: the computed ones take the next missing experts
                _release(cache, done)
                _fill(cache, layer, pending, in_flight, stats)
                if not in_flight:
                    raise BudgetError(
                        f"layer {layer} needs an expert but all {cache.num_slots} cache slots are pinned",
                        "raise --cache-experts / --gpu-memory",
                    )
    _release(cache, done)


def acquire_resident(cache: ExpertCache, layer: int, experts: list[int], stats: LayerStats,
                     recorder: StatsRecorder, kept: list[int] | None = None,
                     queued: Callable[[], None] | None = None) -> list[int] | None:
    """:func:`stream`'s twin for a layer whose ``experts`` (ascending ids) are all resident with their
    copies landed: their slots, in the order of ``experts``, pinned, or None (nothing done) when one is
    not resident or its copy is still running (then the caller streams, and computes each expert as
    its copy lands).

    The cache sees what :func:`stream` does for an all-hit layer (the same acquires, pin releases,
    rule commit, ``queued()`` and waits, in the same order), and ``stats`` the same counts, so a
    caller may compute every expert in one call; it releases the slots with :func:`release_slots`
    once done. tests/test_expert_rows.py compares both on one trace.
    """
    landed = cache.landed
    if not all(landed((layer, e)) for e in experts):
        return None
    cache.begin_visit(layer)
    slots, prefetched = cache.acquire_hits(layer, experts)  # one acquire each, in one loop
    stats.hits += len(slots)
    stats.prefetch_used += prefetched
    for slot in kept or ():  # now pinned by acquire as well
        cache.release(slot)
    cache.rule.commit()
    if queued is not None:
        queued()
    for slot in slots:
        if cache.ticket(slot) is not None:  # landed: no stall, the ticket is dropped
            recorder.span(stats, "stall_ms", cache.wait(slot))
    return slots


def release_slots(cache: ExpertCache, slots: list[int]) -> None:
    """Release what :func:`acquire_resident` pinned (in its order: ascending expert ids, as stream)."""
    for slot in slots:
        cache.release(slot)


def _release(cache: ExpertCache, done: list[tuple[int, int]]) -> None:
    """Release computed slots in expert order: the eviction order after a layer does not depend on the
    order its copies landed in (a prefetch picks its slot as if its layer ran: slots.py)."""
    for _, slot in sorted(done):
        cache.release(slot)
    done.clear()


def _fill(cache: ExpertCache, layer: int, pending: deque, in_flight: deque, stats: LayerStats) -> None:
    """Acquire pending experts while slots allow (the stream's refill)."""
    while pending:
        got = cache.acquire((layer, pending[0]))
        if got is None:
            return
        in_flight.append((pending.popleft(), got.slot))
        if got.hit:
            stats.hits += 1
            stats.prefetch_used += got.prefetched
        else:
            stats.misses += 1
            stats.h2d_bytes += cache.copy_bytes(layer)
