"""ExpertCache: a fixed pool of device slots holding packed experts, LRU eviction.

Shapes: S slots, P packed elements per expert.

A slot is pinned (never evicted) while the running layer uses it or while it holds a prefetch
whose target layer has not run yet; unpinned slots sit in an LRU order (empty slots first).
Copies go through the TransferEngine; the compute side waits on exactly the slot it reads.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

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
    """Device-side expert slots over an ExpertStore.

    Args:
        store: host store of packed experts.
        num_slots: S, number of device slots.
        device: where the slots live.
        engine: transfer engine that performs the copies.
    """

    def __init__(self, store: ExpertStore, num_slots: int, device: torch.device, engine: TransferEngine) -> None:
        self.store = store
        self.engine = engine
        self.num_slots = num_slots
        self.slots = torch.empty(num_slots, store.layout.numel, dtype=store.dtype, device=device)  # [S, P]
        self._where: dict[Key, int] = {}
        self._key: list[Key | None] = [None] * num_slots
        self._pins = [0] * num_slots
        self._ticket: list[Ticket | None] = [None] * num_slots
        self._from_prefetch = [False] * num_slots
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self._by_layer: dict[int, set[int]] = {}  # layer -> resident expert ids (for the guard)
        self.copies = 0  # copies issued (demand + prefetch)

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

    def evictable(self) -> int:
        """Number of slots that a new copy could take now."""
        return len(self._lru)

    def row(self, slot: int) -> torch.Tensor:
        """The packed expert [P] held in ``slot`` (read it through ``store.layout``)."""
        return self.slots[slot]

    # --- pinning -------------------------------------------------------------------------
    def _pin(self, slot: int) -> None:
        self._pins[slot] += 1
        self._lru.pop(slot, None)

    def release(self, slot: int) -> None:
        """Drop one pin of ``slot``; at zero it becomes evictable (most recently used)."""
        assert self._pins[slot] > 0, f"slot {slot} released more often than pinned"
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self.engine.slot_released(slot)
            self._lru[slot] = None
            if self._key[slot] is None:  # an empty slot is the first to reuse
                self._lru.move_to_end(slot, last=False)

    def _evict_to_empty(self, slot: int) -> None:
        key = self._key[slot]
        if key is not None:
            del self._where[key]
            self._by_layer[key[0]].discard(key[1])
        self._key[slot] = None

    def _load(self, key: Key, prefetch: bool = False) -> int | None:
        """Evict the least recently used unpinned slot and start copying ``key`` into it."""
        if not self._lru:
            return None
        slot, _ = self._lru.popitem(last=False)
        self._evict_to_empty(slot)
        self._key[slot] = key
        self._where[key] = slot
        self._by_layer.setdefault(key[0], set()).add(key[1])
        self._ticket[slot] = self.engine.submit(self.slots[slot], self.store.expert(*key), slot, prefetch)
        self.copies += 1
        self._pins[slot] = 1
        return slot

    def clear(self) -> None:
        """Empty every slot (a cold cache), after all copies finished; no slot may be pinned.

        For measurements that must start from the same cache state (``moespec profile``).
        """
        assert not any(self._pins), "clear() while slots are pinned"
        self.engine.synchronize()
        self._where.clear()
        self._by_layer.clear()
        self._key = [None] * self.num_slots
        self._ticket = [None] * self.num_slots
        self._from_prefetch = [False] * self.num_slots
        self._lru = OrderedDict((s, None) for s in range(self.num_slots))

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
                self._pins[slot] = 0
                self.engine.slot_released(slot)
                self._lru[slot] = None
            self._ticket[slot] = None  # every copy has landed or was dropped
            self._from_prefetch[slot] = False
            if self._key[slot] is None:
                self._lru.move_to_end(slot, last=False)  # empty slots are reused first

    # --- the two ways in -------------------------------------------------------------------
    def acquire(self, key: Key) -> Acquired | None:
        """Pin ``key`` for compute, starting its copy on a miss.

        Returns None when it is not resident and every slot is pinned (the caller computes what it
        holds, releases, and asks again).
        """
        slot = self._where.get(key)
        if slot is not None:
            self._pin(slot)
            prefetched = self._from_prefetch[slot]
            self._from_prefetch[slot] = False
            return Acquired(slot, hit=True, prefetched=prefetched)
        slot = self._load(key)
        return None if slot is None else Acquired(slot, hit=False, prefetched=False)

    def prefetch(self, key: Key) -> tuple[int, bool] | None:
        """Pin ``key`` ahead of use, copying it if absent. Returns (slot, copied) or None (no room).

        The pin protects the slot until the caller releases it after the target layer ran.
        """
        slot = self._where.get(key)
        if slot is not None:
            self._pin(slot)
            return slot, False
        slot = self._load(key, prefetch=True)
        if slot is None:
            return None
        self._from_prefetch[slot] = True
        return slot, True

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
