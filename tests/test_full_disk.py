"""A full disk: one line naming the path, the bytes needed and free, said before the work; a cache
that cannot be written (the quantised store) is skipped with a note.

The disk is a real 4 KiB tmpfs where this test may mount one (root); elsewhere (CI) a folder whose
free space reads as 4 KiB and where safetensors fails with its own ENOSPC error past that
(``MOESPEC_TEST_NO_TMPFS=1`` runs that fallback here).
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from typer.testing import CliRunner

from moespec.cli.app import app
from moespec.errors import OutputError

runner = CliRunner()
SMALL = 4096


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    folder = tmp_path / "disk"
    folder.mkdir()
    try:
        if os.environ.get("MOESPEC_TEST_NO_TMPFS"):  # run the fallback where mount would work
            raise OSError
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL}", "tmpfs", str(folder)],
                                 capture_output=True).returncode == 0
    except OSError:  # no mount program
        mounted = False
    if not mounted:
        _inject_enospc(folder, monkeypatch)
    yield folder
    if mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _inject_enospc(folder, monkeypatch):
    import shutil as shutil_mod

    import safetensors.torch as st
    from safetensors import SafetensorError

    real_usage, real_save = shutil_mod.disk_usage, st.save_file

    def usage(path):
        u = real_usage(path)
        return type(u)(u.total, u.total - SMALL, SMALL) if str(path).startswith(str(folder)) else u

    def save_file(tensors, filename, metadata=None):
        if str(filename).startswith(str(folder)) and sum(t.numel() * t.element_size() for t in tensors.values()) > SMALL:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(shutil_mod, "disk_usage", usage)
    monkeypatch.setattr(st, "save_file", save_file)


def _files(folder):
    return sorted(p.name for p in folder.rglob("*"))


def test_a_file_larger_than_the_free_space_is_refused_before_writing(small_disk):
    from moespec.fsutil import save_safetensors_atomic

    with pytest.raises(OutputError) as err:
        save_safetensors_atomic(small_disk / "big.safetensors", {"x": torch.zeros(2**18)}, {}, "m")
    msg = err.value.message
    assert msg.startswith("disk full:") and str(small_disk / "big.safetensors") in msg
    assert "needs 1.11 MB" in msg and "free" in msg and "\n" not in msg
    assert _files(small_disk) == []


def test_safetensors_own_disk_full_error_becomes_one_line(small_disk):
    from safetensors.torch import save_file

    from moespec.fsutil import atomic_path

    with pytest.raises(OutputError, match="^disk full: .*big.safetensors"):
        with atomic_path(small_disk / "big.safetensors") as tmp:  # no size given: the write itself fails
            save_file({"x": torch.zeros(2**18)}, str(tmp))
    assert _files(small_disk) == []


def test_the_quantised_store_on_a_full_disk_is_skipped_with_a_note(small_disk, tiny_models, monkeypatch):
    monkeypatch.setenv("MOESPEC_HOME", str(small_disk))
    r = runner.invoke(app, ["chat", str(tiny_models["qwen3_moe"]), "--expert-dtype", "int4", "--prompt", "hi",
                            "--max-new-tokens", "3", "--cache-experts", "4"])
    assert r.exit_code == 0, r.output
    notes = [line for line in r.output.splitlines() if "not cached" in line]
    assert len(notes) == 1 and "disk full" in notes[0] and "TPOT" in r.output
    assert not [n for n in _files(small_disk) if n.endswith((".tmp", ".safetensors"))]


def test_the_gguf_dense_cache_on_a_full_disk_is_skipped_with_a_note(small_disk):
    from moespec.gguf.dense_cache import DenseCacheWriter

    writer = DenseCacheWriter(small_disk / "dense-float32.safetensors", [("w", torch.float32, (64, 64))],
                              torch.float32, [["m.gguf", 1, 2]])
    writer.write("w", torch.ones(64, 64))
    writer.finish()
    assert writer.note is not None and "disk full" in writer.note and "\n" not in writer.note
    assert _files(small_disk) == []


def test_calibrate_refuses_a_full_disk_before_the_run(small_disk, tiny_models, monkeypatch):
    import moespec.cli.calibrate_cmd as cmd

    monkeypatch.setattr(cmd, "_run_with_progress", lambda *a: pytest.fail("calibrated although it cannot be saved"))
    r = runner.invoke(app, ["calibrate", str(tiny_models["qwen3_moe"]), "--out", str(small_disk / "c.safetensors"),
                            "--tokens", "64", "--seq-len", "16"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    (line,) = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert "disk full" in line and "c.safetensors" in line and "needs" in line


def test_train_estimator_refuses_a_full_disk_before_collecting(small_disk, tiny_models, monkeypatch):
    import moespec.estimator.collect as collect

    monkeypatch.setattr(collect, "run_collection", lambda *a, **k: pytest.fail("collected without room"))
    r = runner.invoke(app, ["train-estimator", str(tiny_models["qwen3_moe"]), "--states-dir", str(small_disk / "s"),
                            "--tokens", "256", "--seq-len", "32", "--layers", "0", "--out",
                            str(small_disk.parent / "e.safetensors")])
    assert r.exit_code == 2 and "disk full" in r.output and "Traceback" not in r.output
    assert not (small_disk / "s").exists() or _files(small_disk / "s") == []


def test_download_refuses_a_full_disk_before_any_byte_moves(small_disk, fake_hub, hub_cache):
    r = runner.invoke(app, ["download", "tiny/qwen3-moe", "--local-dir", str(small_disk / "m")])
    assert r.exit_code == 2 and "disk full" in r.output and "Traceback" not in r.output
    assert not [q for q in fake_hub.requests if q.role == "cdn"]


from hub_fake_server import fake_hub, hub_cache  # noqa: E402,F401  (fixtures)
