"""Everything a user reads fits 80 columns: no number cut by an ellipsis, no line wider than the console.

Fixed console widths (Console(width=80), COLUMNS=80 for the CLI), on the committed default-model
profile and on small built inputs; one property per test.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from typer.testing import CliRunner

from hub_fake_server import fake_hub, hub_cache  # noqa: F401
from moespec.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
REPORT_A = ROOT / "profiles" / "cpu-default-model-r5-exact.json"
REPORT_B = ROOT / "profiles" / "cpu-default-model-85pct-exact.json"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _own_home(monkeypatch, tmp_path):
    """A moespec home per test: tests here build models into it."""
    monkeypatch.setenv("MOESPEC_HOME", str(tmp_path / "moespec_home"))


def console(width: int = 80) -> Console:
    return Console(width=width, file=io.StringIO(), highlight=False, color_system=None)


def text_of(c: Console) -> str:
    return c.file.getvalue()


def assert_fits(text: str, width: int = 80) -> None:
    assert "…" not in text
    too_long = [line for line in text.splitlines() if len(line.rstrip()) > width]
    assert too_long == []


@pytest.mark.parametrize("width", [40, 60, 80])
def test_fit_tables_keeps_every_cell_whole(width):
    from moespec.tables import Column, fit_tables

    key = [Column("strategy", ["none", "router", "oracle (bound)"], "left")]
    cols = [Column(f"col {i}\nms", [f"{1234.5678 * (i + 1) * (r + 1):.2f}" for r in range(3)]) for i in range(9)]
    c = console(width)
    tables = fit_tables("a title", key, cols, width)
    for t in tables:
        c.print(t)
    out = text_of(c)
    assert_fits(out, width)
    assert len(tables) > 1  # nine 8-digit columns never fit 80 columns in one table
    for col in cols:
        for cell in col.cells:
            assert cell in out


def test_fit_tables_without_width_is_one_table():
    from moespec.tables import Column, fit_tables

    cols = [Column(f"c{i}", ["123456.789"]) for i in range(12)]
    assert len(fit_tables(None, [Column("k", ["x"])], cols, None)) == 1


def test_profile_report_fits_80_and_shows_every_tpot():
    from moespec.profile.render import render_report

    rep = json.loads(REPORT_A.read_text())
    c = console()
    render_report(rep, c)
    out = text_of(c)
    assert_fits(out)
    for r in rep["results"]:
        assert f"{r['tpot_ms']['mean']:.2f}" in out and f"{r['ttft_ms']['mean']:.1f}" in out
        assert f"{r['h2d_bytes_per_token'] / 1e6:.3f}" in out
    assert "recall@K per layer" in out


def test_profile_compare_fits_80_through_the_cli():
    res = runner.invoke(app, ["profile", "--compare", str(REPORT_A), str(REPORT_B)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert_fits(res.output)
    a, b = json.loads(REPORT_A.read_text()), json.loads(REPORT_B.read_text())
    for ra, rb in zip(a["results"], b["results"]):
        assert f"{ra['tpot_ms']['mean']:.1f}" in res.output and f"{rb['tpot_ms']['mean']:.1f}" in res.output
        assert f"{rb['tpot_ms']['mean'] / ra['tpot_ms']['mean']:.3f}" in res.output


def test_profile_wide_keeps_one_table():
    res = runner.invoke(app, ["profile", "--compare", str(REPORT_A), str(REPORT_B), "--wide"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    header = next(line for line in res.output.splitlines() if "TPOT A" in line)
    assert len(header.rstrip()) > 80  # every column on the line, wider than the terminal


def test_chat_footer_fits_one_line():
    from moespec.chat.footer import footer
    from moespec.runtime.stats import Summary

    worst = Summary(prompt_tokens=10, new_tokens=10, ttft_ms=1e4, tpot_ms=9999.4, tokens_per_s=9999.4, recall=0.823,
                    weighted_recall=0.9, hit_rate=0.5, h2d_mb_per_token=9999.4, stall_ms_per_token=9999.4,
                    compute_ms_per_token=1.0, prefetch_wasted_per_token=0.0, skipped_per_token=0.0)
    line = footer(worst)
    assert len(line) <= 80
    assert "TPOT 9999 ms" in line and "recall@K 0.82" in line and "stall 9999 ms/tok" in line
    small = Summary(10, 10, 5.0, 86.24, 11.6, None, None, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0)
    assert footer(small) == "11.6 tok/s · TPOT 86.2 ms · recall@K n/a · H2D 0.00 MB/tok · stall 0.00 ms/tok"


def test_chat_footer_with_host_experts_fits_80():
    from moespec.chat.footer import footer
    from moespec.runtime.stats import Summary

    worst = Summary(prompt_tokens=10, new_tokens=10, ttft_ms=1e4, tpot_ms=9999.4, tokens_per_s=9999.4, recall=0.823,
                    weighted_recall=0.9, hit_rate=0.5, h2d_mb_per_token=9999.4, stall_ms_per_token=9999.4,
                    compute_ms_per_token=1.0, prefetch_wasted_per_token=0.0, skipped_per_token=0.0,
                    host_experts_per_token=9999.4, host_ms_per_token=1.0)
    for policy in ("lru", "lfu", "lfru", "static"):
        line = footer(worst, policy=policy, host=True)
        assert len(line) <= 80, line
        assert line.endswith(f"host 9999 · {policy}") and "stall 9999 ms" in line and "TPOT 9999 ms" in line
    auto = Summary(10, 10, 5.0, 86.24, 11.6, None, None, 0.02, 1.567, 0.78, 1.0, 0.0, 0.0, 117.29, 30.5)
    assert footer(auto, policy="lfru", host=True) == \
        "TPOT 86.2 ms · recall@K n/a · H2D 1.57 MB · stall 0.78 ms · host 117 · lfru"
    assert "host" not in footer(auto, policy="lfru")  # --on-miss fetch: unchanged


def test_stats_table_fits_80():
    from moespec.cli.chat_cmd import _print_stats
    from moespec.runtime.stats import LayerStats, StepStats

    steps = []
    for _ in range(3):
        layers = {i: LayerStats(hits=3, misses=1, prefetched=4, prefetch_wasted=1, h2d_bytes=123_456_789,
                                stall_ms=1234.5, compute_ms=987.6, recall_hits=3, recall_total=4) for i in range(30)}
        steps.append(StepStats(kind="decode", tokens=1, wall_ms=100.0, layers=layers))
    from moespec.config import CachePolicy

    om = SimpleNamespace(recorder=SimpleNamespace(steps=steps), cache=SimpleNamespace(policy=CachePolicy.STATIC))
    session = SimpleNamespace(engine=SimpleNamespace(om=om), last=None)
    c = console()
    _print_stats(session, c)
    out = text_of(c)
    assert_fits(out)
    assert "per layer and token" in out and "123.457" in out and "1234.50" in out and "0.75" in out
    assert "static" in out  # the title names the cache policy


def test_train_estimator_bars_fit_80():
    from moespec.cli.estimator_cmd import _Bars

    c = console()
    with _Bars(c) as bars:
        bars.collect("collect", 123_456, 500_000)
        bars.collect("heldout", 50_000, 50_000)
        bars.train(12_345, 67_890, 0.123456, 0.8125)
    out = text_of(c)
    assert_fits(out)
    assert "123,456/500,000 tok" in out and "KL 0.1235 · recall 0.812" in out


def test_models_fits_80_and_lists_moespecs_own_first(fake_hub, hub_cache, tiny_models):  # noqa: F811
    from moespec.paths import DEFAULT_MODEL_FOLDER, models_dir

    assert runner.invoke(app, ["download", "tiny/qwen3-moe"]).exit_code == 0
    shutil.copytree(tiny_models["qwen2_moe"], models_dir() / DEFAULT_MODEL_FOLDER)
    res = runner.invoke(app, ["models"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert_fits(res.output)
    out = res.output
    assert out.index("moespec's models") < out.index(DEFAULT_MODEL_FOLDER) < out.index("Hub cache")
    assert "tiny/qwen3-moe" in out and "calib" in out and "estim" in out
    listed = {m["name"]: m for m in json.loads(runner.invoke(app, ["models", "--json"]).output)}
    assert listed[DEFAULT_MODEL_FOLDER]["path"] == str(models_dir() / DEFAULT_MODEL_FOLDER)


def test_a_built_model_is_found_by_its_name(tiny_models):
    from moespec.hub.resolve import resolve_model
    from moespec.paths import DEFAULT_MODEL_FOLDER, models_dir

    folder = models_dir() / DEFAULT_MODEL_FOLDER
    shutil.copytree(tiny_models["qwen2_moe"], folder)
    assert resolve_model(DEFAULT_MODEL_FOLDER) == folder


def test_the_default_name_before_the_build_says_how_to_build_it():
    from moespec.errors import ModelNotFoundError
    from moespec.hub.resolve import resolve_model
    from moespec.paths import DEFAULT_MODEL_FOLDER

    with pytest.raises(ModelNotFoundError) as exc:
        resolve_model(DEFAULT_MODEL_FOLDER)
    assert "moespec download --default" in exc.value.hint


def test_default_folder_name_matches_the_builder():
    from moespec.default_model import DEFAULT_MODEL_NAME
    from moespec.paths import DEFAULT_MODEL_FOLDER

    assert DEFAULT_MODEL_FOLDER == DEFAULT_MODEL_NAME


def test_binary_sizes_round_up_to_a_budget_that_suffices():
    from moespec.config import format_binary, parse_bytes

    for n in (1, 1023, 552_960 * 8, 3 * 2**30 + 1):
        assert parse_bytes(format_binary(n, round_up=True)) >= n
    assert format_binary(552_960 * 8) == "4.22MiB" and format_binary(8 * 2**30) == "8GiB"
