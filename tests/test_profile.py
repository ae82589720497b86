"""`moespec profile` end to end on a tiny Qwen3-MoE: one profile run, one property per test."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moespec.cli.app import app
from moespec.errors import DataError
from moespec.profile.report import load_report
from moespec.profile.schema import REPORT_SCHEMA, validate

K, LAYERS = 2, 3
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, ["profile", *args], env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def model(tiny_models) -> Path:
    return tiny_models["qwen3_moe"]  # 3 layers, 8 experts, top-2


@pytest.fixture(scope="module")
def profiled(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    # a home of its own: the session's home may hold another test's calibration of this model (lfru)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOESPEC_HOME", str(tmp_path_factory.mktemp("home")))
        res = invoke(str(model), "--device", "cpu", "--threads", "1", "--cache-experts", "4", "--link-gbps", "0.5",
                     "--strategies", "none,router,oracle", "--prompt-len", "8", "--gen", "4", "--repeats", "2",
                     "--warmup", "1", "--out", str(out / "r.json"), "--trace", str(out / "t.json"))
    assert res.exit_code == 0, res.output
    return out, json.loads((out / "r.json").read_text()), res.output


def test_report_matches_schema(profiled):
    _, rep, _ = profiled
    assert validate(rep) == []
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(rep, REPORT_SCHEMA)
    assert [r["strategy"] for r in rep["results"]] == ["none", "router", "oracle"]


def test_table_names_every_strategy(profiled):
    _, _, output = profiled
    for name in ("none", "router", "oracle (bound)", "recall@K per layer"):
        assert name in output


def test_hits_plus_misses_is_k_per_moe_layer_per_token(profiled):
    _, rep, _ = profiled
    for r in rep["results"]:
        t = r["totals"]
        assert t["decode_tokens"] == 4 * 2
        assert t["hits"] + t["misses"] == K * LAYERS * t["decode_tokens"]


def test_bytes_are_copied_experts_times_expert_bytes(profiled):
    _, rep, _ = profiled
    eb = rep["model"]["expert_bytes"]
    for r in rep["results"]:
        t = r["totals"]
        assert t["h2d_bytes"] == (t["misses"] + t["prefetched"]) * eb
        assert t["copy_bytes"] == t["h2d_bytes"]  # what the transfer engine moved


def test_every_strategy_ran_the_same_trace(profiled):
    _, rep, _ = profiled
    shas = {r["token_sha256"] for r in rep["results"]}
    assert shas == {rep["trace"]["prompts"][0]["token_sha256"]}


def test_oracle_recall_is_one_and_exact_quality_is_perfect(profiled):
    _, rep, _ = profiled
    oracle = next(r for r in rep["results"] if r["strategy"] == "oracle")
    assert oracle["upper_bound"] and oracle["recall"] == 1.0
    assert oracle["weighted_recall"] == pytest.approx(1.0)
    assert oracle["prefetch_wasted_per_token"] == 0
    for r in rep["results"]:
        assert r["quality"]["top1_agreement"] == 1.0
        assert r["quality"]["kl_mean"] < 1e-6
        assert r["bounds"]["floor_ms"] <= r["bounds"]["on_demand_ms"]


def test_trace_is_valid_chrome_trace_json(profiled):
    out, rep, _ = profiled
    trace = json.loads((out / "t.json").read_text())
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert spans
    for e in spans:
        assert isinstance(e["name"], str) and e["dur"] >= 0 and isinstance(e["ts"], (int, float))
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {name for _, name in threads} == {"compute", "copy (H2D)"}
    assert len({e["pid"] for e in spans}) == 3  # one process per strategy
    pid_none = 1
    assert sum(e["cat"] == "layer" for e in spans if e["pid"] == pid_none) == LAYERS
    assert any(e["tid"] == 2 for e in spans)  # at least one copy span


def test_compare_two_saved_reports(profiled, tmp_path):
    out, rep, _ = profiled
    rep = copy.deepcopy(rep)
    del rep["xxh3"]  # an edited report without its seal reads as an old, unsealed one
    rep["results"][0]["tpot_ms"]["mean"] *= 2
    rep["options"]["link_gbps"] = 1.0
    (tmp_path / "b.json").write_text(json.dumps(rep))
    res = invoke("--compare", str(out / "r.json"), str(tmp_path / "b.json"))
    assert res.exit_code == 0, res.output
    assert "A vs B" in res.output and "2.000" in res.output and "link_gbps" in res.output


def test_a_saved_report_is_sealed_and_an_edit_is_refused_in_one_line(profiled, tmp_path):
    out, rep, _ = profiled
    from moespec.integrity import json_digest

    assert rep["xxh3"] == json_digest(rep)  # the seal covers everything but itself
    edited = copy.deepcopy(rep)
    edited["results"][0]["tpot_ms"]["mean"] *= 2  # the seal left as written
    (tmp_path / "b.json").write_text(json.dumps(edited, indent=1))
    res = invoke("--compare", str(out / "r.json"), str(tmp_path / "b.json"))
    assert res.exit_code == 2, res.output
    first = res.output.strip().splitlines()[0]
    assert "b.json" in first and "changed" in first and "Traceback" not in res.output
    with pytest.raises(DataError, match="changed after"):
        load_report(tmp_path / "b.json")


def test_compare_refuses_a_file_that_is_not_a_report(profiled, tmp_path):
    out, _, _ = profiled
    (tmp_path / "x.json").write_text(json.dumps({"kind": "moespec.profile", "schema_version": 999}))
    res = invoke("--compare", str(out / "r.json"), str(tmp_path / "x.json"))
    assert res.exit_code == 2 and "schema_version" in res.output


def test_existing_out_is_refused_without_force(profiled, model):
    out, _, _ = profiled
    before = (out / "r.json").read_text()
    res = invoke(str(model), "--device", "cpu", "--out", str(out / "r.json"))
    assert res.exit_code == 2 and "exists" in res.output and "--force" in res.output
    assert (out / "r.json").read_text() == before


def test_unknown_strategy_lists_the_valid_ones(model):
    res = invoke(str(model), "--device", "cpu", "--strategies", "none,psychic")
    assert res.exit_code == 2
    assert "psychic" in res.output and "router" in res.output and "oracle" in res.output


def test_prompt_beyond_the_context_is_refused(model):
    res = invoke(str(model), "--device", "cpu", "--prompt-len", "300", "--gen", "4")
    assert res.exit_code == 2 and "context" in res.output


def test_quasi_without_calibration_names_a_fix(model, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(model, folder)
    res = invoke(str(folder), "--device", "cpu", "--strategies", "none,quasi", "--gen", "2")
    assert res.exit_code == 2
    assert "calibrat" in res.output or "not available" in res.output


def test_ctrl_c_mid_run_writes_nothing(model, tmp_path, monkeypatch):
    import moespec.profile.run as run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "run_profile", interrupted)
    res = invoke(str(model), "--device", "cpu", "--out", str(tmp_path / "r.json"), "--trace", str(tmp_path / "t.json"))
    assert res.exit_code == 130
    assert list(tmp_path.iterdir()) == []


def test_load_report_roundtrip(profiled):
    out, rep, _ = profiled
    assert load_report(out / "r.json")["results"] == rep["results"]


def test_hit_rate_per_layer_and_policy(profiled):
    """Without a calibration file only lru is replayed; the runs used lru; every layer has a rate."""
    _, rep, output = profiled
    assert rep["options"]["cache_policy"] == "lru"
    replays = rep["policy_hit_rates"]["8"]
    assert list(replays) == ["lru"]
    assert len(replays["lru"]["per_layer"]) == LAYERS
    assert 0.0 <= replays["lru"]["hit_rate"] <= 1.0
    assert "hit rate per layer" in output and "replay" in output
