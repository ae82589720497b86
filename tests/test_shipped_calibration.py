"""The calibration shipped for the default model (artifacts.shipped_calibration): offered to builds of
its recipe only, last among the candidates (`moespec calibrate` overrides it), checked like any other
calibration file, and it makes lfru the policy a fresh home runs."""

from __future__ import annotations

import json

import pytest
import torch

from moespec import artifacts
from moespec.artifacts import SHIPPED_CALIBRATION, calibration_candidates, find_calibration, shipped_calibration
from moespec.default_model import build
from moespec.default_model.recipe import recipe_digest
from moespec.errors import CalibrationError
from moespec.predict.calibration_file import load_calibration, load_checked

RECORD = "the recipe changed: run scripts/record_default_calibration.py to record the shipped calibration again"


def _fake_build(folder, digest):
    folder.mkdir(parents=True)
    (folder / build.MARKER_FILE).write_text(json.dumps({"recipe_digest": digest, "file_bytes": {}}))
    return folder


def test_the_shipped_file_is_this_recipes_and_small():
    assert artifacts.BUILD_MARKER_FILE == build.MARKER_FILE
    calib = load_calibration(SHIPPED_CALIBRATION)
    assert calib.meta["recipe_digest"] == recipe_digest(), RECORD
    assert calib.meta["model"] == build.DEFAULT_MODEL_NAME and calib.meta["top_k"] == 4
    assert list(calib.default_vectors) == [calib.variant]  # one variant: the one the runtime reads
    assert calib.vectors.shape == (30, 16, 576) and calib.frequencies.shape == (30, 16)
    assert int(calib.frequencies.sum()) == 30 * 4 * calib.meta["tokens"]  # every token's top-4, every layer
    assert SHIPPED_CALIBRATION.stat().st_size < 1_300_000


def test_offered_to_a_build_of_its_recipe_only_and_last(tmp_path):
    ours = _fake_build(tmp_path / "ours", recipe_digest())
    assert shipped_calibration(ours) == SHIPPED_CALIBRATION
    assert calibration_candidates(ours)[-1] == SHIPPED_CALIBRATION
    assert find_calibration(ours) == SHIPPED_CALIBRATION
    assert shipped_calibration(_fake_build(tmp_path / "other", "0" * 64)) is None
    assert shipped_calibration(tmp_path) is None  # no build marker: not the default model
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / build.MARKER_FILE).write_text("{not json")
    assert shipped_calibration(tmp_path / "broken") is None


def test_moespec_calibrate_overrides_it(tmp_path):
    ours = _fake_build(tmp_path / "ours", recipe_digest())
    mine = calibration_candidates(ours)[0]  # where `moespec calibrate` writes
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_bytes(SHIPPED_CALIBRATION.read_bytes())
    assert find_calibration(ours) == mine
    beside = ours / artifacts.CALIBRATION_BESIDE_MODEL
    mine.unlink()
    beside.write_bytes(b"x")
    assert find_calibration(ours) == beside


@pytest.mark.slow
def test_it_matches_the_built_model_and_a_fresh_home_runs_lfru(default_model):
    from moespec.config import CachePolicy, RuntimeConfig
    from moespec.runtime.load import load_offloaded

    assert not artifacts.default_calibration_path(default_model).exists()  # the tests' home is fresh
    assert find_calibration(default_model) == SHIPPED_CALIBRATION
    om = load_offloaded(default_model, RuntimeConfig(device="cpu", cache_experts=60))
    try:
        assert om.cache.policy == CachePolicy.LFRU
        refs = om.layer_refs()
        routers = [r.block.gate.weight for r in refs]
        load_checked(SHIPPED_CALIBRATION, om.config, [r.layer for r in refs], routers, default_model)
        other = [w.clone() for w in routers]
        other[3] = other[3] + torch.randn_like(other[3])
        with pytest.raises(CalibrationError, match="router weights differ"):
            load_checked(SHIPPED_CALIBRATION, om.config, [r.layer for r in refs], other, default_model)
    finally:
        om.close()
