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
def folder(tmp_path):
    """A finished-looking build: 3 MB of weights and a marker with their digest."""
    out = tmp_path / "model"
    out.mkdir()
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
