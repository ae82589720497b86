"""Layer l+2's ahead reads (runtime/layer/ahead.py, cache/ahead_slot.py, the disk reader's AHEAD level).

The reads happen once the lookahead's running recall reaches the threshold (and not below it); an
ahead read goes after every demand read and every next-layer prefetch read, until confirmed; an
ahead copy takes only empty slots or unused predictions beyond K, so a wrong one evicts no cached
expert and the next layer's K misses still evict nothing; exact mode's output is unchanged.
"""

from __future__ import annotations

import shutil
import threading
from dataclasses import replace

import pytest
import torch
from tiny import engine_steps

from moespec.config import Predictor, RuntimeConfig
from moespec.runtime.cache.slot import SlotState
from moespec.runtime.cache.stream import stream
from moespec.runtime.layer.ahead import AheadPrefetch
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import LayerStats, NullRecorder, StatsRecorder
from moespec.runtime.transfer.disk import DiskReadEngine

STRIDE = 8192  # the tiny qwen3_moe row's slot stride (test_disk_reader.py)


@pytest.fixture
def folder(tiny_models, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(tiny_models["qwen3_moe"], out)
    return out


def _disk_model(folder, slots: int, predictor=Predictor.ROUTER):
    return load_offloaded(folder, RuntimeConfig(host_memory_bytes=slots * STRIDE, predictor=predictor), StatsRecorder())


def test_an_ahead_read_goes_after_demand_and_next_layer_prefetch_reads_until_confirmed(folder):
    om = _disk_model(folder, 8)
    store = om.store
    om.close()
    for confirm in (False, True):
        engine = DiskReadEngine(store.path, readers=1)
        layer = store.moe_layers[0]
        gate, order = threading.Event(), []

        def fault(row):
            order.append(row.key[1])
            gate.wait()

        engine.fault = fault
        slots = store.slot_rows(4, torch.device("cpu"))  # [4, P]
        first = engine.submit(slots[0], store.expert(layer, 0), 0)
        while not first.started:
            pass
        ahead = engine.submit(slots[1], store.expert(layer, 1), 1, prefetch=True, ahead=True)
        nxt = engine.submit(slots[2], store.expert(layer, 2), 2, prefetch=True)
        demand = engine.submit(slots[3], store.expert(layer, 3), 3)
        if confirm:
            engine.confirm(ahead)  # with the next layer's prefetches now, in its own (earlier) place
        gate.set()
        for t in (first, demand, nxt, ahead):
            engine.wait(t)
        engine.close()
        assert order == ([0, 3, 1, 2] if confirm else [0, 3, 2, 1])


def _fill(cache, keys) -> None:
    """Demand-copy ``keys`` into the cache and let them land, as layers that ran (all CACHED)."""
    for layer, e in keys:
        cache.begin_visit(layer)
        got = cache.acquire((layer, e))
        cache.wait(got.slot)
        cache.release(got.slot)


def test_a_wrong_ahead_copy_evicts_no_cached_expert_and_leaves_k_free(folder):
    om = _disk_model(folder, 10)  # 10 slots of the 24 experts (3 layers x 8), K = 2
    cache, ledger = om.cache, om.ledger
    a, b, c = om.store.moe_layers
    try:
        cached = [(a, 0), (a, 1), (b, 0), (b, 1), (c, 0), (c, 1)]
        _fill(cache, cached)  # 6 cached, 4 empty
        assert len(cache.ahead_room(keep=2)) == 2
        stats = LayerStats()
        issued = ledger.issue_ahead(c, [4, 5, 6, 7], stats, keep=2)  # wrong: layer c will use 0 and 1
        assert issued == 2 and stats.prefetched == stats.prefetched_ahead == 2  # room for two only
        assert all(cache.resident(k) for k in cached)  # no cached expert was evicted
        cache.engine.synchronize()
        # layer b runs with two misses: they take the two slots left free, still evicting nothing
        list(stream(cache, b, [2, 3], LayerStats(), NullRecorder()))
        assert all(cache.resident(k) for k in cached)
        # layer c runs with 0 and 1: both hits; the wrong ahead copies are wasted, their slots spare
        run = LayerStats()
        kept = ledger.settle(c, {0, 1}, run)
        list(stream(cache, c, [0, 1], run, NullRecorder(), kept))
        assert kept == [] and run.hits == 2 and run.misses == 0 and run.prefetch_wasted == 2
        assert sum(cache.state(s) is SlotState.UNUSED for s in range(10)) == 2  # the next copies' slots
    finally:
        om.close()


def test_no_ahead_copy_when_room_is_only_k_or_the_key_is_resident(folder):
    om = _disk_model(folder, 8)
    cache, ledger = om.cache, om.ledger
    a, b, c = om.store.moe_layers
    try:
        _fill(cache, [(a, e) for e in range(6)])  # 6 cached, 2 empty = K
        assert cache.ahead_room(keep=2) == []
        assert ledger.issue_ahead(c, [3], LayerStats(), keep=2) == 0
        assert ledger.issue_ahead(a, [0], LayerStats(), keep=0) == 0  # resident: nothing to read
        assert ledger.held() == {a: [], c: []}
    finally:
        om.close()


def test_the_next_layers_prediction_confirms_an_ahead_copy_and_settles_it_once(folder):
    om = _disk_model(folder, 10)
    cache, ledger = om.cache, om.ledger
    _, _, c = om.store.moe_layers
    try:
        stats = LayerStats()
        assert ledger.issue_ahead(c, [4], stats, keep=2) == 1
        (slot,) = ledger.held()[c]
        ledger.issue(c, [4], stats)  # the next layer predicts 4 too: the same slot, pinned twice
        assert ledger.held()[c] == [slot, slot] and stats.prefetched == 1
        assert not cache.ticket(slot).ahead  # confirmed: a next-layer prefetch now
        kept = ledger.settle(c, {4}, stats)
        list(stream(cache, c, [4], stats, NullRecorder(), kept))
        assert stats.hits == 1 and stats.prefetch_used == 1 and not cache.pinned(slot)
    finally:
        om.close()


def test_reads_start_only_at_the_lookaheads_measured_recall(folder):
    om = _disk_model(folder, 10)
    try:
        a, _, c = om.store.moe_layers
        ahead = AheadPrefetch(om.runner.policy.predictor, om.ledger, 2, min_recall=0.75, min_seen=2)
        rec = StatsRecorder()
        assert ahead.issue(a, [4, 5], rec) == 0 and ahead.recall is None  # not measured yet: no reads
        ahead.observe(c, [4, 6])  # half right
        ahead.issue(a, [4, 5], rec)
        ahead.observe(c, [4, 5])  # right
        assert ahead.recall == pytest.approx(0.75)
        assert ahead.issue(a, [4, 5], rec) == 2 and ahead.issued == 2
        om.ledger.drop(cancel=True)
        ahead.observe(c, [0, 1])  # wrong: the running recall falls to 0.5, reads stop
        assert ahead.recall == pytest.approx(0.5) and ahead.issue(a, [6, 7], rec) == 0
    finally:
        om.close()


def test_exact_mode_with_ahead_reads_equals_without(folder):
    ids = [3]  # a one-token prefill leaves most of the 16 slots empty: room for ahead copies
    base = _disk_model(folder, 16)
    try:
        ref_logits, ref_toks = engine_steps(base, ids, 6)
    finally:
        base.close()
    om = _disk_model(folder, 16)
    try:
        om.use_policy(replace(om.runner.policy, ahead_recall=0.0))
        om.runner.ahead.min_seen = 0
        logits, toks = engine_steps(om, ids, 6)
        assert om.runner.ahead.issued > 0  # the reads happened
        assert toks == ref_toks and torch.equal(logits, ref_logits)
    finally:
        om.close()
