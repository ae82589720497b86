"""The cached quantised store and bad --expert-dtype / --group-size input.

First start quantises and writes the cache; the second start reads it and never quantises; a
changed checkpoint, other settings or a corrupt file rebuild it (never stale weights).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import moespec.models.quant_layout as quant_layout
from moespec.cli.app import app
from moespec.config import RuntimeConfig
from moespec.errors import OptionError
from moespec.runtime.load import load_offloaded
from moespec.runtime.host.quant_store import cache_path


def _load(folder, **kw):
    om = load_offloaded(folder, RuntimeConfig(cache_experts=4, predictor="none", expert_dtype="int4", **kw))
    om.close()
    return om


def _no_quantising(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("quantised although a valid cached store exists")

    monkeypatch.setattr(quant_layout, "quantize", fail)


@pytest.fixture
def model(tiny_models, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["qwen3_moe"], folder)
    return folder


def test_second_start_reads_the_cached_store_without_quantising(model, monkeypatch):
    first = _load(model)
    path = cache_path(model, first.store.layout)
    assert path.is_file() and path.name == "int4-g64.safetensors"
    _no_quantising(monkeypatch)
    second = _load(model)
    assert torch.equal(first.store.buffer, second.store.buffer)


def test_changed_checkpoint_rebuilds_the_store(model, monkeypatch):
    first = _load(model)
    weights = load_file(model / "model.safetensors")
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    weights[name] = weights[name] * 3  # same shapes and names, other values
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    second = _load(model)
    assert not torch.equal(first.store.buffer[0, 0], second.store.buffer[0, 0])
    assert torch.equal(first.store.buffer[0, 1:], second.store.buffer[0, 1:])
    _no_quantising(monkeypatch)  # and the rebuilt file is the one used next
    assert torch.equal(_load(model).store.buffer, second.store.buffer)


def test_other_group_size_has_its_own_file_and_corrupt_files_rebuild(model):
    a = _load(model)
    b = _load(model, group_size=32)
    # rows of at most 32 columns (H = 32, I = 16): one group per row either way, so the same bytes
    assert b.store.expert_bytes == a.store.expert_bytes
    assert cache_path(model, a.store.layout).is_file()
    path = cache_path(model, b.store.layout)
    assert path.name == "int4-g32.safetensors"
    path.write_bytes(path.read_bytes()[:100])  # truncated
    c = _load(model, group_size=32)
    assert torch.equal(b.store.buffer, c.store.buffer)
    assert path.stat().st_size > 100


def test_group_size_must_be_one_the_kernels_take(model):
    with pytest.raises(OptionError, match="--group-size 24 is not supported: the low-bit kernels take 32, 64, "
                                          "128 or 256") as info:
        _load(model, group_size=24)
    assert info.value.hint == "use --group-size 64"


def test_group_size_without_int_dtype_is_refused(model):
    with pytest.raises(OptionError, match="--group-size 32 applies to --expert-dtype int8/int4"):
        load_offloaded(model, RuntimeConfig(cache_experts=4, group_size=32))


def test_unknown_expert_dtype_lists_the_choices(model):
    with pytest.raises(OptionError, match="--expert-dtype 'int3' is not valid") as info:
        load_offloaded(model, RuntimeConfig(cache_experts=4, expert_dtype="int3"))
    assert "int8, int4" in info.value.hint


@pytest.mark.parametrize("family", ["gpt_oss", "gpt_oss_mxfp4"])
def test_gpt_oss_refuses_int4(adapter_models, family):
    with pytest.raises(OptionError, match="--expert-dtype int4 is not supported for gpt_oss") as info:
        load_offloaded(adapter_models[family], RuntimeConfig(cache_experts=4, expert_dtype="int4"))
    assert "--expert-dtype auto" in info.value.hint


def test_cli_prints_one_line_error_for_a_bad_group_size(model):
    r = CliRunner().invoke(app, ["chat", str(model), "-p", "hi", "--max-new-tokens", "2", "--device", "cpu",
                                 "--expert-dtype", "int4", "--group-size", "24"])
    assert r.exit_code == 2
    assert "error: --group-size 24 is not supported: the low-bit kernels take 32, 64, 128 or 256" in r.output
    assert "Traceback" not in r.output


def test_cli_chat_runs_with_int8_experts(model):
    r = CliRunner().invoke(app, ["chat", str(model), "-p", "hi", "--max-new-tokens", "3", "--device", "cpu",
                                 "--expert-dtype", "int8", "--group-size", "32", "--json"])
    assert r.exit_code == 0, r.output
    assert cache_path(model, quant_layout.QuantLayout(hidden=32, intermediate=16, bits=8, group_size=32)).is_file()


def test_an_older_row_format_is_rebuilt_never_misread(model):
    """A file written by the format before groups along rows (2) has the same size and name: it is
    quantised again and rewritten, never loaded as the new layout."""
    import json

    from safetensors import safe_open

    import moespec.runtime.host.quant_store as qsc

    first = _load(model)
    path = cache_path(model, first.store.layout)
    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads(fh.metadata()[qsc.META_KEY])
    assert meta["format"] == qsc.FORMAT == 3
    garbage = torch.full_like(first.store.buffer, 7)  # what an old layout's bytes would be read as
    save_file({qsc.TENSOR: garbage}, path, metadata={qsc.META_KEY: json.dumps({**meta, "format": 2})})
    second = _load(model)
    assert torch.equal(second.store.buffer, first.store.buffer)
    with safe_open(str(path), framework="pt") as fh:
        assert json.loads(fh.metadata()[qsc.META_KEY])["format"] == 3


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e9])
def test_weights_that_cannot_be_quantised_are_refused_in_one_line_every_start(model, bad, monkeypatch):
    """A NaN/Inf expert weight (or one beyond float16's range) gives non-finite scales, which the
    store's check refuses: instead of quantising again on every start, silently, each start says so
    in one line naming the tensor and the file; nothing is cached."""
    from moespec.errors import CheckpointError

    monkeypatch.setenv("MOESPEC_HOME", str(model.parent / "home"))
    weights = load_file(model / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    weights[name][2, 5] = bad
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    layout = quant_layout.QuantLayout(hidden=32, intermediate=16, bits=4, group_size=64)
    for _ in range(2):
        with pytest.raises(CheckpointError) as info:
            _load(model)
        assert name in info.value.message and "model.safetensors" in info.value.message
        assert "layer 1, expert 3" in info.value.message and "--expert-dtype auto" in info.value.hint
        assert ("overflow" if bad == 1e9 else "1 of its 512 values are NaN or Inf") in info.value.message
        assert not cache_path(model, layout).exists()
    r = CliRunner().invoke(app, ["chat", str(model), "-p", "hi", "--max-new-tokens", "2", "--device", "cpu",
                                 "--expert-dtype", "int4"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.output.startswith(f"error: tensor {name} (layer 1, expert 3) cannot be quantised")
