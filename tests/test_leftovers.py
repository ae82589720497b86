"""Interrupted writes leave nothing that the next run of the same writer does not remove.

Each writer runs in a subprocess that a killer SIGKILLs once the temp files of the chosen moment
are on disk (tests/writers.py); then the same writer runs again here and must leave exactly its
target. ``moespec models --clean`` finds the same leftovers and removes them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from moespec import cleanup, tempfiles
from writers import WRITERS

def _temps(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.startswith(".")) if folder.is_dir() else []


def _written(temp: Path) -> bool:
    """``temp`` (``.NAME.XXXXXXXX.tmp``) holds NAME complete: safetensors' own temp is renamed already."""
    name = temp.name[1:].rsplit(".", 2)[0]
    try:
        return (temp / name).stat().st_size > 0 and not any(q.name.startswith(".tmp") for q in temp.iterdir())
    except OSError:
        return False


def _kill_when(folder: Path, writer: str, moment: str, mb: float, ready) -> None:
    """Run ``writer`` in a forked child (torch already imported: no start-up cost) and SIGKILL it once
    ``ready(folder)`` holds (polled every millisecond)."""
    import writers

    target = folder / WRITERS[writer][1]
    pid = os.fork()
    if pid == 0:  # the child: write, stopping at ``moment``; never returns into pytest
        try:
            writers.main(writer, str(target), moment, str(mb))
        finally:
            os._exit(0)
    deadline = time.monotonic() + 60
    try:
        while not ready(folder):
            done, _status = os.waitpid(pid, os.WNOHANG)
            if done:
                pytest.fail(f"{writer} ended before it could be killed")
            assert time.monotonic() < deadline, "the temp files never appeared"
            time.sleep(0.001)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("moment", ["locked", "written"])
def test_a_killed_write_is_swept_by_the_next_write_of_the_same_file(tmp_path, writer, moment):
    folder = tmp_path / "out"
    folder.mkdir()
    name = WRITERS[writer][1]

    if writer == "build_checkpoint":  # a build's state folder exists before its layers are written
        from moespec.default_model.checkpoints import LayerCheckpoints

        LayerCheckpoints(folder, "digest").open()

    def ready(f: Path) -> bool:
        temps = [p for p in _temps(f) if p.name.endswith(".tmp")]
        return bool(temps) if moment == "locked" else any(_written(t) for t in temps)

    _kill_when(folder, writer, moment, 0.01, ready)
    left = _temps(folder)
    assert left and not (folder / name).exists()  # the kill really left something behind
    assert tempfiles.stale_temps(folder) == [p for p in left if p.name.endswith(".tmp")]  # its lock died with it

    WRITERS[writer][0](folder / name)  # the next run of the same writer
    assert _temps(folder) == [] and (folder / name).is_file()
    assert (folder / name).stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_kill_while_safetensors_writes_its_own_temp_is_swept_too(tmp_path):
    """The issue's int4-store case: killed inside safetensors' write, which makes a `.tmpXXXXXX`
    of its own; it lies inside moespec's temp folder, so one sweep takes both."""
    folder = tmp_path / "experts"
    folder.mkdir()

    def safetensors_writing(f: Path) -> bool:
        return any(q.name.startswith(".tmp") and q.stat().st_size > 2**20
                   for t in _temps(f) if t.is_dir() for q in t.iterdir())

    for mb in (256, 1024):  # a fast disk may finish 256 MB before the kill lands: then a larger one
        _kill_when(folder, "quant_store", "writing", mb, safetensors_writing)
        if not (folder / "int4-g64.safetensors").exists():
            break
        (folder / "int4-g64.safetensors").unlink()
    left = _temps(folder)
    assert left and sum(tempfiles.size_of(p) for p in left) > 2**20
    assert not list(folder.glob(".tmp*"))  # nothing beside the target: all inside the locked folder
    WRITERS["quant_store"][0](folder / "int4-g64.safetensors")
    assert _temps(folder) == []


def test_a_live_write_is_never_swept(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    from moespec.fsutil import atomic_path

    with atomic_path(folder / "a.json") as tmp:
        tmp.write_text("{}")
        assert tempfiles.stale_temps(folder) == []  # locked by this write
        assert tempfiles.sweep_target(folder / "a.json") == 0 and tmp.is_file()
    assert _temps(folder) == []


def test_ctrl_c_inside_a_write_leaves_nothing(tmp_path):
    from moespec.fsutil import atomic_path

    with pytest.raises(KeyboardInterrupt):
        with atomic_path(tmp_path / "a.safetensors") as tmp:
            from safetensors.torch import save_file

            save_file({"x": torch.zeros(4)}, str(tmp))
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_models_clean_finds_every_kind_of_leftover_and_spares_live_writes(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from moespec.cli.app import app

    home = tmp_path / "home"
    monkeypatch.setenv("MOESPEC_HOME", str(home))
    experts = home / "experts" / "m"
    experts.mkdir(parents=True)
    _kill_when(experts, "quant_store", "written", 0.01, lambda f: any(_written(t) for t in _temps(f)))
    states = home / "estimator-states" / "m"
    states.mkdir(parents=True)
    (states / "train-00000.safetensors").write_bytes(b"x" * 1000)  # a collection killed before its manifest
    kept = home / "estimator-states" / "kept"
    kept.mkdir()
    (kept / "manifest.json").write_text("{}")  # finished states kept with --keep-states: not leftovers
    build = home / "models" / ".smollm2-135m-moe-e16k4.build-abc123"
    build.mkdir(parents=True)
    (build / "model.safetensors").write_bytes(b"y" * 500)
    live = tempfiles.lock_fd(states)  # a collection that runs now is never touched ...
    try:
        found = {p.path for p in cleanup.find_leftovers(home, tmp_path / "no-hub")}
        assert states not in found and build in found and any(p.parent == experts for p in found)
    finally:
        os.close(live)
    leftovers = cleanup.find_leftovers(home, tmp_path / "no-hub")  # ... until it is gone
    assert {p.kind for p in leftovers} == {"temp file of an interrupted write", "estimator states of an interrupted "
                                           "collection", "temp folder of an interrupted default-model build"}
    r = CliRunner().invoke(app, ["models"])
    assert "reclaimable" in r.output and "moespec models --clean" in r.output
    r = CliRunner().invoke(app, ["models", "--clean", "--json"])
    import json

    report = json.loads(r.stdout)
    assert report["freed_bytes"] == sum(p.bytes for p in leftovers) and report["freed_bytes"] > 1500
    assert _temps(experts) == [] and not states.exists() and not build.exists() and kept.is_dir()
    assert cleanup.find_leftovers(home, tmp_path / "no-hub") == []


def test_ctrl_c_in_train_estimator_leaves_no_states(tiny_models, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import moespec.estimator.collect as collect
    from moespec.cli.app import app

    real = collect.run_collection

    def interrupt_after_one_shard(om, chunks, observer, collector, stage, progress=None):
        real(om, chunks[:1], observer, collector, stage, progress)
        collector.writer.flush()  # one shard on disk, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(collect, "run_collection", interrupt_after_one_shard)
    folder = tmp_path / "states"
    r = CliRunner().invoke(app, ["train-estimator", str(tiny_models["qwen3_moe"]), "--states-dir", str(folder),
                                 "--tokens", "128", "--seq-len", "32", "--layers", "0", "--keep-states",
                                 "--out", str(tmp_path / "e.safetensors")])
    assert r.exit_code == 130 and "nothing partial was written" in r.output
    assert not folder.exists() or list(folder.iterdir()) == []  # the shard went too, even with --keep-states
