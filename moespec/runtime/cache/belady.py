"""Belady's MIN: the offline bound on any eviction rule's hit rate, for the policy replay only.

Shapes: a trace is, per decode step, decoder layer -> the K expert ids it ran (replay.py's Trace).

The rule knows the whole trace: the victim is the evictable slot whose expert is next used
farthest in the future (never again: farthest of all; ties go to LRU order). Through the real
ExpertCache (a layer pins its K experts while it runs, a miss evicts among the unpinned slots)
this is the optimum of demand paging with batched requests: no rule of the same cache can miss
less on the same trace (tests/test_belady.py checks it against an exhaustive search). It is not
a ``--cache-policy``: a running model does not know its future routing.

Source: L. A. Belady, "A study of replacement algorithms for a virtual-storage computer", IBM
Systems Journal 5(2), 1966 (the MIN algorithm); Mattson et al. 1970 for its optimality.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from moespec.runtime.cache.eviction import EvictionRule
from moespec.runtime.cache.slot import Key, Slot

NEVER = float("inf")  # the next use of a key the trace does not use again


class BeladyRule(EvictionRule):
    """Evict the key used again farthest in the future of ``trace`` (offline; replay only).

    Args:
        trace: per step, layer -> expert ids (layers in execution order); the same trace the
            replay runs, from its first step (each ``used`` call consumes that key's next use).
    """

    policy = None  # offline only: no --cache-policy runs it
    keeps_last_visit = False  # the bound is over every demand-paging choice

    def __init__(self, trace: Iterable[dict[int, list[int]]]) -> None:
        self.next: dict[Key, deque[int]] = {}  # key -> visit indices of its uses still to come
        visit = 0
        for step in trace:
            for layer, ids in step.items():
                for e in set(ids):
                    self.next.setdefault((layer, e), deque()).append(visit)
                visit += 1

    def used(self, key: Key) -> None:
        uses = self.next.get(key)
        if uses:
            uses.popleft()  # this visit's use: what remains is the future

    def next_use(self, key: Key) -> float:
        """The visit index of ``key``'s next use (NEVER when none is left)."""
        uses = self.next.get(key)
        return uses[0] if uses else NEVER

    def victim(self, order: Iterable[Slot]) -> Slot | None:
        best, farthest = None, -1.0
        for slot in order:  # oldest first: a strict > keeps the LRU slot among equal next uses
            if slot.key is None:
                return slot
            n = self.next_use(slot.key)
            if n == NEVER:
                return slot
            if n > farthest:
                best, farthest = slot, n
        return best


class HorizonMinRule(BeladyRule):
    """MIN that sees only ``tokens`` decode tokens ahead (offline; replay only): how much of MIN's
    lead needs how much of the future.

    A key whose next use is within the horizon (``tokens`` x M layer visits from the running one)
    is "near"; the victim is a far key, chosen by ``fallback`` (the online rule, e.g. lfru) among the
    far ones, else the near key used farthest ahead (MIN). It keeps the layer before's experts as
    ``fallback`` does (``keeps_last_visit``), so ``tokens`` = 0 is ``fallback`` exactly and a horizon
    past the trace's end is MIN under the same constraint.

    Args:
        trace: as BeladyRule's.
        tokens: the horizon, in decode tokens.
        fallback: the rule that orders the far keys (it hears every use and visit).
    """

    def __init__(self, trace: list[dict[int, list[int]]], tokens: int, fallback: EvictionRule) -> None:
        super().__init__(trace)
        self.window = tokens * max((len(step) for step in trace), default=1)  # layer visits
        self.fallback = fallback
        self.keeps_last_visit = fallback.keeps_last_visit
        self.clock = -1  # the running visit's index (BeladyRule counts visits from 0)

    def visit(self, layer: int) -> None:
        self.clock += 1
        self.fallback.visit(layer)

    def used(self, key: Key) -> None:
        super().used(key)
        self.fallback.used(key)

    def victim(self, order: Iterable[Slot]) -> Slot | None:
        slots = list(order)
        horizon = self.clock + self.window
        far = [s for s in slots if s.key is None or self.next_use(s.key) > horizon]
        if far:
            empty = next((s for s in far if s.key is None), None)
            return empty or self.fallback.victim(far)
        return super().victim(slots)

