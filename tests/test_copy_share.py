"""``moespec profile --copy-share``: an unthrottled on-demand probe sets the emulated link so on-demand
copies are the asked share of on-demand TPOT; the report records the probe, the link and the share
reached; bad values are one-line errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moespec.cli.app import app
from moespec.profile.copy_share import CopyShare
from moespec.profile.schema import validate


def test_the_link_follows_from_the_probe():
    # T0 = 10 ms, 2 MB/token, share 0.75: copies must take 30 ms, so 2e6 B / 0.03 s = 0.0667 GB/s.
    from moespec.profile.copy_share import set_share

    class _Engine:
        link_gbps = None

    class _Cache:
        engine = _Engine()

    class _Om:
        cache = _Cache()

    class _L:
        h2d_bytes = 1_000_000

    class _Step:
        wall_ms = 10.0
        layers = {0: _L(), 1: _L()}

    om = _Om()
    share = set_share(om, 0.75, [_Step(), _Step()])
    assert share.link_gbps == pytest.approx(2e6 / 0.030 / 1e9)
    assert om.cache.engine.link_gbps == share.link_gbps
    assert CopyShare(0.75, 10.0, 2e6, 1.0).reached(40.0) == pytest.approx(0.75)


def test_profile_reports_the_share(tmp_path):
    from tiny import make_checkpoint

    model = make_checkpoint(tmp_path / "q3", "qwen3_moe", layers=2, experts=8, top_k=2)
    res = CliRunner().invoke(app, ["profile", str(model), "--device", "cpu", "--threads", "1", "--cache-experts", "4",
                                   "--strategies", "none,oracle", "--prompt-len", "6", "--gen", "4", "--repeats", "1",
                                   "--warmup", "0", "--copy-share", "0.75", "--out", str(tmp_path / "r.json")],
                             env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert "share asked 0.75" in res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert validate(rep) == []
    share = rep["copy_share"]
    assert share["asked"] == 0.75 and share["probe_tpot_ms"] > 0 and share["bytes_per_token"] > 0
    assert rep["link"]["emulated_gbps"] == pytest.approx(share["link_gbps"])
    assert 0.0 < share["reached"]["6"] < 1.0  # measured, not asserted to a timing
    by = {r["strategy"]: r for r in rep["results"]}
    assert by["none"]["gate"] is None  # nothing predicts
    # the token start (TOKEN_START, -1: it predicts the first layer) and the layer that predicts the last
    assert [g["layer"] for g in by["oracle"]["gate"]] == [-1, 0]
    assert all(g["ran"] >= 1 and "why" in g for g in by["oracle"]["gate"])


@pytest.mark.parametrize("args, says", [
    (["--copy-share", "1.5"], "--copy-share 1.5 must be a finite number > 0 and < 1"),  # cli/ranges.py
    (["--copy-share", "0.5", "--device", "cuda"], "needs the emulated link"),
])
def test_bad_shares_are_one_line_errors(tmp_path, args, says):
    res = CliRunner().invoke(app, ["profile", str(tmp_path / "nowhere"), *args])
    assert res.exit_code != 0 and says in res.output and "Traceback" not in res.output
