"""The default model's weights are checked against the XXH3-128 its build recorded (verify.py).

Only tiny folders in a tmp dir: the shared default model is never opened or written here.
"""

from __future__ import annotations

import json

import pytest

from moespec.default_model import build
from moespec.default_model.verify import DIGEST_FIELD, WEIGHTS_FILE, record_digest, start_check
from moespec.errors import CheckpointError
from moespec.integrity import file_digest


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A finished-looking build in the default model's place of a tmp MOESPEC_HOME: 3 MB of weights
    and a marker with their digest."""
    monkeypatch.setenv("MOESPEC_HOME", str(tmp_path / "home"))
    out = build.default_model_dir()
    out.mkdir(parents=True)
    (out / WEIGHTS_FILE).write_bytes(bytes(range(256)) * 12_000)
    marker = {"recipe_digest": build.recipe_digest(), "file_bytes": {WEIGHTS_FILE: 256 * 12_000}}
    build.write_marker(out, record_digest(out, marker))
    assert build.is_complete(out)
    return out


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_build_records_the_digest_of_the_weights(folder):
    marker = build.build_marker(folder)
    assert marker[DIGEST_FIELD] == {WEIGHTS_FILE: file_digest(folder / WEIGHTS_FILE)}
    check = start_check(folder)
    check.result()
    assert check.note is None and build.is_complete(folder)


@pytest.mark.parametrize("where", [0, 1_536_000, -1])
def test_a_flipped_byte_is_found_and_the_model_built_again(folder, where):
    _flip(folder / WEIGHTS_FILE, where)
    assert build.is_complete(folder)  # same size: the marker alone cannot tell
    with pytest.raises(CheckpointError, match="does not match its checksum") as exc:
        start_check(folder).result()
    assert "\n" not in exc.value.message and "built again" in exc.value.hint
    assert not build.is_complete(folder)  # the next start builds it again


def test_a_build_without_a_digest_is_trusted_once_not_rebuilt(folder):
    marker = build.build_marker(folder)
    del marker[DIGEST_FIELD]
    (folder / build.MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")  # as builds before this change
    check = start_check(folder)
    check.result()
    assert "recorded the checksum" in check.note and build.is_complete(folder)
    assert build.build_marker(folder)[DIGEST_FIELD][WEIGHTS_FILE] == file_digest(folder / WEIGHTS_FILE)
    again = start_check(folder)
    again.result()
    assert again.note is None
    _flip(folder / WEIGHTS_FILE, 10)  # from now on a flipped byte is found
    with pytest.raises(CheckpointError):
        start_check(folder).result()


def test_a_read_only_folder_without_a_digest_still_runs(folder, monkeypatch):
    marker = build.build_marker(folder)
    del marker[DIGEST_FIELD]
    (folder / build.MARKER_FILE).write_text(json.dumps(marker))

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(build, "write_marker", refuse)
    check = start_check(folder)
    check.result()
    assert "could not record" in check.note and build.is_complete(folder)


def _tiny_default(tiny_models, tmp_path, monkeypatch, with_digest: bool):
    """A tiny model placed as the default model of a tmp MOESPEC_HOME (never the shared one)."""
    import shutil

    monkeypatch.setenv("MOESPEC_HOME", str(tmp_path / "home"))
    folder = build.default_model_dir()
    shutil.copytree(tiny_models["qwen3_moe"], folder)
    marker = {"recipe_digest": build.recipe_digest(),
              "file_bytes": {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}}
    build.write_marker(folder, record_digest(folder, marker) if with_digest else marker)
    return folder


def test_open_model_checks_the_weights_before_the_first_token(tiny_models, tmp_path, monkeypatch):
    import io

    from rich.console import Console

    from moespec.chat.open_model import open_model
    from moespec.config import RuntimeConfig

    folder = _tiny_default(tiny_models, tmp_path, monkeypatch, with_digest=False)
    out = io.StringIO()
    open_model(None, RuntimeConfig(), Console(file=out, width=200)).close()  # first use: recorded
    assert "recorded the checksum" in out.getvalue()
    assert DIGEST_FIELD in build.build_marker(folder)
    out = io.StringIO()
    open_model(None, RuntimeConfig(), Console(file=out, width=200)).close()
    assert "checksum" not in out.getvalue()
    _flip(folder / WEIGHTS_FILE, (folder / WEIGHTS_FILE).stat().st_size - 5)
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        open_model(None, RuntimeConfig(), Console(file=io.StringIO()))
    assert not build.is_complete(folder)


def _damaged_default(tiny_models, tmp_path, monkeypatch):
    folder = _tiny_default(tiny_models, tmp_path, monkeypatch, with_digest=True)
    _flip(folder / WEIGHTS_FILE, (folder / WEIGHTS_FILE).stat().st_size - 5)
    return folder


@pytest.mark.parametrize("named", ["name", "path"])
def test_the_default_model_named_as_model_is_checked_too(tiny_models, tmp_path, monkeypatch, named):
    import io

    from rich.console import Console

    from moespec.chat.open_model import open_model
    from moespec.config import RuntimeConfig

    folder = _tiny_default(tiny_models, tmp_path, monkeypatch, with_digest=True)
    model = build.DEFAULT_MODEL_NAME if named == "name" else str(folder)
    open_model(model, RuntimeConfig(), Console(file=io.StringIO())).close()  # intact: runs
    _flip(folder / WEIGHTS_FILE, (folder / WEIGHTS_FILE).stat().st_size - 9)
    with pytest.raises(CheckpointError, match="does not match its checksum") as exc:
        open_model(model, RuntimeConfig(), Console(file=io.StringIO()))
    assert "built again" in exc.value.hint and not build.is_complete(folder)  # the next start rebuilds it
    from moespec.default_model import checked

    rebuilt = []
    monkeypatch.setattr(build, "ensure_default_model", lambda console=None: rebuilt.append(1) or folder)
    assert checked.resolve(model) == folder and rebuilt == [1]  # named, after the refusal: built again


def test_a_copy_of_the_build_elsewhere_is_refused_every_time(tiny_models, tmp_path, monkeypatch):
    import io
    import shutil

    from rich.console import Console

    from moespec.chat.open_model import open_model
    from moespec.config import RuntimeConfig

    copy = tmp_path / "copy"
    shutil.copytree(_tiny_default(tiny_models, tmp_path, monkeypatch, with_digest=True), copy)
    _flip(copy / WEIGHTS_FILE, (copy / WEIGHTS_FILE).stat().st_size - 3)
    for _ in range(2):  # nothing can build a copy again: its marker stays, so it is refused each time
        with pytest.raises(CheckpointError, match="does not match its checksum") as exc:
            open_model(str(copy), RuntimeConfig(), Console(file=io.StringIO()))
        assert "copy the folder again" in exc.value.hint
    assert build.build_marker(copy) is not None
    assert build.is_complete(build.default_model_dir())  # the built one is untouched


def test_other_model_folders_are_not_hashed(tiny_models):
    from moespec.default_model.verify import check_for

    assert check_for(tiny_models["qwen3_moe"]) is None  # no build marker: loaded as before


_COMMANDS = {
    "calibrate": ["--data", "{text}", "--tokens", "64", "--heldout-tokens", "32", "--seq-len", "32",
                  "--cache-experts", "4", "--threads", "1"],
    "train-estimator": ["--data", "{text}", "--tokens", "256", "--seq-len", "32", "--layers", "0",
                        "--out", "{tmp}/e.safetensors"],
    "profile": ["--device", "cpu", "--threads", "1", "--cache-experts", "4", "--strategies", "none",
                "--prompt-len", "6", "--gen", "2", "--repeats", "1", "--warmup", "0"],
    "chat": ["--prompt", "hi", "--max-new-tokens", "1", "--device", "cpu"],
    "eval": ["--data", "{tasks}", "--tasks", "quiz", "--arms", "exact", "--cache-experts", "4", "--device", "cpu",
             "--out", "{tmp}/out"],
}


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("command", list(_COMMANDS))
def test_every_command_that_loads_the_default_model_refuses_damaged_weights(tiny_models, tmp_path, monkeypatch,
                                                                           command, named):
    from typer.testing import CliRunner

    from moespec.cli.app import app

    folder = _damaged_default(tiny_models, tmp_path, monkeypatch)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "quiz.jsonl").write_text(json.dumps({
        "request_type": "loglikelihood", "doc_id": 0, "idx": 0, "label": 0, "doc": {},
        "request": {"context": "Is the sky blue?", "continuation": " yes"}}) + "\n")
    args = [a.format(text=text, tmp=tmp_path, tasks=tasks) for a in _COMMANDS[command]]
    model = [build.DEFAULT_MODEL_NAME] if named or command == "eval" else []  # eval always takes MODEL
    res = CliRunner().invoke(app, [command, *model, *args], env={"COLUMNS": "200"})
    assert res.exit_code != 0, res.output
    out = " ".join(res.output.split())
    assert f"default model weights {folder / WEIGHTS_FILE}" in out and "does not match its checksum" in out, out
    assert "Traceback" not in res.output
    assert not build.is_complete(folder)  # marker removed: the next start builds it again
