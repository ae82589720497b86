"""The quasi-hidden-state predictor and how the runtime finds its calibration file."""

from __future__ import annotations

import pytest
import torch
from tiny import reference_model

from moespec.calibrate.data import ChunkPlan
from moespec.artifacts import CALIBRATION_BESIDE_MODEL as BESIDE_MODEL
from moespec.artifacts import default_calibration_path, model_key
from moespec.predict.calibration_file import save_calibration
from moespec.calibrate.run import CalibrateConfig, calibrate
from moespec.config import ExecuteMode, Predictor, RuntimeConfig, SamplingConfig
from moespec.errors import CalibrationError
from moespec.models.base import Routing
from moespec.predict.quasi import QuasiPredictor, quasi_delta
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder, summarize


def _write_calibration(folder, path=None):
    g = torch.Generator().manual_seed(3)
    plan = ChunkPlan(calib=[torch.randint(0, 256, (24,), generator=g).tolist() for _ in range(3)],
                     heldout=[torch.randint(0, 256, (24,), generator=g).tolist()])
    om = load_offloaded(folder, RuntimeConfig(predictor=Predictor.NONE))
    try:
        calib = calibrate(om, plan, CalibrateConfig(tokens=72, seq_len=24), "random ids", "random ids").calibration
    finally:
        om.close()
    return save_calibration(path or default_calibration_path(folder), calib), calib


def test_quasi_delta_is_the_gate_weighted_sum_of_default_vectors():
    vectors = torch.randn(5, 3)  # [E, H]
    used = Routing(ids=torch.tensor([[0, 4], [2, 1]]), weights=torch.tensor([[0.7, 0.3], [0.5, 0.5]]))
    want = torch.stack([0.7 * vectors[0] + 0.3 * vectors[4], 0.5 * vectors[2] + 0.5 * vectors[1]])
    torch.testing.assert_close(quasi_delta(vectors, used), want)


def test_zero_default_vectors_predict_as_the_router_predictor(tiny_models):
    from moespec.predict.base import RouterPredictor

    om = load_offloaded(tiny_models["qwen3_moe"], RuntimeConfig(predictor=Predictor.NONE))
    try:
        refs = om.layer_refs()
        zero = QuasiPredictor(om.adapter, refs, {r.layer: torch.zeros(8, 32) for r in refs})
        router = RouterPredictor(om.adapter, refs)
        r = torch.randn(4, 32)
        used = Routing(ids=torch.tensor([[0, 1]] * 4), weights=torch.full((4, 2), 0.5))
        with torch.no_grad():
            a, b = zero.predict(refs[0].layer, r, used), router.predict(refs[0].layer, r, used)
        assert torch.equal(a.ids, b.ids)
        assert zero.predict(refs[-1].layer, r, used) is None  # the last MoE layer predicts nothing
    finally:
        om.close()


def test_missing_calibration_names_the_calibrate_command(tiny_models):
    with pytest.raises(CalibrationError, match="moespec calibrate") as exc:
        load_offloaded(tiny_models["mixtral"], RuntimeConfig(predictor=Predictor.QUASI))
    assert "moespec calibrate" in exc.value.hint
    with pytest.raises(CalibrationError, match="does not exist"):
        load_offloaded(tiny_models["mixtral"], RuntimeConfig(predictor=Predictor.QUASI, calibration_path="/nonexistent.st"))


@pytest.mark.parametrize("kind", [Predictor.ESTIMATOR, Predictor.HYBRID])
def test_estimator_predictors_name_train_estimator(tiny_models, kind):
    with pytest.raises(CalibrationError, match="train-estimator") as exc:
        load_offloaded(tiny_models["qwen3_moe"], RuntimeConfig(predictor=kind))
    assert f"`moespec train-estimator {tiny_models['qwen3_moe']}`" in exc.value.hint  # a command that runs as written


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_chat_with_quasi_finds_the_file_and_stays_exact(tiny_models, family):
    folder = tiny_models[family]
    _write_calibration(folder)
    om = load_offloaded(folder, RuntimeConfig(predictor=Predictor.QUASI, execute=ExecuteMode.EXACT, cache_experts=5),
                        StatsRecorder())
    try:
        assert isinstance(om.policy.predictor, QuasiPredictor)
        prompt = list(range(40, 52))
        got = list(Engine(om).generate(prompt, SamplingConfig(max_new_tokens=6)))
        summary = summarize(om.recorder.steps)
    finally:
        om.close()
    ref = reference_model(folder)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False).tolist()[0][len(prompt):]
    assert got == want  # exact mode: the predictor only decides what is prefetched
    assert summary.recall is not None and 0.0 <= summary.recall <= 1.0


def test_a_file_beside_the_model_is_found(tiny_models, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_models["olmoe"], folder)
    _write_calibration(folder, folder / BESIDE_MODEL)
    om = load_offloaded(folder, RuntimeConfig(predictor=Predictor.QUASI))
    om.close()
    assert isinstance(om.policy.predictor, QuasiPredictor)


def test_model_key_of_a_hub_snapshot_is_its_repo_id(tmp_path):
    snap = tmp_path / "hub" / "models--Qwen--Qwen3-30B-A3B" / "snapshots" / "abc123"
    assert model_key(snap) == "Qwen/Qwen3-30B-A3B"
    assert model_key(tmp_path / "plain") == str(tmp_path / "plain")


@pytest.mark.parametrize("execute", [ExecuteMode.SPECULATIVE, ExecuteMode.GUARDED])
def test_quasi_runs_in_approximate_modes(tiny_models, execute):
    folder = tiny_models["qwen2_moe"]
    _write_calibration(folder)
    om = load_offloaded(folder, RuntimeConfig(predictor=Predictor.QUASI, execute=execute, cache_experts=6), StatsRecorder())
    try:
        got = list(Engine(om).generate(list(range(60, 70)), SamplingConfig(max_new_tokens=5)))
        summary = summarize(om.recorder.steps)
    finally:
        om.close()
    assert len(got) == 5 and summary.recall is not None


def test_profile_measures_quasi_with_quasi_not_router(tiny_models, tmp_path):
    """Issue 16: router and quasi reported the same recall on the default model. There |d_l| is ~1 %
    of |r_l|, so LN(r + d) rarely changes the top-K (genuine); here the default vectors are made
    large, so a profile whose quasi arm fell back to router, or took its recall from the router arm,
    would report equal recall."""
    import json

    from typer.testing import CliRunner

    from moespec.predict.calibration_file import load_calibration
    from moespec.cli.app import app

    folder = tiny_models["qwen2_moe"]
    path, _ = _write_calibration(folder, tmp_path / "c.safetensors")
    calib = load_calibration(path)
    g = torch.Generator().manual_seed(0)
    for name, v in calib.default_vectors.items():  # d_{l,e} far larger than r_l: quasi predicts otherwise
        calib.default_vectors[name] = 50 * torch.randn(v.shape, generator=g)
    big = save_calibration(tmp_path / "big.safetensors", calib)
    res = CliRunner().invoke(app, ["profile", str(folder), "--device", "cpu", "--threads", "1", "--cache-experts", "8",
                                   "--strategies", "router,quasi", "--calibration", str(big), "--prompt-len", "8",
                                   "--gen", "6", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    by = {r["strategy"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert by["router"]["recall"] != by["quasi"]["recall"]
