"""`moespec download` and `moespec models` through Typer's CliRunner against the fake Hub."""

from __future__ import annotations

import json
import subprocess
import sys
import types

from typer.testing import CliRunner

from hub_fake_server import SHA_MAIN, VALID_TOKEN, fake_hub, hub_cache  # noqa: F401
from moespec.cli.app import app
from moespec.artifacts import calibration_path, estimator_path, sanitize_model_id

runner = CliRunner()


def _run(*args: str, env: dict | None = None):
    return runner.invoke(app, list(args), env=env, catch_exceptions=False)


def test_download_then_models(fake_hub, hub_cache):
    result = _run("download", "tiny/qwen3-moe")
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"Resolving tiny/qwen3-moe (main) on {fake_hub.url}" in out
    assert f"commit {SHA_MAIN[:12]} · qwen3_moe (Qwen3MoeForCausalLM) · float32" in out
    assert "5 of 5 files to fetch, 33.49 kB" in out
    assert "skipping 3 file(s) moespec does not use: .gitattributes, original/model.safetensors, pytorch_model.bin" in out
    assert str(hub_cache / "models--tiny--qwen3-moe" / "snapshots" / SHA_MAIN) in out.replace("\n", "")
    assert "6,896 (float32, 4 bytes each)" in out
    assert "12.29 kB = 2 MoE layers × 4 experts × 1.54 kB" in out
    assert "6.14 kB = 2 layers × top-2 × 1.54 kB" in out
    assert "host RAM     536.88 MB with a GPU, 536.90 MB on CPU only" in out
    assert "next: moespec chat tiny/qwen3-moe" in out

    calibration_path("tiny/qwen3-moe").parent.mkdir(parents=True)
    calibration_path("tiny/qwen3-moe").write_bytes(b"x")
    listed = json.loads(_run("models", "--json").output)
    assert [(m["model_id"], m["refs"], m["model_type"], m["runnable"]) for m in listed] == [
        ("tiny/qwen3-moe", ["main"], "qwen3_moe", True)
    ]
    assert listed[0]["has_calibration"] is True and listed[0]["has_estimator"] is False
    assert listed[0]["zero_cache_h2d_bytes_per_token"] == 6144 and listed[0]["expert_bytes"] == 1536
    # host RAM: the experts (12288 bytes) + the runtime's 512 MiB headroom; on CPU the dense part too
    assert listed[0]["host_ram_bytes"] == 12288 + 512 * 2**20
    assert listed[0]["host_ram_cpu_bytes"] == listed[0]["host_ram_bytes"] + listed[0]["dense_bytes"]
    table = _run("models").output
    assert "tiny/qwen" in table and "qwen3_moe" in table and "33.5 kB" in table and "6.14 kB" in table


def test_second_download_fetches_nothing(fake_hub, hub_cache):
    assert _run("download", "tiny/qwen3-moe").exit_code == 0
    out = _run("download", "tiny/qwen3-moe").output
    assert "0 of 5 files to fetch, 0 B (5 already on disk)" in out


def test_errors_are_one_message_and_a_hint(fake_hub, hub_cache):
    gated = _run("download", "tiny/gated-moe")
    assert gated.exit_code == 2
    assert "error: tiny/gated-moe is a gated repo" in gated.output
    assert "hint: accept them at" in gated.output
    assert "Traceback" not in gated.output

    missing = _run("download", "tiny/nope")
    assert missing.exit_code == 2 and "tiny/nope was not found" in missing.output

    llama = _run("download", "tiny/dense-llama")
    assert llama.exit_code == 2 and "pass --force" in llama.output

    assert _run("download").exit_code == 2
    both = _run("download", "tiny/qwen3-moe", "--default")
    assert both.exit_code == 2 and "not both" in both.output


def test_token_from_hf_token_env(fake_hub, hub_cache):
    result = _run("download", "tiny/gated-moe", env={"HF_TOKEN": VALID_TOKEN})
    assert result.exit_code == 0, result.output
    assert "done: tiny/gated-moe" in result.output


def test_download_default_builds_the_embedded_model(monkeypatch, hub_cache):
    calls = []
    fake = types.ModuleType("moespec.default_model")
    fake.ensure_default_model = lambda console: calls.append(console) or "/models/default"
    monkeypatch.setitem(sys.modules, "moespec.default_model", fake)
    result = _run("download", "--default")
    assert result.exit_code == 0, result.output
    assert len(calls) == 1 and "default model ready at /models/default" in result.output


def test_models_on_an_empty_cache(hub_cache):
    result = _run("models")
    assert result.exit_code == 0 and "no models in" in result.output and "moespec download" in result.output
    assert _run("models", "--json").output.strip() == "[]"


def test_artifact_paths_share_one_key(hub_cache, tmp_path):
    assert sanitize_model_id("Qwen/Qwen3-30B-A3B") == "Qwen--Qwen3-30B-A3B"
    assert sanitize_model_id("/data/my model/") == "data--my_model"
    assert calibration_path("Qwen/Qwen3-30B-A3B") == tmp_path / "moespec_home" / "calib" / "Qwen--Qwen3-30B-A3B.safetensors"
    assert estimator_path("Qwen/Qwen3-30B-A3B").parent.name == "estimators"


def test_cli_import_does_not_load_torch_or_the_hub_client():
    code = "import sys, moespec.cli.app; print(sorted(m for m in ('torch', 'huggingface_hub', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_download_in_offline_mode(fake_hub, hub_cache, monkeypatch):
    from huggingface_hub import constants

    assert _run("download", "tiny/qwen3-moe").exit_code == 0
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    before = len(fake_hub.requests)
    cached = _run("download", "tiny/qwen3-moe")
    assert cached.exit_code == 0 and "is in the local cache (HF_HUB_OFFLINE is set" in cached.output
    missing = _run("download", "tiny/gated-moe")
    assert missing.exit_code == 2 and "HF_HUB_OFFLINE is set" in missing.output
    assert len(fake_hub.requests) == before


def test_models_marks_what_cannot_run(fake_hub, hub_cache):
    assert _run("download", "tiny/dense-llama", "--force").exit_code == 0
    fake_hub.fail_always.add("model.safetensors")
    assert _run("download", "tiny/qwen3-moe").exit_code == 2
    listed = {m["model_id"]: m for m in json.loads(_run("models", "--json").output)}
    assert listed["tiny/qwen3-moe"]["status"] == "incomplete"
    assert listed["tiny/dense-llama"]["status"] == "unsupported" and listed["tiny/dense-llama"]["expert_bytes"] is None
    assert "qwen3_moe (incomplete)" in _run("models", env={"COLUMNS": "120"}).output


def test_models_lists_folders_moespec_built(hub_cache, tmp_path):
    from hub_fake_server import tiny_qwen3_moe_files
    from moespec.paths import models_dir

    folder = models_dir() / "default"
    folder.mkdir(parents=True)
    tiny = tiny_qwen3_moe_files(2)
    (folder / "config.json").write_bytes(tiny["config.json"])
    (folder / "model.safetensors").write_bytes(tiny["model.safetensors"])
    (folder / "moespec-calibration.safetensors").write_bytes(b"calibration")
    (listed,) = json.loads(_run("models", "--json").output)
    assert listed["source"] == "moespec" and listed["model_id"] == str(folder)
    assert listed["status"] == "ok" and listed["has_calibration"] is True
    assert listed["disk_bytes"] == sum(p.stat().st_size for p in folder.iterdir())


def test_download_of_a_tag_points_chat_at_its_folder(fake_hub, hub_cache):
    from hub_fake_server import SHA_V1

    out = _run("download", "tiny/qwen3-moe", "--revision", "v1.0").output
    assert f"commit {SHA_V1[:12]}" in out and "3.07 kB = 1 layer × top-2 × 1.54 kB" in out
    assert f"next: moespec chat {hub_cache / 'models--tiny--qwen3-moe' / 'snapshots' / SHA_V1}" in out
