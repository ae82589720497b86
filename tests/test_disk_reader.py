"""The disk reader's chunks and priorities (runtime/transfer/disk.py).

A row read in chunks lands byte-identical to one read whole; no prefetch chunk starts while a
demand chunk runs; a prefetch compute waits for goes with the demand reads; a kept prefetch is
promoted ahead of its layer's misses; a started wrong prefetch is cut (its unstarted chunks
dropped, its bytes uncounted, its slot empty and read again whole).
"""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from moespec.config import Predictor, RuntimeConfig
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder
from moespec.runtime.transfer import disk
from moespec.runtime.transfer.disk import DiskReadEngine


@pytest.fixture
def store(tiny_models, tmp_path):
    """The tiny qwen3_moe model's store file (rows of 6 KiB, stride 8 KiB) and its in-RAM store."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["qwen3_moe"], folder)
    om = load_offloaded(folder, RuntimeConfig(host_memory_bytes=4 * 8192, predictor=Predictor.NONE), StatsRecorder())
    om.close()
    ram = load_offloaded(folder, RuntimeConfig(predictor=Predictor.NONE))
    yield om.store, ram.store
    ram.close()


def test_a_row_read_in_chunks_equals_the_row_read_whole(store, monkeypatch):
    on_disk, ram = store
    reads = []
    real = disk.read_into

    def spy(fd, address, length, offset):
        reads.append((offset, length))
        return real(fd, address, length, offset)

    monkeypatch.setattr(disk, "read_into", spy)
    layer = on_disk.moe_layers[0]
    for chunk in (4096, 1 << 21):  # two chunks of a 6 KiB row (8 KiB read), then one
        reads.clear()
        engine = DiskReadEngine(on_disk.path, readers=3, chunk_bytes=chunk)
        slots = on_disk.slot_rows(3, torch.device("cpu"))  # [3, P]
        tickets = [engine.submit(slots[s], on_disk.expert(layer, e), s, prefetch=s == 2) for s, e in enumerate((0, 5, 7))]
        for t in tickets:
            engine.wait(t)
        engine.close()
        assert engine.reads == 3 and not engine._errors  # every checksum held
        assert len(reads) == (6 if chunk == 4096 else 3)
        for s, e in enumerate((0, 5, 7)):
            assert torch.equal(slots[s], ram.expert(layer, e))


def test_no_prefetch_chunk_starts_while_a_demand_chunk_runs(store):
    on_disk, _ = store
    engine = DiskReadEngine(on_disk.path, readers=4)
    layer = on_disk.moe_layers[0]
    gate, order = threading.Event(), []

    def fault(row):
        order.append(row.key)
        if row.key == (layer, 0):
            gate.wait()

    engine.fault = fault
    slots = on_disk.slot_rows(2, torch.device("cpu"))  # [2, P]
    demand = engine.submit(slots[0], on_disk.expert(layer, 0), 0)
    while not demand.started:
        pass
    ahead = engine.submit(slots[1], on_disk.expert(layer, 1), 1, prefetch=True)
    assert not ahead.done.wait(0.05) and not ahead.started  # three readers idle, the prefetch waits
    gate.set()
    engine.wait(demand)
    engine.wait(ahead)
    engine.close()
    assert order == [(layer, 0), (layer, 1)] and engine.reads == 2


def test_a_prefetch_compute_waits_for_goes_with_the_demand_reads(store):
    on_disk, ram = store
    engine = DiskReadEngine(on_disk.path, readers=1)
    layer = on_disk.moe_layers[0]
    gate, order = threading.Event(), []

    def fault(row):
        order.append(row.key)
        gate.wait()

    engine.fault = fault
    slots = on_disk.slot_rows(4, torch.device("cpu"))  # [4, P]
    first = engine.submit(slots[0], on_disk.expert(layer, 0), 0)
    while not first.started:
        pass
    early = engine.submit(slots[1], on_disk.expert(layer, 1), 1, prefetch=True)
    late = engine.submit(slots[2], on_disk.expert(layer, 2), 2, prefetch=True)
    other = engine.submit(slots[3], on_disk.expert(layer, 3), 3)
    engine.promote(late)  # what wait(late) does before it blocks
    gate.set()
    for t in (first, late, other, early):  # early last: waiting for it would promote it too
        engine.wait(t)
    engine.close()
    # the waited prefetch keeps its place among the demand reads (it was queued before `other`)
    assert order == [(layer, 0), (layer, 2), (layer, 3), (layer, 1)]
    assert torch.equal(slots[2], ram.expert(layer, 2))


@pytest.mark.parametrize("promote", [True, False])
def test_a_kept_prefetch_is_read_before_the_layers_demand_misses(tiny_models, tmp_path, promote):
    from moespec.runtime.stats import LayerStats

    folder = tmp_path / "m"
    shutil.copytree(tiny_models["qwen3_moe"], folder)
    om = load_offloaded(folder, RuntimeConfig(host_memory_bytes=8 * 8192, predictor=Predictor.ROUTER), StatsRecorder())
    cache, ledger = om.cache, om.ledger
    ledger.promote_kept = promote
    engine = cache.engine
    first, nxt = om.store.moe_layers[:2]
    gate, order = threading.Event(), []

    def fault(row):
        order.append(row.key)
        gate.wait()

    engine.fault = fault
    try:
        cache.begin_visit(first)
        running = cache.acquire((first, 0))  # layer `first`'s demand read holds the disk (blocked)
        while not cache.ticket(running.slot).started:
            pass
        stats = LayerStats()
        ledger.issue(nxt, [2, 3], stats)  # layer `nxt` predicted to use experts 2 and 3: prefetch reads
        kept = ledger.settle(nxt, {3, 5}, stats)  # it needs 3 (kept) and 5 (a miss); 2 is cancelled
        cache.begin_visit(nxt)
        miss = cache.acquire((nxt, 5))
        gate.set()
        for slot in [running.slot] + kept + [miss.slot]:
            cache.wait(slot)
        engine.synchronize()
        assert stats.prefetch_cancelled == 1 and len(kept) == 1
        # promoted: the kept row goes first, in its queue place; else behind the demand miss
        expect = [(first, 0), (nxt, 3), (nxt, 5)] if promote else [(first, 0), (nxt, 5), (nxt, 3)]
        assert order == expect
    finally:
        gate.set()
        engine.fault = None
        om.close()


def test_a_started_read_cut_drops_its_chunks_not_started_and_the_slot_reads_again(store):
    on_disk, ram = store
    engine = DiskReadEngine(on_disk.path, readers=1, chunk_bytes=4096)  # a 6 KiB row: two chunks
    layer = on_disk.moe_layers[0]
    gate = threading.Event()
    engine.fault = lambda row: gate.wait() if row.key == (layer, 1) else None  # first chunk of row 1 holds
    slots = on_disk.slot_rows(1, torch.device("cpu"))  # [1, P]
    wrong = engine.submit(slots[0], on_disk.expert(layer, 1), 0, prefetch=True)
    while not wrong.started:
        pass
    assert engine.abort(wrong) == 6144 - 4096  # the second chunk's data bytes, never read
    assert engine.abort(wrong) == 0  # nothing left to drop
    right = engine.submit(slots[0], on_disk.expert(layer, 2), 0)  # held back until the first chunk ends
    gate.set()
    engine.wait(right)
    engine.synchronize()
    engine.close()
    assert wrong.done.is_set() and not engine._errors  # the cut row is not checked, nothing failed
    assert engine.reads == 1 and engine.cut_reads == 1 and engine.bytes_moved == 4096 + 6144
    assert torch.equal(slots[0], ram.expert(layer, 2))


@pytest.mark.parametrize("cut", [True, False])
def test_the_ledger_cuts_a_started_wrong_prefetch_when_its_layer_comes(tiny_models, tmp_path, monkeypatch, cut):
    from moespec.runtime import disk_tier
    from moespec.runtime.stats import LayerStats

    folder = tmp_path / "m"
    shutil.copytree(tiny_models["qwen3_moe"], folder)
    # one reader, 4 KiB chunks: the second chunk of a started row is still queued when its layer comes
    monkeypatch.setattr(disk_tier, "make_engine", lambda st: DiskReadEngine(st.path, st.forget, readers=1, chunk_bytes=4096))
    om = load_offloaded(folder, RuntimeConfig(host_memory_bytes=8 * 8192, predictor=Predictor.ROUTER), StatsRecorder())
    cache, ledger, engine = om.cache, om.ledger, om.cache.engine
    ledger.cut_started = cut
    nxt = om.store.moe_layers[1]
    gate = threading.Event()
    engine.fault = lambda row: gate.wait() if row.key == (nxt, 2) else None
    try:
        stats = LayerStats()
        ledger.issue(nxt, [2], stats)  # predicted: expert 2; its read starts and holds
        (slot,) = ledger.held()[nxt]
        while not cache.ticket(slot).started:
            pass
        ledger.settle(nxt, {5}, stats)  # the layer needs 5, not 2
        cache.begin_visit(nxt)
        miss = cache.acquire((nxt, 5))
        gate.set()
        cache.wait(miss.slot)
        cache.release(miss.slot)
        engine.synchronize()
        assert stats.prefetched == 1 and stats.prefetch_wasted == 1 and stats.prefetch_cancelled == 0
        row = 6144
        assert stats.h2d_bytes == (4096 if cut else row)  # the ledger's bytes are the reader's
        assert engine.bytes_moved == stats.h2d_bytes + row
        assert cache.resident((nxt, 2)) is not cut  # a cut row is no row: its slot is empty
        want = cache.row(miss.slot).clone()
    finally:
        gate.set()
        engine.fault = None
        om.close()
    ram = load_offloaded(folder, RuntimeConfig(predictor=Predictor.NONE))
    try:
        assert torch.equal(want, ram.store.expert(nxt, 5))  # the miss read its own row, whole
    finally:
        ram.close()
