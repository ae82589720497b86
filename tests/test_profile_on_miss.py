"""`moespec profile --on-miss`: fetch / host / auto arms side by side on a tiny Qwen3-MoE."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from moespec.cli.app import app
from moespec.profile.schema import validate

K, LAYERS = 2, 3


def test_on_miss_arms_side_by_side(tiny_models, tmp_path):
    res = CliRunner().invoke(app, [
        "profile", str(tiny_models["qwen3_moe"]), "--device", "cpu", "--threads", "1", "--cache-experts", "4",
        "--link-gbps", "0.5", "--strategies", "none,router+auto", "--on-miss", "fetch,host", "--prompt-len", "8",
        "--gen", "3", "--repeats", "1", "--warmup", "1", "--out", str(tmp_path / "r.json"),
        "--trace", str(tmp_path / "t.json")], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert validate(rep) == []
    by = {r["strategy"]: r for r in rep["results"]}
    assert list(by) == ["none", "none+host", "router+auto"]
    assert "where experts ran" in res.output
    fetch, host = by["none"], by["none+host"]
    assert (fetch["on_miss"], host["on_miss"], by["router+auto"]["on_miss"]) == ("fetch", "host", "auto")
    # Every layer's K experts per token: fetched (or cached) under fetch, computed on the host under host,
    # and the host arm copies no expert.
    assert fetch["hits_per_token"] + fetch["misses_per_token"] == K * LAYERS
    assert fetch["host"]["experts_per_token"] == 0
    assert host["host"]["experts_per_token"] == K * LAYERS and host["h2d_bytes_per_token"] == 0
    hidden = rep["model"]["hidden"]
    assert host["host"]["d2h_bytes_per_token"] == host["host"]["h2d_bytes_per_token"] == K * LAYERS * hidden * 4
    assert host["host"]["prefill_fetched"] == 0 and host["host"]["prefill_host"] > 0
    assert host["tpot_ratio_vs_fetch"] is not None and fetch["tpot_ratio_vs_fetch"] == 1.0
    for r in rep["results"]:  # exact on every arm
        assert r["quality"]["top1_agreement"] == 1.0 and r["quality"]["kl_mean"] < 1e-9
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    host_spans = [e for e in events if e.get("cat") == "host"]
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert "host" in lanes and host_spans
