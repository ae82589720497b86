"""PrefetchLedger: the pins a prediction holds on slots for a later layer, from issue to settlement.

While layer l runs, its prediction of layer l' (the next MoE layer) pins slots: resident predicted
experts where they are, the others copied into the slots a miss would take (slots.py's rule).
When l' runs, the ledger settles them against what l' needs: a pin l' needs is **kept** (the
stream pins it again, then lets this one go) and what of its copy has not started is **promoted**
to go with the demand copies, ahead of the layer's misses (ExpertCache.promote: on the disk reader,
prefetch reads otherwise wait until every demand read is done, and compute then waits for them
last); a copy that has not started is **cancelled** (no bytes moved: counted as cancelled, not
prefetched, its bytes taken off); one that started is **cut** (its parts not started dropped,
ExpertCache.cut_prefetch: wasted, the bytes not read taken off, its slot empty); any other is
released, and a copy no compute used is **wasted** (its slot is the next copy's). A forward that ends before
l' (an exception, a stopped generation) **drops** what is left. The runtime's layer runner and the
policy replay (replay.py) both go through here. Ahead pins (a prediction of the layer after the next,
made two layers before it: runtime/layer/ahead.py) are issued into free room only (ahead_slot.py) and
settle with that layer's other pins, by the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from moespec.runtime.cache.slots import ExpertCache
from moespec.runtime.stats import LayerStats


@dataclass(frozen=True)
class Dropped:
    """What ``PrefetchLedger.drop`` let go: copies cancelled before they started, copies never used."""

    cancelled: int
    wasted: int


class PrefetchLedger:
    """Target layer -> the slots its prediction pinned, for one ExpertCache.

    Args:
        cache: the expert cache whose slots are pinned.
        promote_kept: promote a kept pin's copy (module docstring); False only to measure without it.
        cut_started: cut a started copy the layer does not need (module docstring); False: to measure.
    """

    def __init__(self, cache: ExpertCache, promote_kept: bool = True, cut_started: bool = True) -> None:
        self.cache = cache
        self.promote_kept = promote_kept
        self.cut_started = cut_started
        self._pins: dict[int, list[int]] = {}
        self._ahead: dict[int, list[int]] = {}  # target layer -> slots its ahead (l+2) copies pinned

    def held(self) -> dict[int, list[int]]:
        """Target layer -> pinned slots (a copy)."""
        out = {layer: list(slots) for layer, slots in self._pins.items()}
        for layer, slots in self._ahead.items():
            out[layer] = out.get(layer, []) + list(slots)
        return out

    def issue_ahead(self, target: int, experts: list[int], stats: LayerStats, keep: int) -> int:
        """Copy ``experts`` of layer ``target`` (the layer after the next), in the given order, into ahead
        room only (ExpertCache.prefetch_ahead: empty slots and unused predictions beyond ``keep``), at
        the lowest read priority; resident ones are left as they are. Stops at the first that finds no
        room. Counts the copies as ``stats.prefetched`` (and ``prefetched_ahead``) and their bytes;
        returns how many were issued."""
        cache = self.cache
        pins = self._ahead.setdefault(target, [])
        issued = 0
        for e in experts:
            if cache.resident((target, e)):
                continue
            slot = cache.prefetch_ahead((target, e), keep)
            if slot is None:
                break
            pins.append(slot)
            issued += 1
            stats.prefetched += 1
            stats.prefetched_ahead += 1
            stats.h2d_bytes += cache.copy_bytes(target)
        return issued

    def issue(self, target: int, experts: list[int], stats: LayerStats, budget: int | None = None) -> None:
        """Pin ``experts`` of layer ``target`` ahead of use: the resident ones first (no copy, so no
        copy of this prediction evicts one of them), then copies of the others, in the given order.

        Each copy takes the slot its demand miss would take when ``target`` runs, or none (the cache
        has no such slot free now: ``ExpertCache.prefetch``); an expert skipped leaves that slot to
        its miss, so a perfect prediction evicts exactly what on-demand loading would. ``budget``:
        most experts copied (``--on-miss auto``: what lands within a layer), resident ones free;
        None: no limit. Counts the copies as ``stats.prefetched`` and their bytes as ``stats.h2d_bytes``.
        """
        cache = self.cache
        pins, reserved = [], set()
        for e in cache.resident_first(target, experts):
            got = cache.prefetch((target, e), reserved, budget is None or budget > 0)
            if got is None:
                continue  # no copy: its demand miss takes the slot it was given
            slot, copied = got
            pins.append(slot)
            if copied:
                if budget is not None:
                    budget -= 1
                stats.prefetched += 1
                stats.h2d_bytes += cache.copy_bytes(target)
        self._pins[target] = pins

    def settle(self, layer: int, needed, stats: LayerStats) -> list[int] | None:
        """``layer`` is about to run with the experts ``needed`` (a container of ids): returns the pins
        it needs (hand them to ``stream``, stream.py; their copies promoted), or None when nothing was
        predicted for it.

        Every other pin is let go: a copy not started is cancelled (``stats``: prefetched - 1,
        prefetch_cancelled + 1, its bytes off h2d_bytes), one still running is cut (the bytes not
        read off h2d_bytes) and, like one that ran and was never used, counted in ``prefetch_wasted``.
        """
        pins, ahead = self._pins.pop(layer, None), self._ahead.pop(layer, None)
        if pins is None and ahead is None:
            return None
        pins = (pins or []) + (ahead or [])  # a slot in both holds two pins: settled (released) twice
        cache = self.cache
        kept = []
        for slot in pins:
            key = cache.key_of(slot)
            if key is not None and key[1] in needed:
                kept.append(slot)
                if self.promote_kept:
                    cache.promote(slot)
                continue
            if cache.cancel_prefetch(slot):
                # The copy never started: no bytes moved, the slot is free again.
                stats.prefetched -= 1
                stats.prefetch_cancelled += 1
                stats.h2d_bytes -= cache.copy_bytes(layer)
            elif saved := (cache.cut_prefetch(slot) if self.cut_started else 0):
                stats.prefetch_wasted += 1  # it moved bytes; the rest of them never will
                stats.h2d_bytes -= saved
            elif cache.mark_unused(slot):
                stats.prefetch_wasted += 1
            cache.release(slot)
        return kept

    def drop(self, cancel: bool) -> Dropped:
        """Let go of every pin (``cancel``: first drop the copies that have not started). A copy that
        ran stays in its slot as an unused prediction."""
        cache = self.cache
        cancelled = wasted = 0
        for slots in [*self._pins.values(), *self._ahead.values()]:
            for slot in slots:
                if cancel and cache.cancel_prefetch(slot):
                    cancelled += 1
                else:
                    wasted += cache.mark_unused(slot)
                cache.release(slot)
        self._pins.clear()
        self._ahead.clear()
        return Dropped(cancelled, wasted)

    def forget(self) -> None:
        """Forget every pin without releasing it: after ``ExpertCache.abort``, which dropped them all."""
        self._pins.clear()
        self._ahead.clear()
