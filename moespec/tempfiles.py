"""Temp folders of atomic writes and the locks that tell a live write from a killed one's leftovers.

Every atomic write (``moespec.fsutil.atomic_path``) works inside a temp folder named after its
target, ``.NAME.XXXXXXXX.tmp`` beside ``NAME``, and holds an exclusive ``flock`` on that folder
while it writes. The kernel drops a lock with its process, so after a SIGKILL a temp whose lock can
be taken is a leftover, while the files of a process that is still writing are never touched. The
next write of the same target sweeps its own leftovers (:func:`sweep_target`); what else is left
and ``moespec models --clean`` live in moespec.cleanup. No moespec imports: fsutil builds on it.

Older moespec wrote safetensors files straight beside the target, where safetensors makes its own
``.tmpXXXXXX``; those carry no lock and are swept only in moespec's own folders, once an hour old.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; leftovers are then recognised by age only
    fcntl = None  # type: ignore[assignment]

# mkdtemp/mkstemp put 8 characters of [a-z0-9_] between the prefix and the suffix.
ATOMIC_TEMP = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")
# safetensors (Rust's tempfile crate) names its temp ".tmp" + 6 alphanumerics, beside the target.
SAFETENSORS_TEMP = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")
UNLOCKED_MIN_AGE_S = 3600.0  # a temp without a lock is a leftover only when no live write can own it


def temp_name(target: Path) -> tuple[str, str]:
    """(prefix, suffix) of the temp folder of ``target``: ``.NAME.`` and ``.tmp``."""
    return f".{target.name}.", ".tmp"


@contextlib.contextmanager
def held(path: Path) -> Iterator[bool]:
    """Try to take the exclusive lock of ``path`` (a file or folder) without waiting.

    Yields True while it is held (nobody else writes ``path``), False when another process holds
    it or ``path`` cannot be opened. Without ``fcntl`` it yields True.
    """
    if fcntl is None:
        yield True
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing drops the lock


def lock_fd(path: Path) -> int | None:
    """Open ``path`` and take its exclusive lock (waiting for it); the caller closes the fd to release it."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def size_of(path: Path) -> int:
    """Bytes of ``path``: a file's size, a folder's files summed (links not followed)."""
    try:
        if path.is_symlink() or not path.is_dir():
            return path.lstat().st_size
    except OSError:
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def remove(path: Path) -> None:
    """Delete a file or a folder tree (missing is fine)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _old(path: Path, min_age_s: float) -> bool:
    try:
        return time.time() - path.lstat().st_mtime >= min_age_s
    except OSError:
        return False


def stale_temps(folder: Path, target_name: str | None = None, legacy: bool = False) -> list[Path]:
    """Temp entries in ``folder`` that no live write owns.

    Args:
        folder: where to look (not recursive).
        target_name: only the temps of this target (``.NAME.XXXXXXXX.tmp``); None = every atomic temp.
        legacy: also the lock-less ``.tmpXXXXXX`` of older moespec, once an hour old; only for a
            folder that is moespec's own (a user's folder may hold such names of its own).
    """
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    out = []
    for p in entries:
        name = p.name
        if target_name is not None:
            prefix, suffix = temp_name(folder / target_name)
            mine = name.startswith(prefix) and name.endswith(suffix) and ATOMIC_TEMP.match(name)
        else:
            mine = ATOMIC_TEMP.match(name)
        if mine:
            with held(p) as free:
                if free:
                    out.append(p)
        elif SAFETENSORS_TEMP.match(name) and legacy and _old(p, UNLOCKED_MIN_AGE_S):
            out.append(p)
    return out


def sweep_target(target: Path) -> int:
    """Remove the leftovers of earlier writes of ``target`` (called by every atomic write); bytes freed."""
    freed = 0
    for p in stale_temps(Path(target).parent, Path(target).name):
        freed += size_of(p)
        remove(p)
    return freed


def download_lock_free(lock: Path) -> bool:
    """True when no process holds huggingface_hub's download lock file ``lock`` (or it does not exist)."""
    if not lock.exists():
        return True
    with held(lock) as free:
        return free
