"""ExpertCache: a fixed pool of device slots holding packed experts, a cache area and a prefetch area.

Shapes: S slots, P packed elements per expert.

A slot is pinned (never evicted) while the running layer uses it or while it holds a prefetch
whose target layer has not run yet. Copies go through the TransferEngine; the compute side waits
on exactly the slot it reads.

The rule that keeps prefetch from costing more than it saves (issue 16):

- The slots form a **cache area**, whose victims are chosen by the eviction rule
  (``--cache-policy``, cache_policy.py), and a **prefetch area** of at most ``prefetch_slots``
  slots (K: one layer's prediction), taken from the cache area the first time a prefetch needs one.
- A prefetch of a resident expert costs nothing: it only pins the slot it is in.
- A prefetch that must copy takes a prefetch-area slot that is empty or holds an old unused
  prediction, never a pinned slot and never one whose copy is still in flight. It never evicts
  an expert from the cache area.
- On its first use a prefetched expert is **promoted**: its slot joins the cache area and the
  cache area's victim (by the rule, the one a demand miss of the same expert would evict at that
  moment) moves, still holding its expert, to the prefetch area. Experts in the prefetch area
  (unused predictions, victims) stay usable until a later prefetch overwrites them (empty slots
  first, then unused predictions, then victims, oldest first); a use promotes them back. So a
  wrong prediction in steady state overwrites an older wrong prediction, and only a right one
  overwrites a victim, as its demand miss would have.

So the cache area sees the same uses and evictions as on-demand loading with S - prefetch_slots
slots, plus a second chance for its last victims, and a predictor moves at most on-demand's
bytes at that size plus its wasted predictions.
Demand misses take the rule's victim, or a free prefetch-area slot when every cache-area slot is
pinned.
"""

from __future__ import annotations

import time

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from moespec.config import CachePolicy
from moespec.runtime.cache_policy import EvictionRule
from moespec.runtime.store import ExpertStore
from moespec.runtime.transfer import Span, Ticket, TransferEngine

Key = tuple[int, int]  # (decoder layer index, expert id)


@dataclass
class Acquired:
    """Result of acquiring an expert for compute.

    Attributes:
        slot: slot index.
        hit: the expert was resident (or already in flight) before this request.
        prefetched: it was there because a prefetch brought it and this is its first use.
    """

    slot: int
    hit: bool
    prefetched: bool


class ExpertCache:
    """Device-side expert slots over an ExpertStore (cache area + prefetch area, module docstring).

    Args:
        store: host store of packed experts.
        num_slots: S, number of device slots.
        device: where the slots live.
        engine: transfer engine that performs the copies.
        rule: makes the cache area's eviction rule (called again by ``clear``); None = LRU.
        prefetch_slots: most slots the prefetch area may take (K; capped at S - 1); None = S // 2.
    """

    def __init__(self, store: ExpertStore, num_slots: int, device: torch.device, engine: TransferEngine,
                 rule: Callable[[], EvictionRule] | None = None, prefetch_slots: int | None = None) -> None:
        self.store = store
        self.engine = engine
        self.num_slots = num_slots
        if prefetch_slots is None:
            prefetch_slots = num_slots // 2
        self.prefetch_slots = max(0, min(prefetch_slots, num_slots - 1))
        self._make_rule = rule or EvictionRule
        self.slots = torch.empty(num_slots, store.layout.numel, dtype=store.dtype, device=device)  # [S, P]
        self.copies = 0  # copies issued (demand + prefetch)
        self._reset()

    def _reset(self) -> None:
        n = self.num_slots
        self.rule = self._make_rule()
        self._where: dict[Key, int] = {}
        self._key: list[Key | None] = [None] * n
        self._pins = [0] * n
        self._ticket: list[Ticket | None] = [None] * n
        self._issued_s: list[float] = [0.0] * n  # perf_counter when the slot's copy was issued (copy_age_ms)
        self._from_prefetch = [False] * n
        self._unused = [False] * n  # filled by a prefetch and not used since
        self._in_prefetch_area = [False] * n
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(n))  # evictable cache area
        self._pf_free: OrderedDict[int, None] = OrderedDict()  # unpinned prefetch-area slots
        self._protected: set[int] = set()  # in _lru but pinned by a prefetch (not evictable)
        self._by_layer: dict[int, set[int]] = {}  # layer -> resident expert ids (for the guard)

    @property
    def policy(self) -> CachePolicy:
        """The cache area's eviction policy."""
        return self.rule.policy

    # --- queries -------------------------------------------------------------------------
    def resident(self, key: Key) -> bool:
        """True when ``key`` is in a slot (its copy may still be in flight)."""
        return key in self._where

    def resident_keys(self) -> list[Key]:
        """Keys currently held in slots."""
        return list(self._where)

    def resident_experts(self, layer: int) -> set[int]:
        """Expert ids of ``layer`` currently held in slots."""
        return self._by_layer.get(layer, set())

    def key_of(self, slot: int) -> Key | None:
        """The key held in ``slot``."""
        return self._key[slot]

    def pinned(self, slot: int) -> bool:
        """True while ``slot`` is pinned (in use by the running layer or held by a prefetch)."""
        return self._pins[slot] > 0

    def in_flight(self, slot: int) -> bool:
        """True while a copy into ``slot`` may still be writing it (never blocks)."""
        ticket = self._ticket[slot]
        return ticket is not None and not self.engine.landed(ticket)

    def in_prefetch_area(self, slot: int) -> bool:
        """True when ``slot`` belongs to the prefetch area."""
        return self._in_prefetch_area[slot]

    def evictable(self) -> int:
        """Number of slots that a new copy could take now."""
        return len(self._lru) - len(self._protected) + len(self._pf_free)

    def row(self, slot: int) -> torch.Tensor:
        """The packed expert [P] held in ``slot`` (read it through ``store.layout``)."""
        return self.slots[slot]

    # --- pinning -------------------------------------------------------------------------
    def _pin(self, slot: int) -> None:
        self._pins[slot] += 1
        self._lru.pop(slot, None)
        self._protected.discard(slot)
        self._pf_free.pop(slot, None)

    def _protect(self, slot: int) -> None:
        """Pin a resident cache-area slot for a prefetch without touching its place in the eviction
        order: a prediction is not a use, so a wrong one must not make its expert look recent."""
        self._pins[slot] += 1
        if slot in self._lru:
            self._protected.add(slot)
        else:
            self._pf_free.pop(slot, None)

    def release(self, slot: int) -> None:
        """Drop one pin of ``slot``; at zero it becomes evictable (most recently used)."""
        assert self._pins[slot] > 0, f"slot {slot} released more often than pinned"
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self.engine.slot_released(slot)
            if slot in self._protected:  # pinned only by a prefetch: it kept its place
                self._protected.discard(slot)
                return
            free = self._pf_free if self._in_prefetch_area[slot] else self._lru
            free[slot] = None
            if self._key[slot] is None:  # an empty slot is the first to reuse
                free.move_to_end(slot, last=False)

    def _evict_to_empty(self, slot: int) -> None:
        key = self._key[slot]
        if key is not None:
            del self._where[key]
            self._by_layer[key[0]].discard(key[1])
        self._key[slot] = None

    def _cache_victim(self, settled: bool) -> int | None:
        """The rule's victim among unpinned cache-area slots (``settled``: none with a copy in flight)."""
        protected = self._protected
        order = (s for s in self._lru if s not in protected and not (settled and self.in_flight(s)))
        return self.rule.victim(order, self._key)

    def _free_prefetch_slot(self) -> int | None:
        """An unpinned prefetch-area slot whose copy has landed: an empty one, else the oldest unused
        prediction, else the oldest victim (the one on-demand loading would have evicted first)."""
        best, best_rank = None, 3
        for s in self._pf_free:
            rank = 0 if self._key[s] is None else (1 if self._unused[s] else 2)
            if rank < best_rank and not self.in_flight(s):
                best, best_rank = s, rank
                if rank == 0:
                    break
        return best

    def _copy_into(self, slot: int, key: Key, prefetch: bool) -> int:
        self._evict_to_empty(slot)
        self._key[slot] = key
        self._where[key] = slot
        self._by_layer.setdefault(key[0], set()).add(key[1])
        self._ticket[slot] = self.engine.submit(self.slots[slot], self.store.expert(*key), slot, prefetch)
        self._issued_s[slot] = time.perf_counter()
        self.copies += 1
        self._pins[slot] = 1
        self._from_prefetch[slot] = prefetch
        self._unused[slot] = prefetch
        return slot

    def _load(self, key: Key) -> int | None:
        """A demand copy of ``key`` into the rule's victim (or a free prefetch-area slot)."""
        slot = self._cache_victim(settled=False)
        if slot is not None:
            del self._lru[slot]
        else:
            slot = next(iter(self._pf_free), None)
            if slot is None:
                return None
            del self._pf_free[slot]
        return self._copy_into(slot, key, prefetch=False)

    def _promote(self, slot: int) -> None:
        """A prefetched expert is used: its slot joins the cache area, the rule's victim leaves it."""
        victim = self._cache_victim(settled=True)
        if victim is None:
            return  # every cache-area slot is pinned: it stays in the prefetch area for now
        del self._lru[victim]
        # The victim keeps its expert until a prefetch overwrites it: a use before that is a hit
        # (and promotes it back), so the prefetch area costs the cache area less than its size.
        self._in_prefetch_area[victim] = True
        self._pf_free[victim] = None
        self._in_prefetch_area[slot] = False

    def set_rule(self, rule: Callable[[], EvictionRule]) -> None:
        """Replace the eviction rule's maker (the loader does it once the calibration file is checked)
        and empty the cache, as ``clear`` does; no slot may be pinned."""
        self._make_rule = rule
        self.clear()

    def clear(self) -> None:
        """Empty every slot (a cold cache), after all copies finished; no slot may be pinned. The
        eviction rule starts again from its seed.

        For measurements that must start from the same cache state (``moespec profile``).
        """
        assert not any(self._pins), "clear() while slots are pinned"
        self.engine.synchronize()
        self._reset()

    def abort(self) -> None:
        """After an interrupted forward (Ctrl-C): cancel queued copies, drop every pin.

        Copies that never ran leave their slot empty (its key forgotten, so a later request copies
        again); the running copy is waited for. Afterwards every slot is evictable and every
        resident key holds its expert: the cache is as consistent as after a finished forward.
        """
        for ticket in self.engine.cancel_pending():
            # The slot's current copy (or an older one still queued behind it): either way the
            # slot's bytes are not the key's expert, so forget the key. Emptying is always safe.
            current = self._ticket[ticket.slot]
            if current is None or current is ticket:
                self._evict_to_empty(ticket.slot)
                self.copies -= 1
        self.engine.synchronize()  # a CUDA stream cannot drop copies: let them land
        for slot in range(self.num_slots):
            if self._pins[slot]:
                self._pins[slot] = 1
                self.release(slot)  # back to its area's free order (a protected slot is already there)
            self._ticket[slot] = None  # every copy has landed or was dropped
            self._from_prefetch[slot] = False
            self._unused[slot] = False
            if self._key[slot] is None:  # empty slots are reused first
                free = self._pf_free if self._in_prefetch_area[slot] else self._lru
                if slot in free:
                    free.move_to_end(slot, last=False)

    # --- the two ways in -------------------------------------------------------------------
    def acquire(self, key: Key) -> Acquired | None:
        """Pin ``key`` for compute, starting its copy on a miss.

        Returns None when it is not resident and every slot is pinned (the caller computes what it
        holds, releases, and asks again).
        """
        slot = self._where.get(key)
        if slot is not None:
            self._pin(slot)
            self.rule.used(key)
            prefetched = self._from_prefetch[slot]
            self._from_prefetch[slot] = False
            self._unused[slot] = False
            if self._in_prefetch_area[slot]:
                self._promote(slot)
            return Acquired(slot, hit=True, prefetched=prefetched)
        slot = self._load(key)
        if slot is None:
            return None
        self.rule.used(key)
        return Acquired(slot, hit=False, prefetched=False)

    def prefetch(self, key: Key) -> tuple[int, bool] | None:
        """Pin ``key`` ahead of use, copying it if absent. Returns (slot, copied) or None (no room).

        A resident ``key`` is only pinned (no copy, nothing evicted). Otherwise the copy goes into
        a free prefetch-area slot (growing the area up to ``prefetch_slots`` from the cache area's
        victim); it never takes a pinned or in-flight slot. The pin protects the slot until the
        caller releases it after the target layer ran.
        """
        slot = self._where.get(key)
        if slot is not None:
            self._protect(slot)
            return slot, False
        slot = self._free_prefetch_slot()
        if slot is not None:
            del self._pf_free[slot]
        elif sum(self._in_prefetch_area) < self.prefetch_slots:
            slot = self._cache_victim(settled=True)
            if slot is None:
                return None
            del self._lru[slot]
            self._in_prefetch_area[slot] = True
        else:
            return None
        return self._copy_into(slot, key, prefetch=True), True

    def cancel_prefetch(self, slot: int) -> bool:
        """Cancel the not-yet-started prefetch copy into ``slot``; the slot becomes empty.

        Returns True when the copy was dropped (no bytes moved). The caller still releases its pin.
        """
        ticket = self._ticket[slot]
        if ticket is None or not self._from_prefetch[slot] or not self.engine.cancel(ticket):
            return False
        self._ticket[slot] = None
        self._from_prefetch[slot] = False
        self._evict_to_empty(slot)
        self.copies -= 1
        return True

    def unused_prefetch(self, slot: int) -> bool:
        """True when ``slot`` was filled by a prefetch that no compute has used; clears the mark."""
        was = self._from_prefetch[slot]
        self._from_prefetch[slot] = False
        return was

    def landed(self, key: Key) -> bool:
        """True when ``key`` is resident and its copy has finished (no stall to read it); no host sync."""
        slot = self._where.get(key)
        if slot is None:
            return False
        ticket = self._ticket[slot]
        return ticket is None or self.engine.landed(ticket)

    def copy_age_ms(self, key: Key) -> float:
        """Milliseconds since the copy of resident ``key`` was issued (the miss planner's estimate of how
        much of it is left); 0.0 when ``key`` is not resident."""
        slot = self._where.get(key)
        return 0.0 if slot is None else (time.perf_counter() - self._issued_s[slot]) * 1e3

    def copies_in_flight(self) -> int:
        """Copies issued into slots that have not landed yet (the link's backlog, for the miss planner)."""
        return sum(1 for t in self._ticket if t is not None and not self.engine.landed(t))

    def wait(self, slot: int) -> Span | None:
        """Make compute wait for the copy into ``slot``; returns the stall span or None if none pending."""
        ticket = self._ticket[slot]
        if ticket is None:
            return None
        self._ticket[slot] = None
        return self.engine.wait(ticket)
