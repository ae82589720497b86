"""calibrate and profile run on every new family; bad checkpoints and options name what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moespec.calibrate.data import ChunkPlan
from moespec.calibrate.run import CalibrateConfig, calibrate
from moespec.cli.app import app
from moespec.config import Predictor, RuntimeConfig
from moespec.errors import CheckpointError, OptionError
from moespec.runtime.load import load_offloaded

FAMILIES = ["gpt_oss", "gpt_oss_mxfp4", "deepseek_v2", "deepseek_v3", "glm4_moe_lite"]


def _chunks(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (16,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_calibrate_runs(adapter_models, family):
    om = load_offloaded(adapter_models[family], RuntimeConfig(predictor=Predictor.NONE, cache_experts=6))
    try:
        calib = calibrate(om, ChunkPlan(calib=_chunks(2, 1), heldout=_chunks(1, 2)),
                          CalibrateConfig(tokens=32, seq_len=16), "random ids", "random ids").calibration
    finally:
        om.close()
    assert calib.layers == om.store.moe_layers  # DeepSeek/GLM layer 0 is dense: not calibrated
    assert all(torch.isfinite(v).all() for v in calib.default_vectors.values())
    # Every calibration token is routed to K experts in every MoE layer.
    k = om.adapter.top_k()
    assert (calib.frequencies.sum(dim=1) == k * 32).all(), calib.frequencies.sum(dim=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_profile_runs(adapter_models, family, tmp_path):
    res = CliRunner().invoke(app, ["profile", str(adapter_models[family]), "--device", "cpu", "--threads", "1",
                                   "--cache-experts", "4", "--strategies", "none,router", "--prompt-len", "6",
                                   "--gen", "3", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path / "r.json")],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["strategy"] for r in report["results"]] == ["none", "router"]


def _copy(folder, tmp_path):
    import shutil

    return shutil.copytree(folder, tmp_path / "m")


def test_a_missing_expert_tensor_is_named(adapter_models, tmp_path):
    folder = _copy(adapter_models["deepseek_v3"], tmp_path)
    sd = load_file(folder / "model.safetensors")
    del sd["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="layer 2 expert 5 up"):
        load_offloaded(folder, RuntimeConfig(cache_experts=4))


@pytest.mark.parametrize("family,name,shape", [
    ("deepseek_v2", "model.layers.1.mlp.experts.3.down_proj.weight", (32, 8)),
    ("gpt_oss", "model.layers.0.mlp.experts.gate_up_proj", (8, 32, 16)),
    ("gpt_oss", "model.layers.1.mlp.experts.down_proj_bias", (8, 31)),
    ("gpt_oss_mxfp4", "model.layers.0.mlp.experts.down_proj_scales", (8, 32, 2)),
])
def test_a_wrong_expert_shape_names_the_tensor_and_both_shapes(adapter_models, tmp_path, family, name, shape):
    folder = _copy(adapter_models[family], tmp_path)
    sd = load_file(folder / "model.safetensors")
    want = tuple(sd[name].shape)
    sd[name] = torch.zeros(shape, dtype=sd[name].dtype)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        load_offloaded(folder, RuntimeConfig(cache_experts=4))
    assert name in str(info.value) and str(shape) in str(info.value) and str(want) in str(info.value)


def test_mxfp4_blocks_without_scales_are_reported(adapter_models, tmp_path):
    folder = _copy(adapter_models["gpt_oss_mxfp4"], tmp_path)
    sd = load_file(folder / "model.safetensors")
    del sd["model.layers.1.mlp.experts.gate_up_proj_scales"]
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    for expert_dtype in ("auto", "float32"):
        with pytest.raises(CheckpointError, match="layer 1 expert 0 gate_up"):
            load_offloaded(folder, RuntimeConfig(cache_experts=4, expert_dtype=expert_dtype))


def test_expert_dtype_other_than_the_compute_dtype_names_both_options(adapter_models):
    with pytest.raises(OptionError, match="--expert-dtype bf16 differs from the compute dtype float32") as info:
        load_offloaded(adapter_models["gpt_oss_mxfp4"], RuntimeConfig(cache_experts=4, expert_dtype="bf16"))
    assert "--dtype bf16" in info.value.hint
