"""What interrupted writes and downloads leave behind under moespec's home and in the Hub cache,
and how ``moespec models --clean`` finds and removes it.

Writers that are not single files hold the same kind of lock as an atomic write's temp folder
(moespec.tempfiles) on what they write: estimator states their folder, the default-model build
``models/.NAME.lock``, a Hub download huggingface_hub's ``.locks/<repo>/<etag>.lock``. Anything
whose lock can be taken is a leftover; the files of a process still writing are never touched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from moespec.tempfiles import ATOMIC_TEMP, download_lock_free, held, remove, size_of, stale_temps


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
        for p in stale_temps(folder, legacy=True):  # all of home is moespec's
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


def clean(leftovers: list[Leftover]) -> int:
    """Delete ``leftovers``; the bytes freed."""
    freed = 0
    for item in leftovers:
        remove(item.path)
        freed += item.bytes
    return freed
