"""The disk tier's store file truncated or replaced under a running model (issue 27's faults bullet).

Truncated in place: the reads past the new end are short, so the request fails with one line naming
the file and the row, and the next start rebuilds the file (its size no longer matches its header).
Replaced (a new file renamed over it): the running reader keeps reading the file it opened (its
descriptor holds the old inode), so its answers stay exact; the next start sees the new file and
rebuilds it when its header does not match. Never wrong weights.
"""

from __future__ import annotations

import os
import shutil

import pytest
from tiny import GREEDY_PROMPT, reference_greedy

from moespec.config import Predictor, RuntimeConfig, SamplingConfig
from moespec.errors import CheckpointError
from moespec.runtime.engine import Engine
from moespec.runtime.host.disk_store import ALIGN
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder

MIN_NONE = 4 * 2 * ALIGN  # K rows of 8 KiB (tiny qwen3_moe, float32)


@pytest.fixture
def model(tiny_models, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["qwen3_moe"], folder)
    return folder


def _load(folder):
    return load_offloaded(folder, RuntimeConfig(host_memory_bytes=MIN_NONE, predictor=Predictor.NONE), StatsRecorder())


def _greedy(om, n):
    gen = Engine(om)
    gen.reset()
    return list(gen.generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=n)))


def test_a_store_file_truncated_under_the_running_model_fails_the_request_and_the_next_start_rebuilds(model):
    om = _load(model)
    try:
        store = om.store
        path, size = store.path, store.file_bytes
        first = store.expert(store.moe_layers[0], 0).offset
        os.truncate(path, first + ALIGN // 2)  # every row but half of the first one is gone
        with pytest.raises(CheckpointError) as exc:
            _greedy(om, 3)
        assert "is truncated" in exc.value.message and "\n" not in exc.value.message
        assert exc.value.message.count(str(path)) == 1  # named once
    finally:
        om.close()
    om = _load(model)
    try:
        assert om.store.path.stat().st_size == size  # rebuilt whole
        assert _greedy(om, 4) == reference_greedy(model, GREEDY_PROMPT, 4)
    finally:
        om.close()


def test_a_store_file_replaced_under_the_running_model_keeps_its_answers_exact(model):
    om = _load(model)
    try:
        path, size = om.store.path, om.store.file_bytes
        stranger = path.with_name("stranger.tmp")
        stranger.write_bytes(os.urandom(size))  # same size, garbage header and rows
        os.replace(stranger, path)
        assert _greedy(om, 4) == reference_greedy(model, GREEDY_PROMPT, 4)  # the opened file's rows
    finally:
        om.close()
    om = _load(model)  # the garbage file is not a store: rebuilt from the checkpoint
    try:
        with open(om.store.path, "rb") as fh:
            assert fh.read(8) == b"MOESPEC-"
        assert _greedy(om, 4) == reference_greedy(model, GREEDY_PROMPT, 4)
    finally:
        om.close()
