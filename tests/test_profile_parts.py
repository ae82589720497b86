"""Profile parts without a model: bounds arithmetic, schema validator, plot, guarded runs."""

from __future__ import annotations

import json

import pytest

from moespec.profile.bounds import step_bounds
from moespec.profile.schema import validate


def test_bounds_sum_and_max_per_layer():
    # 2 layers; link 1 GB/s, expert 1e6 bytes -> 1 ms per missed expert.
    b = step_bounds(wall_ms=20.0, layer_ms={0: 6.0, 1: 10.0}, stall_ms={0: 2.0, 1: 0.0}, missed={0: 3, 1: 1},
                    expert_bytes=10**6, link_gbps=1.0)
    other = 20.0 - 16.0
    assert b.copy_ms == pytest.approx(4.0)
    assert b.compute_ms == pytest.approx(other + 4.0 + 10.0)
    assert b.on_demand_ms == pytest.approx(other + (4.0 + 3.0) + (10.0 + 1.0))
    assert b.floor_ms == pytest.approx(other + max(4.0, 3.0) + max(10.0, 1.0))


def test_bounds_without_copies_are_the_compute_time():
    b = step_bounds(5.0, {0: 2.0}, {}, {}, 100, 10.0)
    assert b.on_demand_ms == b.floor_ms == b.compute_ms == pytest.approx(5.0)


def test_validator_names_the_problem():
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer", "minimum": 0}}}
    assert validate({"a": 1}, schema) == []
    assert validate({}, schema) == ["$: missing 'a'"]
    assert validate({"a": -1}, schema) == ["$.a: -1 < 0"]
    assert validate({"a": True}, schema) == ["$.a: expected integer, got bool"]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from moespec.profile.plot import write_plot

    res = {"strategy": "none", "prompt_len": 8, "tpot_ms": {"mean": 3.0, "std": 0.1}, "stall_ms_per_token": 1.0,
           "bounds": {"floor_ms": 2.0, "on_demand_ms": 3.0}, "per_layer": [{"layer": 0, "recall": None}]}
    oracle = dict(res, strategy="oracle", per_layer=[{"layer": 0, "recall": None}, {"layer": 1, "recall": 1.0}])
    rep = {"results": [res, oracle], "model": {"id": "tiny"}, "hardware": {"device_name": "cpu"},
           "link": {"measured_gbps": 1.0}, "cache": {"slots": 4}}
    write_plot(rep, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_guarded_run_on_a_shared_expert_family(tmp_path):
    from typer.testing import CliRunner

    from moespec.cli.app import app
    from tiny import make_checkpoint

    model = make_checkpoint(tmp_path / "q2", "qwen2_moe", layers=2, experts=8, top_k=2)
    res = CliRunner().invoke(app, ["profile", str(model), "--device", "cpu", "--threads", "1", "--cache-experts", "4",
                                   "--execute", "guarded", "--fetch-threshold", "0.6", "--strategies", "none,oracle",
                                   "--prompt-len", "6", "--gen", "3", "--repeats", "1", "--warmup", "0",
                                   "--out", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert validate(rep) == []
    none = rep["results"][0]
    assert none["execute"] == "guarded"
    assert 0.0 <= none["quality"]["top1_agreement"] <= 1.0 and none["quality"]["kl_mean"] >= 0.0
