"""Which slot an ahead prefetch (a prediction of the layer after the next, l+2) may take: only room
that no would-be hit lives in.

The prefetch rule of slots.py lets a next-layer (l+1) prefetch take the slot its demand miss would
take. An l+2 read cannot follow that rule: layer l+1's misses come first and would pick the same
victims, so an l+2 copy into the rule's victim could evict what l+1 (or a later layer) hits. So an
ahead copy takes only a slot a demand copy takes before any cached expert: an empty slot or an unused
prediction (a prefetch whose layer ran without it), never pinned, never with a copy in flight, and
only while more than ``keep`` such slots stay free after it (``keep`` = K: the next layer's demand
misses still all find one, so none of them reaches the eviction rule's victim because of it). A
wrong ahead copy therefore evicts no cached expert and displaces none (tests/test_ahead_prefetch.py).
These are ExpertCache's methods (mixed in, as prefetch_end.py); the ledger (ledger.py) drives them.
"""

from __future__ import annotations

from moespec.runtime.cache.slot import Key, SlotState

EMPTY = SlotState.EMPTY


class AheadSlots:
    """The ahead prefetch's admission; mixed into ExpertCache (its ``_lru``, ``_slot``, ``_spare``,
    ``_protected``, ``_held``, ``_where`` and ``_copy_into``)."""

    def ahead_room(self, keep: int) -> list[int]:
        """Slots an ahead copy may take now, oldest first, beyond the ``keep`` a demand copy takes
        first (module docstring); empty when there are ``keep`` or fewer."""
        free = []
        records, spare, protected = self._slot, self._spare, self._protected
        for s in self._lru:  # empty slots are first in the order; unused predictions anywhere
            rec = records[s]
            if s in protected or rec.pins or self.in_flight(s):
                continue
            if rec.state is EMPTY or s in spare:
                free.append(s)
        return free[: max(0, len(free) - keep)]

    def prefetch_ahead(self, key: Key, keep: int) -> int | None:
        """Copy ``key`` into ahead room (module docstring) as an ahead prefetch, pinned until its layer
        settles it (PrefetchLedger); its slot, or None: resident already (nothing to read, nothing
        pinned), no room beyond ``keep``, or ``prefetch_slots`` unused copies pinned already."""
        if key in self._where or len(self._held) >= self.prefetch_slots:
            return None
        room = self.ahead_room(keep)
        if not room:
            return None
        slot = room[0]
        del self._lru[slot]
        return self._copy_into(slot, key, prefetch=True, ahead=True)

    def confirm(self, slot: int) -> None:
        """The next layer's prediction wants ``slot``'s ahead copy too: what of it has not started goes
        with the next-layer prefetches (TransferEngine.confirm)."""
        ticket = self._slot[slot].ticket
        if ticket is not None and ticket.ahead:
            self.engine.confirm(ticket)
