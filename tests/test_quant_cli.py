"""`moespec models` and `download` count experts as --expert-dtype int8/int4 stores them."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hub_fake_server import fake_hub, hub_cache  # noqa: F401
from moespec.cli.app import app

runner = CliRunner()


def _built_model():
    from hub_fake_server import tiny_qwen3_moe_files
    from moespec.paths import models_dir

    folder = models_dir() / "default"
    folder.mkdir(parents=True)
    tiny = tiny_qwen3_moe_files(2)
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes(tiny[name])
    return json.loads(tiny["config.json"])


def test_models_reports_int4_expert_bytes(hub_cache):
    cfg = _built_model()
    h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
    (plain,) = json.loads(runner.invoke(app, ["models", "--json"]).output)
    r = runner.invoke(app, ["models", "--json", "--expert-dtype", "int4", "--group-size", "32"])
    assert r.exit_code == 0, r.output
    (quant,) = json.loads(r.output)
    used = 3 * h * i // 2 + (2 * i * -(-h // 32) + h * -(-i // 32)) * 3  # codes + (scale, zero) per row group
    row = used + (-used) % 16
    assert quant["expert_bytes"] == row and quant["expert_format"] == "int4 (groups of 32)"
    assert plain["expert_bytes"] == 3 * h * i * 4 and plain["expert_format"] == "float32"
    assert quant["zero_cache_h2d_bytes_per_token"] * plain["expert_bytes"] == \
        plain["zero_cache_h2d_bytes_per_token"] * row


def test_download_prints_int8_sizes(fake_hub, hub_cache):
    r = runner.invoke(app, ["download", "tiny/qwen3-moe", "--expert-dtype", "int8", "--group-size", "32"])
    assert r.exit_code == 0, r.output
    assert "experts as   int8 (groups of 32)" in r.output
