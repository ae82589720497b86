"""GGUF models through the CLI: `download --quant` against the fake Hub, `models`, `chat`, `calibrate`,
`train-estimator`, `profile`, `serve`."""

from __future__ import annotations

import json

import pytest
from tiny_gguf import write_gguf
from typer.testing import CliRunner

from hub_fake_server import FakeHub, FakeRepo, point_hub_at
from moespec.cli.app import app
from moespec.gguf.export import ExportTypes

runner = CliRunner()
SHA = "c" * 40


def _run(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two quants of one tiny Qwen3-MoE, as a Hub GGUF repo holds them."""
    root = tmp_path_factory.mktemp("ggufrepo")
    q8, _ = write_gguf(root / "q8", "qwen3_moe", ExportTypes("Q8_0"), name="Tiny-Q8_0.gguf", hidden=64, inter=64)
    f32, _ = write_gguf(root / "f32", "qwen3_moe", ExportTypes("F32"), name="Tiny-F32.gguf", hidden=64, inter=64)
    return {"Tiny-Q8_0.gguf": q8.read_bytes(), "F32/Tiny-F32.gguf": f32.read_bytes(), "README.md": b"# tiny\n"}


def test_download_one_quant_then_models_and_chat(files, monkeypatch, tmp_path):
    with FakeHub({"tiny/Tiny-GGUF": FakeRepo({SHA: files}, {"main": SHA})}) as hub:
        point_hub_at(monkeypatch, tmp_path, hub.url)
        refused = runner.invoke(app, ["download", "tiny/Tiny-GGUF"])
        assert refused.exit_code != 0 and "--quant F32" in refused.output  # a GGUF repo needs a quant
        result = _run("download", "tiny/Tiny-GGUF", "--quant", "Q8_0")
        assert result.exit_code == 0, result.output
        assert "1 GGUF part(s) of Q8_0" in result.output and "next: moespec chat tiny/Tiny-GGUF:Q8_0" in result.output
        assert hub.gets("F32/Tiny-F32.gguf") == []  # the other quant never moved
    listed = {m["model_id"]: m for m in json.loads(_run("models", "--json").output)}
    row = listed["tiny/Tiny-GGUF:Q8_0"]
    assert row["model_type"] == "qwen3_moe" and row["expert_format"] == "gguf Q8_0/Q8_0/Q8_0" and row["runnable"]
    assert row["quant"] == "Q8_0"
    assert row["expert_bytes"] == 3 * 64 * 64 // 32 * 34  # gate + up + down rows of Q8_0 blocks
    # from disk: the dense part, 2K rows of the RAM tier in 4 KiB pages (a 13,056-byte row: 16 KiB), headroom
    from moespec.hub.sizes import HOST_HEADROOM_BYTES

    assert row["from_disk_min_ram_bytes"] == row["dense_bytes"] + 2 * 2 * 16384 + HOST_HEADROOM_BYTES
    table = _run("models").output
    assert "tiny/Tiny-GGUF:Q8_0" in table and "qwen3_moe Q8_0" in table
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = _run("chat", "tiny/Tiny-GGUF:Q8_0", "--prompt", "hi", "--max-new-tokens", "4", "--json", "--device", "cpu")
    assert out.exit_code == 0, out.output
    assert json.loads(out.output.strip().splitlines()[-1])["stats"]["new_tokens"] == 4


def test_calibrate_train_estimator_and_profile_take_a_gguf_file(files, tmp_path):
    from moespec.artifacts import default_calibration_path, default_estimator_path
    from moespec.hub.resolve import resolve_model
    from moespec.predict.estimator_file import load_estimator

    path = tmp_path / "Tiny-Q8_0.gguf"
    path.write_bytes(files["Tiny-Q8_0.gguf"])
    out = _run("calibrate", str(path), "--seq-len", "16", "--tokens", "64", "--device", "cpu")
    assert out.exit_code == 0, out.output
    folder = resolve_model(str(path))
    assert default_calibration_path(folder).is_file()  # keyed by the GGUF's path, where chat looks
    out = _run("train-estimator", str(path), "--seq-len", "16", "--tokens", "256", "--epochs", "1", "--layers", "0",
               "--device", "cpu")
    assert out.exit_code == 0, out.output
    assert load_estimator(default_estimator_path(folder)).layers == [0]  # where chat's estimator predictor looks
    report = tmp_path / "p.json"
    out = _run("profile", str(path), "--strategies", "none,quasi", "--prompt-len", "8", "--gen", "4", "--repeats", "1",
               "--warmup", "0", "--device", "cpu", "--out", str(report))
    assert out.exit_code == 0, out.output
    model = json.loads(report.read_text())["model"]
    assert model["expert_format"] == "gguf Q8_0/Q8_0/Q8_0" and model["expert_bytes"] == 3 * 64 * 64 // 32 * 34


def test_serve_answers_as_chat_does(files, tmp_path):
    """`moespec serve` on a GGUF file: named by the file, and its answer is `moespec chat`'s."""
    openai = pytest.importorskip("openai")
    from serve_harness import serve, tiny_runtime

    from moespec.serve.app import ServeSettings

    path = tmp_path / "Tiny-Q8_0.gguf"
    path.write_bytes(files["Tiny-Q8_0.gguf"])
    out = _run("chat", str(path), "--prompt", "hello", "--json", "--max-new-tokens", "6", "--cache-experts", "4",
               "--device", "cpu", "--predictor", "router")
    assert out.exit_code == 0, out.output
    want = json.loads(out.stdout.strip().splitlines()[-1])["text"]
    with serve(path, ServeSettings(max_queue=2), tiny_runtime()) as running:
        client = openai.OpenAI(base_url=running.v1, api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["Tiny-Q8_0.gguf"]
        got = client.chat.completions.create(model="Tiny-Q8_0.gguf", messages=[{"role": "user", "content": "hello"}],
                                             max_tokens=6, temperature=0)
    assert got.choices[0].message.content == want
