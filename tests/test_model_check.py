"""A model folder whose config.json or tokenizer is broken: one line naming the file and the field,
before the weights load (chat, calibrate, train-estimator)."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from moespec.cli.app import app

runner = CliRunner()


def _edit_config(**fields):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        config.update(fields)
        (folder / "config.json").write_text(json.dumps(config))

    return edit


def _drop_tokenizer(folder):
    for p in folder.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            p.unlink()


CASES = {  # name -> (how the folder is broken, what the error line must say)
    "top_k_above_experts": (_edit_config(num_experts_per_tok=99), "num_experts_per_tok 99 must be a whole number from 1 to"),
    "top_k_zero": (_edit_config(num_experts_per_tok=0), "num_experts_per_tok 0 must be a whole number from 1 to"),
    "top_k_not_a_number": (_edit_config(num_experts_per_tok="2"), "num_experts_per_tok '2' must be a whole number"),
    "invalid_config_json": (lambda f: (f / "config.json").write_text("{not json"), "config.json is not valid JSON"),
    "config_not_an_object": (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json is not a JSON object"),
    "integer_dtype": (_edit_config(dtype="int8"), "dtype 'int8' is not a float dtype"),
    "no_tokenizer_files": (_drop_tokenizer, "has no tokenizer files"),
    "truncated_tokenizer_json": (lambda f: (f / "tokenizer.json").write_text((f / "tokenizer.json").read_text()[:60]),
                                 "truncated or not valid JSON"),
    "missing_tokenizer_json": (lambda f: (f / "tokenizer.json").unlink(), "cannot load the tokenizer"),
}


@pytest.fixture(scope="module")
def broken(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    out = {}
    for name, (edit, _) in CASES.items():
        folder = root / name
        shutil.copytree(tiny_models["qwen3_moe"], folder)
        edit(folder)
        out[name] = folder
    return out


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith("error:")]
    return line


@pytest.mark.parametrize("case", sorted(CASES))
def test_chat_names_the_fault_in_one_line(broken, case, monkeypatch):
    import moespec.runtime.load as offload

    real = offload._load_weights
    if "tokenizer" in case:  # a tokenizer fault is said before a single weight is read
        monkeypatch.setattr(offload, "_load_weights", lambda *a, **k: pytest.fail("weights read first"))
    line = _one_error_line(runner.invoke(app, ["chat", str(broken[case]), "--prompt", "hi", "--max-new-tokens", "2"]))
    assert CASES[case][1] in line
    monkeypatch.setattr(offload, "_load_weights", real)


@pytest.mark.parametrize("command", [["calibrate", "--tokens", "64", "--seq-len", "16"],
                                     ["train-estimator", "--tokens", "64", "--seq-len", "16"]])
@pytest.mark.parametrize("case", ["invalid_config_json", "no_tokenizer_files", "truncated_tokenizer_json"])
def test_commands_that_read_text_name_the_fault_before_loading(broken, case, command, tmp_path):
    args = [command[0], str(broken[case]), *command[1:], "--out", str(tmp_path / "out.safetensors")]
    assert CASES[case][1] in _one_error_line(runner.invoke(app, args))


def test_an_explicit_float_dtype_overrides_a_non_float_config_dtype(broken):
    r = runner.invoke(app, ["chat", str(broken["integer_dtype"]), "--dtype", "float32", "--prompt", "hi",
                            "--max-new-tokens", "2"])
    assert r.exit_code == 0, r.output
