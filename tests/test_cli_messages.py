"""Help and messages a newcomer reads: flags shown as flags, true help, one minimum stated in experts and
MiB, only the choices a command accepts, and missing files refused before the model loads."""

from __future__ import annotations

import re
import shutil

import pytest
from typer.testing import CliRunner

import moespec
from moespec.cli.app import app

runner = CliRunner()
COMMANDS = ["chat", "download", "models", "calibrate", "train-estimator", "profile"]


def _run(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "80", **(env or {})})


@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS)])
def test_help_shows_flags_without_a_type(command):
    res = _run(*command, "--help")
    assert res.exit_code == 0, res.output
    assert "<bool>" not in res.output
    assert "--help" in res.output


def test_version():
    res = _run("--version")
    assert res.exit_code == 0 and res.output.strip() == f"moespec {moespec.__version__}"


def test_plot_help_names_the_extra():
    out = re.sub(r"[\s│]+", " ", _run("profile", "--help").output)
    assert "pip install 'moespec[plot]'" in out


def test_download_default_does_not_claim_no_network():
    out = _run("download", "--help").output
    assert "no network" not in out and "PyPI" in out


@pytest.mark.parametrize("value", ["0", "1", "3"])
def test_every_too_small_cache_gets_the_same_minimum(tiny_models, value):
    res = _run("chat", tiny_models["qwen3_moe"], "-p", "hi", "--device", "cpu", "--cache-experts", value)
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    # top-2 with prefetch: 4 experts of 6 KiB (qwen3_moe tiny: 3 x 32 x 16 float32 = 6,144 bytes)
    assert f"--cache-experts {value} is below the minimum of 4 experts = 24KiB" in text
    assert "use --cache-experts 4 or --gpu-memory 24KiB or more, or --predictor none (minimum 2)" in text
    assert "bytes" not in text


def test_a_too_small_gpu_memory_is_said_in_binary_units(tiny_models):
    res = _run("chat", tiny_models["qwen3_moe"], "-p", "hi", "--device", "cpu", "--gpu-memory", "10KiB")
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    assert "--gpu-memory 10KiB (room for 1 experts of 6KiB) is below the minimum of 4 experts = 24KiB" in text


def test_chat_lists_only_the_predictors_it_runs(tiny_models):
    for value in ("foo", "oracle"):
        res = _run("chat", tiny_models["qwen3_moe"], "-p", "hi", "--predictor", value)
        assert res.exit_code == 2
        assert "none, router, quasi, estimator, hybrid" in res.output and "oracle," not in res.output
    assert "moespec profile" in _run("chat", tiny_models["qwen3_moe"], "-p", "hi", "--predictor", "oracle").output


def test_profile_still_offers_the_oracle(tiny_models):
    res = _run("profile", tiny_models["qwen3_moe"], "--strategies", "foo")
    assert res.exit_code == 2 and "oracle" in res.output


@pytest.mark.parametrize("command,predictor,needle", [
    ("chat", "quasi", "moespec calibrate"),
    ("chat", "hybrid", "moespec train-estimator"),
    ("profile", "quasi", "moespec calibrate"),
    ("profile", "estimator", "moespec train-estimator"),
])
def test_a_missing_file_is_refused_before_the_model_loads(tiny_models, tmp_path, monkeypatch, command, predictor,
                                                          needle):
    import moespec.runtime.load as offload

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the missing file was reported")

    monkeypatch.setattr(offload, "load_offloaded", no_load)
    folder = tmp_path / "m"
    shutil.copytree(tiny_models["qwen3_moe"], folder)
    flag = ["--predictor", predictor, "-p", "hi"] if command == "chat" else ["--strategies", f"none,{predictor}"]
    res = _run(command, folder, *flag)
    assert res.exit_code == 2, res.output
    assert needle in res.output and "AssertionError" not in res.output


def test_a_missing_explicit_calibration_names_the_path_with_a_tilde(tiny_models, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    res = _run("chat", tiny_models["qwen3_moe"], "-p", "hi", "--predictor", "quasi", "--calibration",
               str(tmp_path / "c.safetensors"))
    assert res.exit_code == 2
    assert "calibration file ~/c.safetensors does not exist" in " ".join(res.output.split())


def test_the_default_calibration_has_no_note_on_the_shipped_data(tiny_models, tmp_path):
    # the shipped text holds fewer tokens than the default --tokens; asked for nothing, told nothing
    res = _run("calibrate", tiny_models["olmoe"], "--seq-len", "256", "--out", tmp_path / "c.safetensors",
               "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "note:" not in res.output and "fewer than" not in res.output


@pytest.mark.parametrize("cores,expected", [(1, 1), (2, 1), (16, 15)])
def test_default_threads_leave_a_core_to_the_copy_worker(monkeypatch, cores, expected):
    from moespec.cli import common

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(common.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert common.default_threads() == expected


def test_omp_num_threads_wins_over_the_default(monkeypatch):
    from moespec.cli import common

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert common.default_threads() is None
