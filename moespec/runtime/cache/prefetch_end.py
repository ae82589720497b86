"""How a prefetch copy ends when its target layer has run: used and promoted, cancelled before it
started, cut while it runs, or left as an unused prediction (the next copy's slot).

These are ExpertCache's methods (slots.py), kept apart because they are the one concept the ledger
(ledger.py) drives after each layer; the admission rule, which slot a prefetch may take, stays
with the pool in slots.py.
"""

from __future__ import annotations

from moespec.runtime.cache.slot import SlotState

PREDICTED, UNUSED, RESTORED = SlotState.PREDICTED, SlotState.UNUSED, SlotState.RESTORED


class PrefetchEnds:
    """The end of a prefetch copy's life; mixed into ExpertCache, whose slot records (``_slot``),
    indexes (``_where``, ``_by_layer``, ``_held``), ``engine`` and ``copies`` it updates."""

    def cancel_prefetch(self, slot: int) -> bool:
        """Cancel the not-yet-started prefetch copy into ``slot``.

        Returns True when the copy was dropped (no bytes moved): the slot holds again the expert the
        prefetch displaced (unless copied elsewhere since), first in the eviction order, as it was;
        else it is empty. The caller still releases its pin.
        """
        rec = self._slot[slot]
        ticket = rec.ticket
        if ticket is None or rec.state is not PREDICTED or not self.engine.cancel(ticket):
            return False
        rec.ticket = None
        self._held.discard(slot)
        self._evict_to_empty(rec)
        self.copies -= 1
        back, rec.displaced = rec.displaced, None
        if back is not None and back not in self._where:
            rec.key, rec.state = back, RESTORED
            self._where[back] = slot
            self._by_layer.setdefault(back[0], set()).add(back[1])
        return True

    def cut_prefetch(self, slot: int) -> int:
        """Stop the started prefetch copy into ``slot``, which its target layer ran without: its parts
        not started are dropped (TransferEngine.abort). Returns the bytes not moved (0: nothing was
        dropped, the copy runs to its end). Then the slot is empty (part of a row is no row; the
        expert it displaced is gone too), first in the eviction order once released; its ticket stays,
        so no prefetch takes it while the running part writes. The caller still releases its pin."""
        rec = self._slot[slot]
        ticket = rec.ticket
        if ticket is None or rec.state is not PREDICTED or self.engine.landed(ticket):
            return 0
        saved = self.engine.abort(ticket)
        if saved:
            self._held.discard(slot)
            self._evict_to_empty(rec)
            rec.displaced = None
        return saved

    def promote(self, slot: int) -> None:
        """The running layer needs the prefetch copy into ``slot`` (its ledger kept it): what of the copy
        has not started goes with the demand copies, ahead of the layer's misses (TransferEngine.promote)."""
        ticket = self._slot[slot].ticket
        if ticket is not None and ticket.prefetch:
            self.engine.promote(ticket)

    def mark_unused(self, slot: int) -> bool:
        """A prefetch copy whose target layer ran without it becomes UNUSED (the next copy's slot);
        True when ``slot`` held such a copy (a wasted prediction), False otherwise."""
        rec = self._slot[slot]
        wasted = rec.state is PREDICTED
        rec.state = UNUSED if wasted else rec.state
        return wasted
