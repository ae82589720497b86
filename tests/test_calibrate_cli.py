"""`moespec calibrate` through Typer's CliRunner, then `moespec chat --predictor quasi` on its file."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from moespec.artifacts import default_calibration_path
from moespec.predict.calibration_file import load_calibration
from moespec.cli.app import app

runner = CliRunner()


@pytest.fixture()
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    return path


def test_calibrate_writes_the_file_chat_finds(tiny_models, text_file):
    folder = tiny_models["qwen3_moe"]
    res = runner.invoke(app, ["calibrate", str(folder), "--data", str(text_file), "--tokens", "300",
                              "--heldout-tokens", "64", "--seq-len", "32", "--cache-experts", "4", "--threads", "1"])
    assert res.exit_code == 0, res.output
    target = default_calibration_path(folder)
    assert f"wrote {target}" in res.output.replace("\n", "")
    assert "mean recall@2: router" in res.output and "per 100k tokens" in res.output
    assert "cache hit rate on-demand" in res.output
    for policy in ("lru", "lfu", "lfru", "static"):  # a row with three rates in [0, 1]
        assert re.search(rf"│ {policy} +│ +[01]\.\d{{3}} │ +[01]\.\d{{3}} │ +[01]\.\d{{3}} │", res.output), policy
    calib = load_calibration(target)
    assert calib.meta["tokens"] == 300 and str(text_file) in calib.meta["data"]

    res = runner.invoke(app, ["chat", str(folder), "--predictor", "quasi", "--prompt", "hi", "--max-new-tokens", "3", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1])["stats"]["recall"] is not None
    # with the file, the seeded cache policies load (and name themselves in the chat header)
    res = runner.invoke(app, ["chat", str(folder), "--cache-policy", "static", "--cache-experts", "8",
                              "--prompt", "hi", "--max-new-tokens", "2"])
    assert res.exit_code == 0, res.output
    assert "cache policy static" in res.output.replace("\n", " ") and "ms/tok · static" in res.output


def test_calibrate_with_the_builtin_text(tiny_models, tmp_path):
    out = tmp_path / "c.safetensors"
    res = runner.invoke(app, ["calibrate", str(tiny_models["olmoe"]), "--tokens", "64", "--heldout-tokens", "32",
                              "--seq-len", "32", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "public domain" in load_calibration(out).meta["data"]


def test_tokens_beyond_the_data_are_used_and_said(tiny_models, text_file, tmp_path):
    out = tmp_path / "c.safetensors"
    res = runner.invoke(app, ["calibrate", str(tiny_models["olmoe"]), "--data", str(text_file), "--tokens", "100000",
                              "--seq-len", "64", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "fewer than --tokens 100000" in res.output
    assert out.is_file()


@pytest.mark.parametrize("args,match", [
    (["--data", "{empty}"], "holds no text"),
    (["--data", "{missing}"], "does not exist"),
    (["--data", "{text}", "--seq-len", "4000"], "fewer than two chunks"),
    (["--data", "{text}", "--out", "{blocked}"], "cannot write"),
])
def test_bad_input_exits_2_with_a_message(tiny_models, text_file, tmp_path, args, match):
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "blocker").write_text("a file", encoding="utf-8")
    names = {"empty": tmp_path / "empty.txt", "missing": tmp_path / "missing.txt", "text": text_file,
             "blocked": tmp_path / "blocker" / "c.safetensors"}
    res = runner.invoke(app, ["calibrate", str(tiny_models["olmoe"])] + [a.format(**names) for a in args])
    assert res.exit_code == 2, res.output
    assert match in res.output.replace("\n", " ")


def test_ctrl_c_leaves_no_partial_file(tiny_models, text_file, tmp_path, monkeypatch):
    from moespec.runtime.engine import Engine

    calls = {"n": 0}
    forward = Engine.forward

    def interrupted(self, ids, kind):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return forward(self, ids, kind)

    monkeypatch.setattr(Engine, "forward", interrupted)
    out_dir = tmp_path / "out"
    res = runner.invoke(app, ["calibrate", str(tiny_models["olmoe"]), "--data", str(text_file), "--tokens", "200",
                              "--seq-len", "32", "--out", str(out_dir / "c.safetensors")])
    assert res.exit_code == 130, res.output
    assert "nothing partial" in res.output
    assert list(out_dir.iterdir()) == []
