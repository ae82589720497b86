"""Files moespec wrote for itself are checked before use: data checksums, NaN/Inf, truncation.

A flipped byte in a cache (the quantised store, a build checkpoint) rebuilds it; in a user's file
(calibration, estimator, estimator states) it is refused with one line naming the file.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from typer.testing import CliRunner

import moespec.models.quant_layout as quant_layout
from moespec.predict.calibration_file import load_calibration, save_calibration
from moespec.artifacts import CALIBRATION_BESIDE_MODEL as BESIDE_MODEL
from moespec.cli.app import app
from moespec.config import Predictor, RuntimeConfig
from moespec.errors import CalibrationError, DataError
from moespec.integrity import json_safe, safetensors_damage
from moespec.runtime.load import load_offloaded
from moespec.runtime.host.quant_store import QuantStoreCache, cache_path
from moespec.runtime.host.source import SafetensorsSource

runner = CliRunner()


@pytest.fixture
def model(tiny_models, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["qwen3_moe"], folder)
    return folder


def _int4(folder):
    om = load_offloaded(folder, RuntimeConfig(cache_experts=4, predictor="none", expert_dtype="int4"))
    om.close()
    return om


def _count_quantising(monkeypatch) -> list[int]:
    calls, real = [], quant_layout.quantize
    monkeypatch.setattr(quant_layout, "quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _flip(path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x10  # one bit of one data byte; the header stays intact
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_the_cached_int4_store_is_detected_and_rebuilt(model, monkeypatch):
    first = _int4(model)
    path = cache_path(model, first.store.layout)
    _flip(path)
    assert safetensors_damage(path) is None  # the header alone cannot tell
    calls = _count_quantising(monkeypatch)
    second = _int4(model)
    assert calls and torch.equal(second.store.buffer, first.store.buffer)  # quantised again, same rows
    calls.clear()
    assert torch.equal(_int4(model).store.buffer, first.store.buffer) and not calls  # the rebuilt file is used


def test_nan_scales_in_the_cached_store_are_rebuilt(model, monkeypatch):
    first = _int4(model)
    saved = QuantStoreCache.for_store(model, SafetensorsSource(model).fingerprint, first.store)
    bad = first.store.buffer.clone()
    bad[0, 0, :2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # the first float16 scale: NaN

    class Store:
        buffer = bad

    assert saved.save(Store) is None  # written with a valid checksum: only the finiteness check can tell
    calls = _count_quantising(monkeypatch)
    second = _int4(model)
    assert calls and torch.equal(second.store.buffer, first.store.buffer)


@pytest.fixture
def calibrated(model):
    """``model`` with its calibration file beside it (72 tokens)."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_calibrate import _calibrate

    save_calibration(model / BESIDE_MODEL, _calibrate(model))
    return model


def test_nan_default_vectors_are_refused_with_one_line(calibrated):
    path = calibrated / BESIDE_MODEL
    calib = load_calibration(path)
    calib.default_vectors[calib.variant][0, 1, 2] = math.nan
    save_calibration(path, calib)
    with pytest.raises(CalibrationError, match="NaN or infinite values in default_vectors"):
        load_calibration(path)
    r = runner.invoke(app, ["chat", str(calibrated), "--predictor", "quasi", "--prompt", "hi", "--max-new-tokens", "2"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    (line,) = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert "NaN" in line and BESIDE_MODEL in line


def test_infinite_recall_is_refused_but_nan_recall_means_none(calibrated):
    path = calibrated / BESIDE_MODEL
    calib = load_calibration(path)
    calib.metrics["recall/router"][0] = math.nan  # the first MoE layer has no predictor: NaN is "none"
    save_calibration(path, calib)
    assert math.isnan(float(load_calibration(path).metric("recall", "router")[0]))
    calib.metrics["recall/router"][0] = math.inf
    save_calibration(path, calib)
    with pytest.raises(CalibrationError, match="recall/router"):
        load_calibration(path)


def test_a_flipped_byte_in_a_calibration_file_is_refused(calibrated):
    path = calibrated / BESIDE_MODEL
    _flip(path)
    with pytest.raises(CalibrationError, match="corrupt: its data does not match the checksum"):
        load_calibration(path)


def test_a_truncated_calibration_file_is_called_truncated_not_another_models(calibrated):
    path = calibrated / BESIDE_MODEL
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CalibrationError, match="is truncated") as err:
        load_calibration(path)
    assert "another model" not in err.value.message
    om = load_offloaded(calibrated, RuntimeConfig(predictor=Predictor.NONE))  # default policy: lru, with why
    om.close()
    (note,) = om.notes
    assert "truncated" in note and "another model" not in note and "cache policy lru" in note


def test_nan_estimator_weights_are_refused(tmp_path):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_estimator import _estimator_file

    from moespec.predict.estimator_file import load_estimator, save_estimator

    ef = _estimator_file()
    with torch.no_grad():
        next(ef.bank.parameters()).view(-1)[0] = math.inf
    path = save_estimator(tmp_path / "est.safetensors", ef)
    with pytest.raises(CalibrationError, match="NaN or infinite values in bank/"):
        load_estimator(path)


def test_a_truncated_states_shard_is_refused_before_the_model_loads(tmp_path, tiny_models):
    from tiny_states import one_shard_states

    from moespec.estimator.states import MANIFEST, load_shard, read_manifest

    folder = tmp_path / "states"
    man = one_shard_states(folder)
    (folder / MANIFEST).write_text(json.dumps(__import__("dataclasses").asdict(man)))
    shard = folder / man.shards["train"][0]
    assert read_manifest(folder) is not None
    good = shard.read_bytes()
    shard.write_bytes(good[:-7])
    with pytest.raises(DataError, match="is truncated"):
        read_manifest(folder)
    r = runner.invoke(app, ["train-estimator", str(tiny_models["qwen3_moe"]), "--reuse-states",
                            "--states-dir", str(folder), "--tokens", "64"])
    assert r.exit_code == 2 and "truncated" in r.output and "Traceback" not in r.output
    data = bytearray(good)
    data[-3] ^= 1
    shard.write_bytes(bytes(data))  # same size, one flipped bit
    with pytest.raises(DataError, match="does not match its checksum"):
        load_shard(shard, [0], keys=("state", "logits"))


def test_a_damaged_build_checkpoint_is_discarded_not_resumed(tmp_path):
    from moespec.default_model.checkpoints import LayerCheckpoints
    from writers import build_checkpoint

    folder = tmp_path / "state"
    folder.mkdir()
    LayerCheckpoints(folder, "digest").open()
    build_checkpoint(folder / "layer-00.safetensors")
    assert LayerCheckpoints(folder, "digest").open() == 1  # layer 0 done: resumes at 1
    _flip(folder / "layer-00.safetensors", 10)
    assert LayerCheckpoints(folder, "digest").open() == 0  # damaged: the build starts over
    assert sorted(p.name for p in folder.iterdir()) == ["state.json"]


def test_json_output_never_holds_nan(tiny_models, monkeypatch):
    import moespec.runtime.stats as stats

    real = stats.summarize
    monkeypatch.setattr(stats, "summarize", lambda steps: __import__("dataclasses").replace(
        real(steps), weighted_recall=math.nan, tpot_ms=math.inf))
    monkeypatch.setattr("moespec.chat.session.summarize", stats.summarize, raising=False)
    r = runner.invoke(app, ["chat", str(tiny_models["qwen3_moe"]), "--prompt", "hi", "--json", "--max-new-tokens", "2"])
    assert r.exit_code == 0, r.output

    def refuse(name):
        raise AssertionError(f"{name} in JSON output")

    obj = json.loads(r.stdout.strip().splitlines()[-1], parse_constant=refuse)
    assert obj["stats"]["weighted_recall"] is None and obj["stats"]["tpot_ms"] is None
    assert json_safe({"a": [1.0, math.nan], "b": (math.inf,)}) == {"a": [1.0, None], "b": [None]}


def test_a_profile_report_never_holds_nan(tmp_path):
    from moespec.profile.report import write_json

    def refuse(name):
        raise AssertionError(f"{name} in the report")

    write_json(tmp_path / "r.json", {"recall": math.nan, "layers": [{"tpot_ms": math.inf, "hits": 3}]}, force=False)
    got = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    assert got.pop("xxh3")  # the seal (moespec.profile.report.load_report checks it)
    assert got == {"recall": None, "layers": [{"tpot_ms": None, "hits": 3}]}
