"""The disk tier: experts stay in moespec's store file and are read with O_DIRECT into a bounded RAM tier.

Exact mode through the disk tier equals transformers; the file is written once and then only read;
a truncated or changed file is rebuilt or refused, never wrong weights; a read error stops one
request and the next works; --host-memory below the minimum and a full disk are one-line errors.
"""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch
from tiny import GREEDY_PROMPT, reference_greedy, reference_model

from moespec.config import Predictor, RuntimeConfig, SamplingConfig
from moespec.errors import BudgetError, CheckpointError, OutputError
from moespec.runtime.engine import Engine
from moespec.runtime.host.disk_store import ALIGN, DiskStore, store_path
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder

ROW = 3 * 32 * 16 * 4  # one float32 expert of the tiny models (H=32, I=16): 6 KiB, stride 8 KiB
MIN_ROUTER = 4 * 2 * ALIGN  # 2K rows of 8 KiB with a predictor


@pytest.fixture
def model(tiny_models, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["qwen3_moe"], folder)
    return folder


def _load(folder, host_memory=MIN_ROUTER, predictor=Predictor.ROUTER, **kw):
    return load_offloaded(folder, RuntimeConfig(host_memory_bytes=host_memory, predictor=predictor, **kw),
                          StatsRecorder())


def _next_answer_is_exact(gen: Engine, model) -> None:
    """After a failed request: the next one, from a fresh KV cache, equals transformers."""
    gen.reset()
    assert list(gen.generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=6))) == reference_greedy(model, GREEDY_PROMPT, 6)


@pytest.mark.parametrize("predictor", [Predictor.NONE, Predictor.ROUTER])
def test_exact_mode_through_the_disk_tier_equals_transformers(model, predictor):
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference_model(model)(ids).logits
    om = _load(model, predictor=predictor)
    try:
        assert isinstance(om.store, DiskStore) and om.cache.engine.direct  # O_DIRECT on this filesystem
        assert om.cache.num_slots == 4 and om.store.stride == 2 * ALIGN
        with torch.inference_mode():
            got = om.model(ids).logits
        engine = om.cache.engine
        assert engine.bytes_moved == engine.reads * ROW > 0  # every row came from the file
        tokens = list(Engine(om).generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=6)))
    finally:
        om.close()
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    assert tokens == reference_greedy(model, GREEDY_PROMPT, 6)


def test_the_file_is_written_once_with_aligned_rows_then_only_read(model, monkeypatch):
    om = _load(model)
    store = om.store
    om.close()
    assert store.data_offset % ALIGN == 0 and store.path.stat().st_size == store.file_bytes
    assert store.file_bytes == store.data_offset + 3 * 8 * 2 * ALIGN
    ram = load_offloaded(model, RuntimeConfig(predictor=Predictor.NONE))  # every expert in RAM: the reference
    try:
        for layer in store.moe_layers:
            for e in range(8):
                raw = store.path.read_bytes()[store.expert(layer, e).offset:][:ROW]  # a plain buffered read
                assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32), ram.store.expert(layer, e))
    finally:
        ram.close()

    def no_write(*a, **k):
        raise AssertionError("store file written again although it is valid")

    monkeypatch.setattr(DiskStore, "write", no_write)
    _load(model).close()


def test_a_truncated_or_stale_file_is_rebuilt(model):
    om = _load(model)
    path = om.store.path
    om.close()
    path.write_bytes(path.read_bytes()[: om.store.file_bytes - 100])  # truncated
    om = _load(model)
    assert path.stat().st_size == om.store.file_bytes
    om.close()
    (model / "config.json").touch()  # the checkpoint's fingerprint changed (mtime): a new file
    before = path.stat().st_mtime_ns
    _load(model).close()
    assert path.stat().st_mtime_ns != before


def test_a_row_changed_under_the_running_model_fails_the_request_never_wrong_weights(model):
    om = _load(model, predictor=Predictor.NONE)
    try:
        path, off = om.store.path, om.store.expert(om.store.moe_layers[0], 0).offset
        with open(path, "r+b") as fh:  # every row of the first layer changes on disk
            for e in range(8):
                fh.seek(om.store.expert(om.store.moe_layers[0], e).offset)
                fh.write(b"\x7f" * 64)
        assert off
        with pytest.raises(CheckpointError, match="changed under the running model") as exc:
            list(Engine(om).generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=2)))
        assert exc.value.message.count(str(path)) == 1  # named once
        assert not path.exists()  # removed: the next start rebuilds it
    finally:
        om.close()
    om = _load(model, predictor=Predictor.NONE)
    try:
        tokens = list(Engine(om).generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=4)))
    finally:
        om.close()
    assert tokens == reference_greedy(model, GREEDY_PROMPT, 4)


def test_a_read_error_mid_generation_stops_that_answer_and_the_next_works(model):
    om = _load(model)
    try:
        engine, calls = om.cache.engine, []

        def fault(row):
            calls.append(row.key)
            if len(calls) == 10:
                raise OSError(errno.EIO, os.strerror(errno.EIO))

        engine.fault = fault
        gen = Engine(om)
        with pytest.raises(CheckpointError, match="Input/output error"):
            list(gen.generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=8)))
        engine.fault = None
        _next_answer_is_exact(gen, model)
    finally:
        om.close()


def test_host_memory_below_the_minimum_names_it_in_mib(model):
    with pytest.raises(BudgetError) as exc:
        _load(model, host_memory=MIN_ROUTER - 1)
    assert "minimum of 1 MiB (4 expert rows of 8KiB)" in exc.value.message.replace(" KiB", "KiB")
    assert "--host-memory" in exc.value.message and "--host-memory 1MiB" in exc.value.hint


def test_a_full_disk_while_writing_is_one_line_and_leaves_no_file(model, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OutputError, match="disk full"):
        _load(model)
    path = store_path(model, "expertlayout-float32")
    assert not path.exists()
    assert not path.parent.exists() or not list(path.parent.iterdir())  # no temp folder left either


def test_the_reader_runs_demand_before_queued_prefetch_and_cancels_unstarted_reads(model):
    import threading

    from moespec.runtime.transfer.disk import DiskReadEngine

    om = _load(model, predictor=Predictor.NONE)
    store = om.store
    om.close()
    engine = DiskReadEngine(store.path, readers=1)
    gate, order = threading.Event(), []

    def fault(row):
        order.append(row.key)
        gate.wait()

    engine.fault = fault
    slots = store.slot_rows(4, torch.device("cpu"))  # [4, P]
    layer = store.moe_layers[0]
    first = engine.submit(slots[0], store.expert(layer, 0), 0, prefetch=True)
    while not first.started:
        pass
    a = engine.submit(slots[1], store.expert(layer, 1), 1, prefetch=True)
    b = engine.submit(slots[2], store.expert(layer, 2), 2, prefetch=True)
    demand = engine.submit(slots[3], store.expert(layer, 3), 3)
    assert engine.cancel(b) and not engine.cancel(first)
    gate.set()
    for t in (first, a, demand):
        engine.wait(t)
    engine.close()
    assert order == [(layer, 0), (layer, 3), (layer, 1)]  # the demand read overtook the queued prefetch
    assert engine.bytes_moved == 3 * ROW and engine.reads == 3
    ram = load_offloaded(model, RuntimeConfig(predictor=Predictor.NONE))
    try:
        for s, e in ((0, 0), (1, 1), (3, 3)):
            assert torch.equal(slots[s], ram.store.expert(layer, e))
    finally:
        ram.close()


def test_two_reads_into_one_slot_never_race_the_newest_row_wins(model):
    import threading

    from moespec.runtime.transfer.disk import DiskReadEngine

    om = _load(model, predictor=Predictor.NONE)
    store = om.store
    om.close()
    engine = DiskReadEngine(store.path, readers=4)
    gate = threading.Event()
    layer = store.moe_layers[0]
    engine.fault = lambda row: gate.wait() if row.key == (layer, 0) else None  # the first read is slow
    slots = store.slot_rows(1, torch.device("cpu"))  # [1, P]
    old = engine.submit(slots[0], store.expert(layer, 0), 0, prefetch=True)
    while not old.started:
        pass
    new = engine.submit(slots[0], store.expert(layer, 5), 0)  # the cache re-used the slot meanwhile
    assert not new.done.wait(0.05)  # held back behind the running read, not racing it
    gate.set()
    engine.wait(new)
    engine.close()
    assert engine.reads == 2 and not engine._errors  # no read saw the other's bytes (checksums hold)
    expect = torch.frombuffer(bytearray(store.path.read_bytes()[store.expert(layer, 5).offset:][:ROW]),
                              dtype=torch.float32)
    assert torch.equal(slots[0], expect) and store.path.exists()


def test_accounting_every_disk_byte_is_in_the_steps_and_the_views(model):
    from moespec.runtime.disk_tier import disk_numbers
    from moespec.runtime.stats import summarize
    from moespec.serve.metrics import ServerMetrics

    om = _load(model)
    try:
        list(Engine(om).generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=6)))
        steps, engine = om.recorder.steps, om.cache.engine
        summary = summarize(steps)
        disk = disk_numbers(summary, om.cache)
        metrics = ServerMetrics()
        metrics.observe_cache(om.cache)
        text = metrics.render().decode()
    finally:
        om.close()
    assert sum(s.total().h2d_bytes for s in steps) == engine.bytes_moved == engine.reads * ROW
    assert sum(s.total().prefetched for s in steps) > 0  # the router predictor drove reads ahead of use
    assert disk["disk_reads"] == engine.reads and disk["o_direct"] and disk["disk_read_gbps"] > 0
    assert disk["disk_mb_per_token"] == summary.h2d_mb_per_token and disk["ram_tier_rows"] == 4
    assert f"moespec_disk_read_bytes {float(engine.bytes_moved)}" in text


def test_the_mmap_baseline_reads_the_same_rows_through_the_page_cache(model):
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference_model(model)(ids).logits
    _load(model).close()  # the store file exists
    om = _load(model, predictor=Predictor.NONE, disk_reads="mmap")
    try:
        assert not isinstance(om.store, DiskStore) and om.cache.num_slots == 4
        with torch.inference_mode():
            got = om.model(ids).logits
    finally:
        om.close()
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_ctrl_c_mid_forward_leaves_the_ram_tier_consistent(model):
    om = _load(model)
    try:
        calls = []

        def interrupt(module, args):
            calls.append(1)
            if len(calls) == 5:  # the second token's second MoE layer: reads in flight and queued
                raise KeyboardInterrupt

        layer = om.model.model.layers[om.store.moe_layers[1]]
        hook = layer.mlp.register_forward_pre_hook(interrupt)
        gen = Engine(om)
        with pytest.raises(KeyboardInterrupt):
            list(gen.generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=8)))
        hook.remove()
        engine = om.cache.engine
        assert engine._pending == 0 and not any(om.cache.pinned(s) for s in range(om.cache.num_slots))
        _next_answer_is_exact(gen, model)
    finally:
        om.close()


def test_serve_and_chat_answer_the_same_from_disk(model):
    import json

    import httpx2 as httpx
    from serve_harness import serve
    from typer.testing import CliRunner

    from moespec.cli.app import app as cli
    from moespec.serve.app import ServeSettings

    r = CliRunner().invoke(cli, ["chat", str(model), "--prompt", "hello", "--json", "--max-new-tokens", "6",
                                 "--device", "cpu", "--host-memory", "32KiB"])
    assert r.exit_code == 0, r.output
    chat = json.loads(r.stdout.strip().splitlines()[-1])
    assert chat["stats"]["disk"]["ram_tier_rows"] == 4 and chat["stats"]["disk"]["disk_reads"] > 0
    with serve(model, ServeSettings(max_queue=2), RuntimeConfig(device="cpu", host_memory_bytes=MIN_ROUTER)) as s:
        body = {"model": s.app.state.backend.name, "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": "hello"}]}
        got = httpx.post(s.v1 + "/chat/completions", json=body, timeout=120).json()
        metrics = httpx.get(s.url + "/metrics", timeout=30).text
    assert got["choices"][0]["message"]["content"] == chat["text"]
    line = next(ln for ln in metrics.splitlines() if ln.startswith("moespec_disk_read_bytes "))
    assert float(line.split()[1]) > 0


def test_rows_start_where_open_looks_for_them_whatever_the_header_length(tmp_path):
    from moespec.models.base import ExpertLayout

    layout = ExpertLayout(hidden=32, intermediate=16)
    for experts in (1, 3, 113, 114, 400):  # header lengths around 4 KiB boundaries
        header = DiskStore.header_for({"m": experts}, [0], experts, layout, torch.float32)

        def fill(store):
            store.buffer.copy_(torch.arange(store.buffer.numel(), dtype=torch.float32).view_as(store.buffer))

        store = DiskStore.write(tmp_path / f"s{experts}.moerows", header, layout, torch.float32, fill).bind(
            layout, torch.float32)
        last = store.expert(0, experts - 1)
        raw = store.path.read_bytes()[last.offset:][:ROW]
        assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32),
                           torch.arange((experts - 1) * ROW // 4, experts * ROW // 4, dtype=torch.float32))


def test_disk_reads_is_direct_or_mmap():
    from moespec.errors import OptionError

    with pytest.raises(OptionError, match="disk_reads 'mapped'"):
        RuntimeConfig(disk_reads="mapped")


def test_a_read_error_while_serving_is_a_server_error_and_the_next_request_works(model):
    """A disk fault is the server's, not the request's: 500 server_error (was 400), then served again."""
    import httpx2 as httpx
    from serve_harness import serve

    from moespec.serve.app import ServeSettings

    with serve(model, ServeSettings(max_queue=2), RuntimeConfig(device="cpu", host_memory_bytes=MIN_ROUTER)) as s:
        body = {"model": s.app.state.backend.name, "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": "hello"}]}
        want = httpx.post(s.v1 + "/chat/completions", json=body, timeout=120).json()
        reader = s.app.state.backend.engine.om.cache.engine

        def fault(row):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        reader.fault = fault
        try:
            r = httpx.post(s.v1 + "/chat/completions", json=body, timeout=120)
        finally:
            reader.fault = None
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and "Input/output error" in err["message"]
        assert "\n" not in err["message"] and err["message"].count(str(s.app.state.backend.engine.om.store.path)) == 1
        again = httpx.post(s.v1 + "/chat/completions", json=body, timeout=120).json()
    assert again["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]


def test_host_computed_misses_are_refused_on_disk_by_every_command_and_switch(model):
    """A host-computed miss needs its row in RAM: chat refused it at load, but `profile`'s
    --on-miss arms switched the policy after loading and crashed in the host pool (a traceback)."""
    from dataclasses import replace

    from typer.testing import CliRunner

    from moespec.cli.app import app
    from moespec.config import OnMiss
    from moespec.errors import OptionError

    om = _load(model)
    try:
        with pytest.raises(OptionError, match="--on-miss host cannot run with the experts on disk"):
            om.use_policy(replace(om.policy, on_miss=OnMiss.HOST))
        assert om.planner is None  # refused before the host pool started
    finally:
        om.close()
    res = CliRunner().invoke(app, ["profile", str(model), "--device", "cpu", "--host-memory", "64KiB",
                                   "--on-miss", "host", "--strategies", "none", "--gen", "2", "--prompt-len", "8"],
                             env={"COLUMNS": "80"})
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "--on-miss host cannot run with the experts on disk" in res.output and "--on-miss fetch" in res.output
