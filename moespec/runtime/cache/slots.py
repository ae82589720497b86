"""ExpertCache: a fixed pool of device slots holding packed experts; prefetch takes slots as a miss would.

Shapes: S slots, P packed elements per expert.

A slot is pinned (never evicted) while the running layer uses it or while it holds a prefetch
whose target layer has not run yet. Copies go through the TransferEngine; the compute side waits
on exactly the slot it reads. Each slot is one record (slot.py: its state, pins, copy in flight);
the cache keeps indexes over them: which key is where, the eviction order of unpinned slots, and
the sets its rule needs to be fast.

The rule that keeps prefetch from costing more than it saves (docs/decisions.md, 2026-11 "prefetch
takes slots as a miss would"):

- A prefetch of a resident expert costs nothing: it only pins the slot it is in, keeping the
  slot's place in the eviction order (a prediction is not a use). The ledger (ledger.py) pins a
  layer's resident predictions before it copies any other, as a layer pins its hits before its
  misses (stream.py).
- A demand copy takes the first of: an empty slot; the oldest **unused prediction** (a
  prefetched expert whose target layer ran without it); the eviction rule's victim
  (``--cache-policy``, eviction.py) among the others but the layer before's, then among those;
  never a pinned slot. There is no reserved prefetch area: every slot is cache.
- A prefetch copy takes exactly the slot its demand miss would take when the target layer runs,
  or none: the choice is made as if the running layer were done (its slots released, in expert
  order, behind every other: stream.py) and the slots left to the target's skipped prefetches
  were gone. When that slot is pinned or in flight now, or ``prefetch_slots`` (K) unused copies
  are pinned already, the prefetch is skipped and the slot left to its miss. The rules compare
  keys alike whenever they are asked (eviction.py), and the order a layer's uses or releases come
  in changes nothing, so a perfect prediction evicts what on-demand loading evicts, only earlier:
  the same bytes under every policy (tests/test_prefetch_bound.py, random traces). A wrong one
  copies once (a wasted prediction) and its slot is the next to be reused, so it displaces at
  most the one expert the rule gave up for it. A prefetch whose copy is cancelled before it
  started (its target layer came first) gives its slot back to the expert it displaced.
- A used prediction is an ordinary cache entry: the rule hears of its use as of any other.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from typing import Callable

import torch

from moespec.config import CachePolicy
from moespec.runtime.cache.ahead_slot import AheadSlots
from moespec.runtime.cache.eviction import EvictionRule
from moespec.runtime.cache.prefetch_end import PrefetchEnds
from moespec.runtime.cache.slot import Acquired, Key, Slot, SlotState
from moespec.runtime.cache.slot_queries import SlotQueries
from moespec.runtime.host.store import ExpertStore
from moespec.runtime.transfer.base import Span, TransferEngine

EMPTY, CACHED, PREDICTED, UNUSED, RESTORED = (SlotState.EMPTY, SlotState.CACHED, SlotState.PREDICTED,
                                              SlotState.UNUSED, SlotState.RESTORED)


class ExpertCache(SlotQueries, PrefetchEnds, AheadSlots):
    """Device-side expert slots over an ExpertStore (the prefetch rule: module docstring).

    Args:
        store: host store of packed experts.
        num_slots: S, number of device slots.
        device: where the slots live.
        engine: transfer engine that performs the copies.
        rule: makes the eviction rule (called again by ``clear``); None = LRU.
        prefetch_slots: most slots that prefetch copies not used yet may hold at once (K, so the
            running layer keeps room; capped at S - 1); None = S // 2.
    """

    def __init__(self, store: ExpertStore, num_slots: int, device: torch.device, engine: TransferEngine,
                 rule: Callable[[], EvictionRule] | None = None, prefetch_slots: int | None = None) -> None:
        self.store = store
        self.engine = engine
        self.num_slots = num_slots
        default = num_slots // 2 if prefetch_slots is None else prefetch_slots
        self.prefetch_slots = max(0, min(default, num_slots - 1))
        self._make_rule = rule or EvictionRule
        self.slots = store.slot_rows(num_slots, device)  # [S, P]
        self.expert_bytes = store.expert_bytes  # a slot's bytes: the most one copy moves (copy_bytes: per layer)
        self.copies = 0  # copies issued (demand + prefetch)
        self._reset()

    def _reset(self) -> None:
        n = self.num_slots
        self.rule = self._make_rule()
        self._slot = [Slot(i) for i in range(n)]
        # Indexes over the records, kept in step with them:
        self._where: dict[Key, int] = {}  # key -> slot holding it
        self._by_layer: dict[int, set[int]] = {}  # layer -> resident expert ids (for the guard)
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(n))  # unpinned, oldest first
        self._protected: set[int] = set()  # in _lru but pinned by a prefetch (not evictable)
        self._spare: set[int] = set()  # in _lru and holding a prediction no compute used
        self._held: set[int] = set()  # pinned, holding a prefetch copy not used yet (<= prefetch_slots)
        # The running layer (begin_visit) and the slots it acquired; the slots of the visit before, if
        # of another layer (a demand copy takes them last: _victim).
        self._visit_layer, self._visit, self._last = None, [], set()

    @property
    def policy(self) -> CachePolicy:
        """The eviction rule's policy."""
        return self.rule.policy

    # --- pinning -------------------------------------------------------------------------
    def _pin(self, slot: int) -> None:
        self._slot[slot].pins += 1
        self._lru.pop(slot, None)
        self._protected.discard(slot)
        self._spare.discard(slot)

    def _protect(self, slot: int) -> None:
        """Pin a resident slot for a prefetch without touching its place in the eviction order:
        a prediction is not a use, so a wrong one must not make its expert look recent."""
        self._slot[slot].pins += 1
        if slot in self._lru:
            self._protected.add(slot)

    def release(self, slot: int) -> None:
        """Drop one pin of ``slot``; at zero it becomes evictable (most recently used)."""
        rec = self._slot[slot]
        assert rec.pins > 0, f"slot {slot} released more often than pinned"
        rec.pins -= 1
        if rec.pins == 0:
            self.engine.slot_released(slot)
            self._held.discard(slot)
            if slot in self._protected:  # pinned only by a prefetch: it kept its place
                self._protected.discard(slot)
                return
            self._lru[slot] = None
            state = rec.state
            if state is PREDICTED or state is UNUSED:
                self._spare.add(slot)
            elif state is EMPTY or state is RESTORED:  # empty, or the victim it was: reused first
                if state is RESTORED:
                    rec.state = CACHED
                self._lru.move_to_end(slot, last=False)

    def _evict_to_empty(self, rec: Slot) -> None:
        key = rec.key
        if key is not None:
            del self._where[key]
            self._by_layer[key[0]].discard(key[1])
        rec.key = None
        rec.state = EMPTY

    def _victim(self, reserved: set[int] | None = None, target: int | None = None) -> int | None:
        """The slot a demand copy takes now: an empty one, else the oldest unused prediction, else the
        rule's victim, among unpinned slots; the layer before's only when no other is evictable
        (``EvictionRule.keeps_last_visit``). With ``reserved`` (a prefetch for layer ``target``): the
        one its demand miss would take, the running layer's slots counted as released and ``reserved``
        as gone (module docstring); it may be pinned or in flight now. The last visit's slots are
        the layer before's for ``target``'s miss (``begin_visit``) whether they are still pinned
        (inside a token) or released already (a token-start prefetch: token_start.py)."""
        protected, records, rule = self._protected, self._slot, self.rule
        if reserved is None:
            back_set = self._last if rule.keeps_last_visit else ()
            skip = protected.union(back_set) if back_set else protected
            back = lambda: (records[s] for s in self._lru if s in back_set and s not in protected)  # noqa: E731
        else:
            skip = protected | reserved
            running = sorted((records[s] for s in self._visit if records[s].pins and s not in skip),
                             key=lambda rec: rec.key)  # released in key order, behind every other
            visit = set(self._visit) if rule.keeps_last_visit and target != self._visit_layer else ()
            done = [records[s] for s in self._lru if s in visit and s not in skip]  # released already
            if visit:
                skip = skip | visit
            back = lambda: itertools.chain(done, running)  # noqa: E731

        def front():  # lazily: LRU's victim is usually the first slot
            return (records[s] for s in self._lru if s not in skip)

        if self._spare:  # unpinned unused predictions exist (empty slots are first in the order anyway)
            for rec in front():
                state = rec.state  # identity tests: no call per slot on this scan
                if state is EMPTY or state is PREDICTED or state is UNUSED:
                    return rec.index
        if rule.keeps_last_visit:
            got = rule.victim(front()) or rule.victim(back())
        else:
            got = rule.victim(itertools.chain(front(), back()))
        return None if got is None else got.index

    def _copy_into(self, slot: int, key: Key, prefetch: bool, ahead: bool = False) -> int:
        rec = self._slot[slot]
        self._spare.discard(slot)
        rec.displaced = rec.key if prefetch else None
        self._evict_to_empty(rec)
        rec.key, rec.state = key, PREDICTED if prefetch else CACHED
        self._where[key] = slot
        self._by_layer.setdefault(key[0], set()).add(key[1])
        n = self.store.row_numel(key[0])  # the layer's row: that layer's layout never reads the slot past it
        dst, src = self.slots[slot, :n], self.store.expert(*key)[:n]
        rec.ticket = self.engine.submit(dst, src, slot, prefetch, ahead=True) if ahead else \
            self.engine.submit(dst, src, slot, prefetch)
        rec.issued_s = time.perf_counter()
        self.copies += 1
        rec.pins = 1
        if prefetch:
            self._held.add(slot)
        return slot

    def _load(self, key: Key) -> int | None:
        """A demand copy of ``key`` into the slot ``_victim`` picks; None when every slot is pinned."""
        slot = self._victim()
        if slot is None:
            return None
        del self._lru[slot]
        return self._copy_into(slot, key, prefetch=False)

    def set_rule(self, rule: Callable[[], EvictionRule]) -> None:
        """Replace the eviction rule's maker (the loader does it once the calibration file is checked)
        and empty the cache, as ``clear`` does; no slot may be pinned."""
        self._make_rule = rule
        self.clear()

    def clear(self) -> None:
        """Empty every slot (a cold cache: the rule restarts from its seed; ``moespec profile``) after
        all copies finished; no slot may be pinned."""
        assert not any(rec.pins for rec in self._slot), "clear() while slots are pinned"
        self.engine.synchronize()
        self._reset()

    def abort(self) -> None:
        """After an interrupted forward (Ctrl-C): cancel queued copies, drop every pin.

        Copies that never ran leave their slot empty (its key forgotten); the running copy is waited
        for. Then every slot is evictable and every resident key holds its expert, as after a forward.
        """
        for ticket in self.engine.cancel_pending():
            # The slot's current copy (or an older one still queued behind it): either way the
            # slot's bytes are not the key's expert, so forget the key. Emptying is always safe.
            rec = self._slot[ticket.slot]
            if rec.ticket is None or rec.ticket is ticket:
                self._evict_to_empty(rec)
                self.copies -= 1
        self.engine.synchronize()  # a CUDA stream cannot drop copies: let them land
        for rec in self._slot:
            slot = rec.index
            if rec.pins:
                rec.pins = 1
                self.release(slot)  # back to the eviction order (a protected slot is already there)
            rec.ticket = None  # every copy has landed or was dropped
            if rec.state is PREDICTED or rec.state is UNUSED:
                rec.state = CACHED
            rec.displaced = None
            self._spare.discard(slot)
            if rec.state is EMPTY and slot in self._lru:  # empty slots are reused first
                self._lru.move_to_end(slot, last=False)

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
            rec = self._slot[slot]
            state = rec.state
            prefetched = state is PREDICTED
            if prefetched or state is UNUSED:
                rec.state = CACHED
            self._held.discard(slot)
            self._visit.append(slot)
            return Acquired(slot, hit=True, prefetched=prefetched)
        slot = self._load(key)
        if slot is None:
            return None
        self.rule.used(key)
        self._visit.append(slot)
        return Acquired(slot, hit=False, prefetched=False)

    def acquire_hits(self, layer: int, experts: list[int]) -> tuple[list[int], int]:
        """:meth:`acquire` of ``(layer, e)`` for each of ``experts``, all resident (callers check):
        (their slots in order, how many of them held a prefetch not used yet). The same pins, eviction
        order, rule uses and visit as one :meth:`acquire` each, in one loop without a record per key
        (a resident decode layer's batch pin: stream.acquire_resident; tests/test_cache.py compares).

        Raises:
            KeyError: an expert is not resident (nothing after it is acquired).
        """
        where, records, lru, used = self._where, self._slot, self._lru, self.rule.used
        protected, spare, held, visit = self._protected, self._spare, self._held, self._visit
        slots, prefetched = [], 0
        for e in experts:
            key = (layer, e)
            slot = where[key]
            rec = records[slot]
            rec.pins += 1  # _pin
            lru.pop(slot, None)
            protected.discard(slot)
            spare.discard(slot)
            used(key)
            state = rec.state
            if state is PREDICTED:
                prefetched += 1
                rec.state = CACHED
            elif state is UNUSED:
                rec.state = CACHED
            held.discard(slot)
            visit.append(slot)
            slots.append(slot)
        return slots, prefetched

    def begin_visit(self, layer: int) -> None:
        """A layer starts acquiring its experts (stream.py calls it first): the eviction rule's clock
        moves on, and the slots it acquires from now on are the running layer's (``prefetch``)."""
        self._last = set(self._visit) if layer != self._visit_layer else set()
        self._visit, self._visit_layer = [], layer
        self.rule.visit(layer)

    def prefetch(self, key: Key, reserved: set[int] | None = None, copy: bool = True) -> tuple[int, bool] | None:
        """Pin ``key`` ahead of use, copying it if absent. Returns (slot, copied) or None (no copy).

        A resident ``key`` is only pinned. Otherwise the copy takes exactly the slot its demand miss
        would take, or none (module docstring; ``copy`` False: the budget is spent) and that slot joins
        ``reserved``, the slots left to the target layer's misses (one set per prediction). The pin
        holds until the caller releases it after the target layer ran.
        """
        slot = self._where.get(key)
        if slot is not None:
            self._protect(slot)
            self.confirm(slot)  # an ahead copy (ahead_slot.py) is the next layer's prediction now
            return slot, False
        reserved = set() if reserved is None else reserved
        slot = self._victim(reserved, key[0])
        if slot is None:
            return None
        if not copy or len(self._held) >= self.prefetch_slots or self._slot[slot].pins or self.in_flight(slot):
            reserved.add(slot)
            return None
        del self._lru[slot]
        return self._copy_into(slot, key, prefetch=True), True

    def landed(self, key: Key) -> bool:
        """True when ``key`` is resident and its copy has finished (no stall to read it); no host sync."""
        slot = self._where.get(key)
        ticket = None if slot is None else self._slot[slot].ticket
        return slot is not None and (ticket is None or self.engine.landed(ticket))

    def copy_age_ms(self, key: Key) -> float:
        """ms since resident ``key``'s copy was issued (0.0: not resident), the miss planner's estimate."""
        slot = self._where.get(key)
        return 0.0 if slot is None else (time.perf_counter() - self._slot[slot].issued_s) * 1e3

    def copies_in_flight(self) -> int:
        """Copies issued into slots that have not landed yet (the link's backlog, for the miss planner)."""
        landed = self.engine.landed
        return sum(1 for rec in self._slot if rec.ticket is not None and not landed(rec.ticket))

    def wait(self, slot: int) -> Span | None:
        """Make compute wait for the copy into ``slot``; returns the stall span or None if none pending."""
        rec = self._slot[slot]
        ticket, rec.ticket = rec.ticket, None
        return None if ticket is None else self.engine.wait(ticket)
