"""What interrupted writes leave behind, how moespec recognises it, and how it is swept.

Every atomic write (``moespec.fsutil.atomic_path``) works inside a temp folder named after its
target, ``.NAME.XXXXXXXX.tmp`` beside ``NAME``, and holds an exclusive ``flock`` on that folder
while it writes. Writers that are not single files hold the same kind of lock on what they write
(estimator states: their folder; the default-model build: ``models/.NAME.lock``; a Hub download:
huggingface_hub's ``.locks/<repo>/<etag>.lock``). The kernel drops a lock with its process, so
after a SIGKILL anything whose lock can be taken is a leftover, while the files of a process that
is still writing are never touched. The next run of the same writer sweeps its own leftovers
(:func:`sweep_target`); ``moespec models --clean`` sweeps all of them (:func:`find_leftovers`).

Older moespec wrote safetensors files straight beside the target, where safetensors makes its own
``.tmpXXXXXX``; those carry no lock and are swept only inside moespec's home, once an hour old.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Leftover:
    """A file or folder an interrupted write left behind.

    Attributes:
        path: the file or folder.
        bytes: its size on disk (a folder: every file in it).
        kind: what wrote it, as `moespec models --clean` names it.
    """

    path: Path
    bytes: int
    kind: str


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


def _under_home(folder: Path) -> bool:
    from moespec.paths import moespec_home

    try:
        folder.resolve().relative_to(moespec_home().resolve())
        return True
    except (ValueError, OSError):
        return False


def stale_temps(folder: Path, target_name: str | None = None) -> list[Path]:
    """Temp entries in ``folder`` that no live write owns.

    Args:
        folder: where to look (not recursive).
        target_name: only the temps of this target (``.NAME.XXXXXXXX.tmp``); None = every atomic temp.
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
        elif SAFETENSORS_TEMP.match(name) and _old(p, UNLOCKED_MIN_AGE_S) and _under_home(folder):
            out.append(p)
    return out


def sweep_target(target: Path) -> int:
    """Remove the leftovers of earlier writes of ``target`` (called by every atomic write); bytes freed."""
    freed = 0
    for p in stale_temps(Path(target).parent, Path(target).name):
        freed += size_of(p)
        remove(p)
    return freed


def find_leftovers(home: Path | None = None, hub_cache: Path | None = None) -> list[Leftover]:
    """Everything under moespec's home and in the Hub cache that interrupted writes left behind.

    Only what no running process holds: atomic-write temps, estimator states of a collection that
    never wrote its manifest, an unfinished default-model build (its resumable checkpoints
    included), and the Hub cache's ``blobs/*.incomplete`` of downloads that are not running.
    Symbolic links are not followed.
    """
    from moespec.paths import moespec_home

    home = Path(home) if home is not None else moespec_home()
    out: list[Leftover] = []
    if home.is_dir():
        out += _home_leftovers(home)
    if hub_cache is None:
        from moespec.hub.resolve import hub_cache_dir

        hub_cache = hub_cache_dir()
    out += incomplete_downloads(Path(hub_cache))
    return out


def _home_leftovers(home: Path) -> list[Leftover]:
    out: list[Leftover] = []
    for root, dirs, _files in os.walk(home):
        folder = Path(root)
        for p in stale_temps(folder):
            out.append(Leftover(p, size_of(p), "temp file of an interrupted write"))
        dirs[:] = [d for d in dirs if not ATOMIC_TEMP.match(d) and not (folder / d).is_symlink()]
    states = home / "estimator-states"
    if states.is_dir() and not states.is_symlink():
        for folder in sorted(p for p in states.iterdir() if p.is_dir() and not p.is_symlink()):
            if not (folder / "manifest.json").is_file():
                with held(folder) as free:
                    if free:
                        out.append(Leftover(folder, size_of(folder), "estimator states of an interrupted collection"))
    out += _build_leftovers(home / "models")
    return out


def build_lock_path(models: Path) -> Path:
    """The lock file a default-model build holds in ``models``."""
    from moespec.paths import DEFAULT_MODEL_FOLDER

    return models / f".{DEFAULT_MODEL_FOLDER}.lock"


def build_temps(models: Path) -> list[Path]:
    """Temp folders of default-model builds in ``models`` (the build's output folder before its rename,
    an old build moved aside) and in the wheels folder beside it (a source-wheel fetch): leftovers
    whenever no build holds the lock."""
    from moespec.paths import DEFAULT_MODEL_FOLDER

    out = []
    if models.is_dir():
        out += models.glob(f".{DEFAULT_MODEL_FOLDER}.build-*")
        out += models.glob(f".{DEFAULT_MODEL_FOLDER}.old-*")
    wheels = models.parent / "wheels"
    if wheels.is_dir() and not wheels.is_symlink():
        out += wheels.glob(".wheel-*")
    return sorted(out)


def sweep_build_temps(models: Path) -> int:
    """Remove :func:`build_temps` (call it holding the build lock); bytes freed."""
    freed = 0
    for p in build_temps(models):
        freed += size_of(p)
        remove(p)
    return freed


def _build_leftovers(models: Path) -> list[Leftover]:
    from moespec.paths import DEFAULT_MODEL_FOLDER

    if not models.is_dir() or models.is_symlink():
        return []
    lock = build_lock_path(models)
    if lock.exists():
        with held(lock) as free:
            if not free:
                return []  # a build is running: its folders are in use
    out = [Leftover(p, size_of(p), "temp folder of an interrupted default-model build") for p in build_temps(models)]
    partial = models / f".{DEFAULT_MODEL_FOLDER}.partial"
    if partial.is_dir():
        out.append(Leftover(partial, size_of(partial), "checkpoints of an unfinished default-model build (resumable)"))
    return out


def incomplete_downloads(hub_cache: Path) -> list[Leftover]:
    """``blobs/*.incomplete`` files in the Hub cache whose download is not running (its etag lock is free)."""
    if not hub_cache.is_dir():
        return []
    out = []
    for blob in sorted(hub_cache.glob("models--*/blobs/*.incomplete")):
        repo_folder = blob.parent.parent.name
        etag = blob.name.split(".", 1)[0]
        if download_lock_free(hub_cache / ".locks" / repo_folder / f"{etag}.lock"):
            out.append(Leftover(blob, size_of(blob), "part of an interrupted download (resumable)"))
    return out


def download_lock_free(lock: Path) -> bool:
    """True when no process holds huggingface_hub's download lock file ``lock`` (or it does not exist)."""
    if not lock.exists():
        return True
    with held(lock) as free:
        return free


def clean(leftovers: list[Leftover]) -> int:
    """Delete ``leftovers``; the bytes freed."""
    freed = 0
    for item in leftovers:
        remove(item.path)
        freed += item.bytes
    return freed
