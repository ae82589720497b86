"""OffloadedModel.drop_prefetches: a generation stopped between tokens leaves no prefetch pin and no queued copy."""

from __future__ import annotations

from serve_harness import wait_until

from moespec.config import Predictor, RuntimeConfig
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import LayerStats


def test_drop_prefetches_cancels_queued_prefetches_and_releases_pins(tiny_models):
    # A very slow emulated link (6 KB experts at 2 kB/s): the first copy runs for 3 s, the
    # others stay queued behind it.
    om = load_offloaded(tiny_models["qwen3_moe"], RuntimeConfig(device="cpu", cache_experts=4,
                                                                predictor=Predictor.ROUTER, link_gbps=2e-6))
    try:
        cache, engine = om.cache, om.cache.engine
        layer = om.store.moe_layers[1]
        n = cache.prefetch_slots  # at most K unused prefetch copies are pinned at once
        assert n >= 2
        om.ledger.issue(layer, list(range(n)), LayerStats())  # a prediction for a layer that never runs
        slots = om.ledger.held()[layer]
        wait_until(lambda: cache.ticket(slots[0]).started, "the first copy running")
        before = engine.bytes_moved
        queued = slots[1:]
        cancelled = om.drop_prefetches()
        assert cancelled == len(queued)
        assert engine.bytes_moved == before - cancelled * om.store.expert_bytes  # cancelled copies move nothing
        pins = [cache.pinned(s) for s in range(cache.num_slots)]
        assert not any(pins) and om.ledger.held() == {} and cache.evictable() == cache.num_slots
        assert all(not cache.resident((layer, e)) for e, s in enumerate(slots) if s in queued)
        assert om.drop_prefetches() == 0  # nothing left to abort
    finally:
        om.close()
