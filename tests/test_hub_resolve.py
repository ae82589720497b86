"""`resolve_model`: local folders and Hub ids from the local cache, offline first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import constants

from hub_fake_server import SHA_MAIN, fake_hub, hub_cache, tiny_qwen3_moe_files  # noqa: F401
from moespec.errors import CheckpointError, ModelNotFoundError
from moespec.hub.download import download_model, plan_download
from moespec.hub.resolve import resolve_model


def _get(repo_id: str, revision: str | None = None) -> Path:
    return download_model(plan_download(repo_id, revision=revision))


def test_resolves_from_the_cache_after_the_server_is_gone(fake_hub, hub_cache, monkeypatch):
    folder = _get("tiny/qwen3-moe")
    fake_hub.stop()

    assert resolve_model("tiny/qwen3-moe") == folder
    assert resolve_model("tiny/qwen3-moe", revision="main") == folder
    assert resolve_model("tiny/qwen3-moe", revision=SHA_MAIN) == folder
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("tiny/qwen3-moe") == folder


def test_resolution_makes_no_network_call(fake_hub, hub_cache):
    _get("tiny/qwen3-moe")
    before = len(fake_hub.requests)
    resolve_model("tiny/qwen3-moe")
    assert len(fake_hub.requests) == before


def test_a_revision_not_in_the_cache_names_the_download_command(fake_hub, hub_cache):
    _get("tiny/qwen3-moe")
    with pytest.raises(ModelNotFoundError, match=r"at revision 'v1.0'.*\(cached revisions: main\)") as info:
        resolve_model("tiny/qwen3-moe", revision="v1.0")
    assert info.value.hint.startswith("run `moespec download tiny/qwen3-moe --revision v1.0` first")


def test_a_model_not_in_the_cache_suggests_moespec_download(hub_cache, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="nor in the local Hub cache") as info:
        resolve_model("org/never-downloaded")
    assert "moespec download org/never-downloaded" in info.value.hint
    assert str(hub_cache) in info.value.message

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("org/never-downloaded")
    assert "HF_HUB_OFFLINE is set" in info.value.hint


def _folder(tmp_path: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    return tmp_path


def test_local_folder_with_config_and_safetensors(tmp_path, hub_cache):
    tiny = tiny_qwen3_moe_files(2)
    folder = _folder(tmp_path / "m", {"config.json": tiny["config.json"], "model.safetensors": tiny["model.safetensors"]})
    assert resolve_model(str(folder)) == folder


def test_local_folder_problems_are_named(tmp_path, hub_cache):
    tiny = tiny_qwen3_moe_files(2)
    bin_only = _folder(tmp_path / "bin", {"config.json": tiny["config.json"], "pytorch_model.bin": b"x"})
    with pytest.raises(CheckpointError, match=r"only \.bin weights and no \*\.safetensors"):
        resolve_model(str(bin_only))

    no_config = _folder(tmp_path / "noconf", {"model.safetensors": tiny["model.safetensors"]})
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_model(str(no_config))

    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    sharded = _folder(tmp_path / "sharded", {
        "config.json": tiny["config.json"], "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": tiny["model.safetensors"],
    })
    with pytest.raises(CheckpointError, match="names 1 shard.*model-00002-of-00002.safetensors"):
        resolve_model(str(sharded))

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing" / "folder"))
    with pytest.raises(ModelNotFoundError, match="is a file, not a folder"):
        resolve_model(str(bin_only / "config.json"))


def test_invalid_hub_id(hub_cache):
    with pytest.raises(ModelNotFoundError, match="neither a local folder nor a valid Hub id"):
        resolve_model("bad id with spaces")
