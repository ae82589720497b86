"""What the expert cache holds, asked without changing it: keys, slot states, pins, copies in flight.

These are ExpertCache's read-only methods (slots.py), kept apart from the pool's rules (admission,
eviction, pinning) because every caller (the layer runner, the guard, the ledger, the planner)
asks them and none of them moves a slot.
"""

from __future__ import annotations

import torch

from moespec.runtime.cache.slot import Key, SlotState
from moespec.runtime.transfer.base import Ticket


class SlotQueries:
    """Read-only views of the slots; mixed into ExpertCache, whose slot records (``_slot``), indexes
    (``_where``, ``_by_layer``, ``_lru``, ``_protected``), ``store``, ``slots`` and ``engine`` they read."""

    def resident(self, key: Key) -> bool:
        """True when ``key`` is in a slot (its copy may still be in flight)."""
        return key in self._where

    def resident_keys(self) -> list[Key]:
        """Keys currently held in slots."""
        return list(self._where)

    def resident_experts(self, layer: int) -> set[int]:
        """Expert ids of ``layer`` currently held in slots."""
        return self._by_layer.get(layer, set())

    def resident_first(self, layer: int, experts: list[int]) -> list[int]:
        """``experts`` of ``layer``, resident ones first, each group in the given order (a layer pins its
        hits before its misses, a prediction its resident experts): no copy evicts what it needs."""
        resident = self.resident_experts(layer)
        return [e for e in experts if e in resident] + [e for e in experts if e not in resident]

    def key_of(self, slot: int) -> Key | None:
        """The key held in ``slot``."""
        return self._slot[slot].key

    def state(self, slot: int) -> SlotState:
        """What ``slot``'s bytes are."""
        return self._slot[slot].state

    def pinned(self, slot: int) -> bool:
        """True while ``slot`` is pinned (in use by the running layer or held by a prefetch)."""
        return self._slot[slot].pins > 0

    def ticket(self, slot: int) -> Ticket | None:
        """The copy into ``slot`` that compute has not waited for (None: none)."""
        return self._slot[slot].ticket

    def in_flight(self, slot: int) -> bool:
        """True while a copy into ``slot`` may still be writing it (never blocks)."""
        ticket = self._slot[slot].ticket
        return ticket is not None and not self.engine.landed(ticket)

    def unused_prediction(self, slot: int) -> bool:
        """True when ``slot`` holds a prefetched expert that no compute has used (reused first)."""
        return self._slot[slot].predicted

    def evictable(self) -> int:
        """Number of slots that a new copy could take now."""
        return len(self._lru) - len(self._protected)

    def copy_bytes(self, layer: int) -> int:
        """Bytes one copy of a layer-``layer`` expert moves: less than a slot where a GGUF file's
        layers mix quant types (ExpertStore.copy_bytes)."""
        return self.store.copy_bytes(layer)

    def row(self, slot: int) -> torch.Tensor:
        """The packed expert [P] held in ``slot`` (read it through ``store.layout``)."""
        return self.slots[slot]
