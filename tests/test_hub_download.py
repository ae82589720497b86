"""`moespec.hub.download` against the real huggingface_hub client and a local fake Hub."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from huggingface_hub import constants

from hub_fake_server import SHA_MAIN, SHA_V1, VALID_TOKEN, fake_hub, hub_cache, tiny_qwen3_moe_files  # noqa: F401
from moespec.errors import CheckpointError, ModelNotFoundError, UnsupportedModelError
from moespec.hub.download import download_model, plan_download
from moespec.hub.errors import HubAccessError, HubUnreachableError
from moespec.hub.resolve import resolve_model

WANTED = ["README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]


def _download(repo_id: str, **plan_kwargs):
    plan = plan_download(repo_id, **plan_kwargs)
    seen: list[int] = []
    folder = download_model(plan, token=plan_kwargs.get("token"), on_bytes=seen.append)
    return plan, folder, seen


def test_download_fetches_only_the_files_moespec_needs(fake_hub, hub_cache):
    served = tiny_qwen3_moe_files(2)
    plan, folder, seen = _download("tiny/qwen3-moe")

    assert plan.commit == SHA_MAIN
    assert folder == hub_cache / "models--tiny--qwen3-moe" / "snapshots" / SHA_MAIN
    assert sorted(p.name for p in folder.iterdir()) == WANTED
    for name in WANTED:
        assert (folder / name).read_bytes() == served[name]
    # allow-patterns: the .bin, the original/ copy and .gitattributes are never requested
    assert plan.files.skipped == [".gitattributes", "original/model.safetensors", "pytorch_model.bin"]
    assert fake_hub.gets("pytorch_model.bin") == []
    assert not any("original" in r.path for r in fake_hub.requests)
    # the byte callback saw every byte fetched
    assert plan.cached == frozenset()
    assert seen[-1] == plan.fetch_bytes == plan.total_bytes == sum(len(served[n]) for n in WANTED)


def test_size_breakdown_matches_the_real_checkpoint(fake_hub, hub_cache):
    from safetensors import safe_open

    plan, folder, _ = _download("tiny/qwen3-moe")
    sizes = plan.sizes
    with safe_open(folder / "model.safetensors", "pt") as f:
        numel = {k: f.get_slice(k).get_shape() for k in f.keys()}
    total = sum(int(_prod(s)) for s in numel.values())
    experts = sum(int(_prod(s)) for k, s in numel.items() if ".experts." in k)
    assert sizes.dtype == "float32" and sizes.bytes_per_param == 4
    assert sizes.params.total_params == total == 6896
    assert sizes.experts_bytes == experts * 4 == 2 * 4 * 3 * 16 * 8 * 4
    assert sizes.dense_bytes == (total - experts) * 4
    assert sizes.expert_bytes == 3 * 16 * 8 * 4  # gate + up + down of one expert, fp32
    assert sizes.zero_cache_h2d_bytes_per_token == 2 * 2 * 1536  # 2 MoE layers × top-2 × 1536 B


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def test_dropped_connection_resumes_with_a_range_request(fake_hub, hub_cache, monkeypatch):
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)  # so bytes reach disk before the drop
    fake_hub.truncate_once.add("model.safetensors")
    served = tiny_qwen3_moe_files(2)["model.safetensors"]

    _, folder, seen = _download("tiny/qwen3-moe")

    first, second = fake_hub.gets("model.safetensors")
    assert first.range is None
    start = int(second.range.removeprefix("bytes=").rstrip("-"))
    assert 0 < start < len(served) and start % 4096 == 0
    assert hashlib.sha256((folder / "model.safetensors").read_bytes()).digest() == hashlib.sha256(served).digest()
    assert max(seen) == sum(len(tiny_qwen3_moe_files(2)[n]) for n in WANTED)


def test_rerun_after_a_failed_download_fetches_only_what_is_missing(fake_hub, hub_cache):
    fake_hub.fail_always.add("model.safetensors")
    with pytest.raises(HubUnreachableError, match="HTTP 500"):
        _download("tiny/qwen3-moe")
    with pytest.raises(CheckpointError, match="incomplete"):  # resolution sees the half-done snapshot
        resolve_model("tiny/qwen3-moe")

    fake_hub.fail_always.clear()
    plan, folder, _ = _download("tiny/qwen3-moe")

    assert plan.to_fetch == ["model.safetensors"]
    assert len(fake_hub.gets("README.md")) == 1 and len(fake_hub.gets("tokenizer.json")) == 1
    assert resolve_model("tiny/qwen3-moe") == folder


def test_revision_pinning_by_tag_and_by_commit(fake_hub, hub_cache):
    plan, folder, _ = _download("tiny/qwen3-moe", revision="v1.0")

    assert plan.commit == SHA_V1 and folder.name == SHA_V1
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 1
    assert plan.sizes.params.num_moe_layers == 1
    refs = hub_cache / "models--tiny--qwen3-moe" / "refs"
    assert (refs / "v1.0").read_text() == SHA_V1 and not (refs / "main").exists()

    plan_sha, folder_sha, _ = _download("tiny/qwen3-moe", revision=SHA_V1)
    assert folder_sha == folder and plan_sha.to_fetch == []


def test_gated_repo_without_token_is_a_clear_error(fake_hub, hub_cache):
    with pytest.raises(HubAccessError) as info:
        plan_download("tiny/gated-moe")
    assert "gated" in info.value.message
    assert "--token" in info.value.hint and f"{fake_hub.url}/tiny/gated-moe" in info.value.hint
    assert [r.path for r in fake_hub.requests if r.role == "cdn"] == []

    _, folder, _ = _download("tiny/gated-moe", token=VALID_TOKEN)
    assert (folder / "model.safetensors").is_file()
    heads = [r for r in fake_hub.requests if r.method == "HEAD" and r.path.endswith("/model.safetensors")]
    assert heads[-1].authorization == f"Bearer {VALID_TOKEN}"
    assert fake_hub.gets("model.safetensors")[-1].authorization is None  # the token never goes to the CDN


def test_invalid_token_is_refused(fake_hub, hub_cache):
    with pytest.raises(HubAccessError, match="HTTP 401"):
        plan_download("tiny/qwen3-moe", token="hf_wrong")


def test_unknown_repo_and_revision(fake_hub, hub_cache):
    with pytest.raises(ModelNotFoundError, match="tiny/nope was not found") as info:
        plan_download("tiny/nope")
    assert "org/name" in info.value.hint
    with pytest.raises(ModelNotFoundError, match="no revision 'v9'"):
        plan_download("tiny/qwen3-moe", revision="v9")


def test_repo_without_safetensors_is_refused_before_any_weight_moves(fake_hub, hub_cache):
    with pytest.raises(CheckpointError, match=r"only \.bin / \.gguf weights and no \*\.safetensors"):
        plan_download("tiny/bin-only")
    assert [r for r in fake_hub.requests if r.role == "cdn"] == []


def test_unsupported_architecture_is_refused_unless_forced(fake_hub, hub_cache):
    with pytest.raises(UnsupportedModelError, match="'llama'.*mixtral, olmoe, qwen2_moe, qwen3_moe") as info:
        plan_download("tiny/dense-llama")
    assert "--force" in info.value.hint
    assert [r for r in fake_hub.requests if r.role == "cdn"] == []
    assert not (hub_cache / "models--tiny--dense-llama").exists()  # a refused repo leaves nothing behind

    plan, folder, _ = _download("tiny/dense-llama", force=True)
    assert plan.sizes is None and (folder / "model.safetensors").is_file()


def test_offline_mode_refuses_to_download_without_touching_the_network(fake_hub, hub_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    before = len(fake_hub.requests)
    with pytest.raises(HubUnreachableError, match="HF_HUB_OFFLINE"):
        plan_download("tiny/qwen3-moe")
    assert len(fake_hub.requests) == before


def test_local_dir_download_resolves_as_a_folder(fake_hub, hub_cache, tmp_path: Path):
    target = tmp_path / "models" / "tiny"
    plan, folder, _ = _download("tiny/qwen3-moe", local_dir=target)
    assert folder == target.resolve()
    assert sorted(p.name for p in target.iterdir() if not p.name.startswith(".")) == WANTED
    assert resolve_model(str(target)) == target
