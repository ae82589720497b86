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

from moespec import cleanup
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
    assert cleanup.stale_temps(folder) == [p for p in left if p.name.endswith(".tmp")]  # its lock died with it

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
    assert left and sum(cleanup.size_of(p) for p in left) > 2**20
    assert not list(folder.glob(".tmp*"))  # nothing beside the target: all inside the locked folder
    WRITERS["quant_store"][0](folder / "int4-g64.safetensors")
    assert _temps(folder) == []


def test_a_live_write_is_never_swept(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    from moespec.fsutil import atomic_path

    with atomic_path(folder / "a.json") as tmp:
        tmp.write_text("{}")
        assert cleanup.stale_temps(folder) == []  # locked by this write
        assert cleanup.sweep_target(folder / "a.json") == 0 and tmp.is_file()
    assert _temps(folder) == []


def test_ctrl_c_inside_a_write_leaves_nothing(tmp_path):
    from moespec.fsutil import atomic_path

    with pytest.raises(KeyboardInterrupt):
        with atomic_path(tmp_path / "a.safetensors") as tmp:
            from safetensors.torch import save_file

            save_file({"x": torch.zeros(4)}, str(tmp))
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
