"""ExpertCache properties, one per test: LRU order, pins, prefetch room, unpinned host store on CPU."""

from __future__ import annotations

import pytest
import torch

from moespec.models.base import ExpertLayout
from moespec.runtime.cache.slots import ExpertCache
from moespec.runtime.cache.replay import NullEngine, _NullStore
from moespec.runtime.host.store import ExpertStore
from moespec.runtime.transfer import ThreadTransferEngine


def _cache(slots: int, experts: int = 6):
    store = ExpertStore([0, 1], experts, ExpertLayout(hidden=4, intermediate=2), torch.float32, pin=False)
    store.buffer.copy_(torch.arange(store.buffer.numel(), dtype=torch.float32).view_as(store.buffer))
    engine = ThreadTransferEngine()
    return ExpertCache(store, slots, torch.device("cpu"), engine), engine


def test_store_stays_unpinned_on_cpu_and_copies_are_exact():
    cache, engine = _cache(2)
    assert cache.store.pinned is False
    got = cache.acquire((1, 3))
    cache.wait(got.slot)
    assert torch.equal(cache.slots[got.slot], cache.store.expert(1, 3))
    assert cache.store.expert_bytes == 3 * 4 * 2 * 4
    engine.close()


def test_lru_evicts_least_recently_used_unpinned():
    cache, engine = _cache(2)
    a = cache.acquire((0, 0))
    b = cache.acquire((0, 1))
    cache.release(a.slot)
    cache.release(b.slot)  # b is now most recently used
    c = cache.acquire((0, 2))
    assert c.slot == a.slot and not cache.resident((0, 0)) and cache.resident((0, 1))
    engine.close()


def test_pinned_slots_are_never_evicted():
    cache, engine = _cache(2)
    assert cache.acquire((0, 0)) is not None
    b = cache.acquire((0, 1))
    assert cache.acquire((0, 2)) is None  # both pinned: no room
    assert cache.prefetch((0, 3)) is None
    cache.release(b.slot)
    assert cache.acquire((0, 2)).slot == b.slot
    assert cache.resident((0, 0))
    engine.close()


def test_prefetch_pin_protects_until_released_and_counts_first_use():
    cache, engine = _cache(3)
    slot, copied = cache.prefetch((1, 5))
    assert copied
    assert cache.prefetch((1, 5)) == (slot, False)  # already there: no second copy
    got = cache.acquire((1, 5))
    assert got.hit and got.prefetched
    assert not cache.acquire((1, 5)).prefetched  # only the first use counts as a prefetch hit
    assert cache.copies == 1
    engine.close()


class _QueuedEngine(NullEngine):
    """Copies that stay queued until cancelled (cancel always succeeds): the cache's side of a cancel."""

    def cancel(self, ticket) -> bool:
        return True


def test_cancelled_prefetch_gives_the_slot_back_to_what_it_displaced():
    cache = ExpertCache(_NullStore(1), 2, torch.device("cpu"), _QueuedEngine(), prefetch_slots=1)
    a, b = cache.acquire((0, 0)).slot, cache.acquire((0, 1)).slot
    cache.release(a)
    cache.release(b)  # (0, 0) is the LRU victim
    slot, copied = cache.prefetch((1, 5))
    assert copied and slot == a and not cache.resident((0, 0))
    assert cache.cancel_prefetch(slot) and cache.copies == 2  # never started: its bytes never moved
    assert cache.key_of(slot) == (0, 0) and cache.resident((0, 0)) and not cache.resident((1, 5))
    cache.release(slot)
    assert cache.acquire((0, 0)).hit  # the slot's bytes were never written: still (0, 0)'s expert


def test_cancelled_prefetch_leaves_the_slot_empty_when_its_expert_came_back_elsewhere():
    cache = ExpertCache(_NullStore(1), 3, torch.device("cpu"), _QueuedEngine(), prefetch_slots=1)
    for e in range(3):
        cache.release(cache.acquire((0, e)).slot)
    slot, _ = cache.prefetch((1, 5))  # displaces (0, 0)
    again = cache.acquire((0, 0))  # a demand miss brings it back into another slot
    assert not again.hit and again.slot != slot
    assert cache.cancel_prefetch(slot) and cache.key_of(slot) is None


def test_reference_moe_matches_cached_compute():
    """The slow reference (straight from host rows) equals the slot-based compute."""
    from moespec.models.base import Routing
    from moespec.runtime.layer.experts import TopkSum, reference_moe, weighted_contribution

    cache, engine = _cache(6)
    torch.manual_seed(0)
    cache.store.buffer.normal_()
    x = torch.randn(5, 4)
    ids = torch.tensor([[0, 2], [2, 5], [1, 0], [5, 4], [3, 2]])
    routing = Routing(ids=ids, weights=torch.rand(5, 2))
    act = torch.nn.functional.silu
    want = reference_moe(x, routing, cache.store.buffer[1], cache.store.layout, act)
    acc = TopkSum(x, routing.weights)
    for e in sorted(set(ids.flatten().tolist())):
        got = cache.acquire((1, e))
        cache.wait(got.slot)
        tok, _, y = weighted_contribution(x, routing, e, cache.row(got.slot), cache.store.layout, act)
        kpos = (ids[tok] == e).int().argmax(dim=1)
        acc.put_pairs(tok * 2 + kpos, y)
        cache.release(got.slot)
    assert torch.equal(acc.result(), want)
    engine.close()


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                          (torch.bfloat16, torch.bfloat16)])
def test_decode_fast_path_equals_general_path(dtype, wdtype):
    """decode_contribution (host-known position) == weighted_contribution (torch.where) bit for bit,
    including the product's dtype (bf16 output x float32 weight is float32, as in transformers)."""
    from moespec.models.base import ExpertLayout, Routing
    from moespec.runtime.layer.experts import decode_contribution, weighted_contribution

    torch.manual_seed(1)
    layout = ExpertLayout(hidden=8, intermediate=4)
    row = torch.randn(layout.numel).to(dtype)
    x = torch.randn(1, 8).to(dtype)
    routing = Routing(ids=torch.tensor([[3, 1, 6]]), weights=torch.rand(1, 3).to(wdtype))
    act = torch.nn.functional.silu
    for k, e in enumerate([3, 1, 6]):
        raw, y = decode_contribution(x, routing, k, row, layout, act)
        _, raw_slow, y_slow = weighted_contribution(x, routing, e, row, layout, act)
        assert torch.equal(raw, raw_slow) and torch.equal(y, y_slow)
        assert y.dtype == torch.promote_types(dtype, wdtype)


def _state(cache: ExpertCache):
    """Everything acquire touches: slot records, the indexes and the rule's scores."""
    recs = [(r.key, r.state, r.pins, r.ticket is None) for r in cache._slot]
    return (recs, list(cache._lru), sorted(cache._protected), sorted(cache._spare), sorted(cache._held),
            list(cache._visit), dict(getattr(cache.rule, "value", {})))


def test_acquire_hits_equals_one_acquire_each():
    """The batch pin of a resident layer (acquire_hits) against acquire per key, on two caches with the
    same history: hits, a prefetched expert not used yet (PREDICTED), an unused prediction (UNUSED),
    one protected by a prefetch pin; under LFRU, whose scores depend on every use."""
    from moespec.runtime.cache.eviction import LfruRule

    def history():
        cache = ExpertCache(_NullStore(2), 6, torch.device("cpu"), NullEngine(), rule=lambda: LfruRule({}, 4, 2))
        for e in (0, 1, 2):
            cache.release(cache.acquire((0, e)).slot)
        cache.prefetch((1, 4))  # a prefetch copy: PREDICTED, held
        slot, _ = cache.prefetch((1, 5))
        cache.mark_unused(slot)
        cache.release(slot)  # UNUSED, spare
        cache.prefetch((0, 1))  # a resident one: protected
        cache.begin_visit(1)
        return cache

    a, b = history(), history()
    got = a.acquire_hits(1, [4, 5])
    want = [b.acquire((1, e)) for e in (4, 5)]
    assert got == ([w.slot for w in want], sum(w.prefetched for w in want)) and got[1] == 1
    assert _state(a) == _state(b)
    a.begin_visit(0)
    b.begin_visit(0)
    got = a.acquire_hits(0, [0, 1, 2])
    want = [b.acquire((0, e)) for e in (0, 1, 2)]
    assert got == ([w.slot for w in want], 0)
    assert _state(a) == _state(b)
    for c in (a, b):
        for s in got[0]:
            c.release(s)
    assert _state(a) == _state(b)
