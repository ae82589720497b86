"""Profile parts without a model: bounds arithmetic, schema validator, plot, guarded runs."""

from __future__ import annotations

import json
import math

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
    """--execute guarded with a τ list: an exact arm plus one arm per τ, compared in a table of at most
    80 columns and in the JSON (bytes saved, perplexity ratio), and plotted."""
    from typer.testing import CliRunner

    from moespec.cli.app import app
    from tiny import make_checkpoint

    model = make_checkpoint(tmp_path / "q2", "qwen2_moe", layers=2, experts=8, top_k=2)
    res = CliRunner().invoke(app, ["profile", str(model), "--device", "cpu", "--threads", "1", "--cache-experts", "4",
                                   "--execute", "guarded", "--fetch-threshold", "0,0.6,2", "--strategies", "none,oracle",
                                   "--prompt-len", "6", "--gen", "3", "--repeats", "1", "--warmup", "0",
                                   "--decode-inputs", "text", "--out", str(tmp_path / "r.json")],
                             env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert "guarded NAME@τ vs exact NAME" in res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    rep = json.loads((tmp_path / "r.json").read_text())
    assert validate(rep) == []
    by = {r["strategy"]: r for r in rep["results"]}
    assert list(by) == ["none", "none@0", "none@0.6", "none@2", "oracle", "oracle@0", "oracle@0.6", "oracle@2"]
    exact, zero, never = by["none"], by["none@0"], by["none@2"]
    assert exact["execute"] == "exact" and exact["fetch_threshold"] is None and exact["vs_exact"] is None
    assert zero["execute"] == "guarded" and zero["fetch_threshold"] == 0.0
    # τ = 0 is exact: same bytes, same logits (top-1 1, KL 0, perplexity ratio 1)
    assert zero["h2d_bytes_per_token"] == exact["h2d_bytes_per_token"] and zero["vs_exact"]["bytes_saved"] == 0
    assert zero["quality"]["top1_agreement"] == 1.0 and zero["quality"]["kl_mean"] == pytest.approx(0, abs=1e-12)
    assert zero["vs_exact"]["perplexity_ratio"] == pytest.approx(1.0, abs=1e-12)
    # τ = 2 never fetches on demand in decode: no decode bytes, everything missed is skipped
    assert never["h2d_bytes_per_token"] == 0 and never["skipped_per_token"] > 0
    assert never["vs_exact"]["bytes_saved"] == 1.0
    assert never["skipped_mass_per_layer"] == pytest.approx(never["skipped_mass_per_token"] / 2)
    for r in rep["results"]:
        assert r["quality"]["perplexity"] == pytest.approx(math.exp(r["quality"]["nll_mean"]))
    pytest.importorskip("matplotlib")
    from moespec.profile.plot import write_plot

    write_plot(rep, tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("cmd", ["chat", "serve"])
def test_one_threshold_commands_refuse_a_list(cmd):
    from typer.testing import CliRunner

    from moespec.cli.app import app

    res = CliRunner().invoke(app, [cmd, "--fetch-threshold", "0.1,0.2", "--prompt", "hi"] if cmd == "chat"
                             else [cmd, "--fetch-threshold", "0.1,0.2"])
    assert res.exit_code != 0
    text = " ".join(res.output.split())
    assert "--fetch-threshold '0.1,0.2' is a list" in text and "Traceback" not in res.output


def test_threshold_list_parsing():
    from moespec.cli.runtime_opts import one_threshold, threshold_list
    from moespec.config import DEFAULT_FETCH_THRESHOLD
    from moespec.errors import OptionError

    assert threshold_list("0, 0.02,0.05,0.05") == (0.0, 0.02, 0.05)
    assert threshold_list(None) == (DEFAULT_FETCH_THRESHOLD,) and one_threshold("0.3") == 0.3
    assert threshold_list(0.1) == (0.1,) and threshold_list(1) == (1.0,)  # a number is taken as it is
    for bad in ("", "x", "-0.1", "nan", -0.1, float("nan")):
        with pytest.raises(OptionError, match="--fetch-threshold"):
            threshold_list(bad)
