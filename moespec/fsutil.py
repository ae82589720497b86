"""Atomic file writes: write to a temp file in the same folder, fsync, rename."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

from moespec.errors import OutputError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, force: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only on success.

    A crash, Ctrl-C or exception leaves ``path`` untouched and removes the temp file.

    Raises:
        OutputError: the folder is not writable, or ``path`` exists and ``force`` is False.
    """
    path = Path(path)
    if path.exists() and not force:
        raise OutputError(f"{path} exists already", "pass --force to overwrite it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; written files get the usual mode
    except OSError as exc:
        raise OutputError(f"cannot write to {path.parent}: {exc.strerror}", "choose a writable --out path") from exc
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def temp_folder_beside(folder: Path, prefix: str) -> Path:
    """A new temporary folder in ``folder``'s parent (made if missing), to build into and rename onto ``folder``.

    Raises:
        OutputError: the parent is not writable (names it).
    """
    try:
        Path(folder).parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=Path(folder).parent))
    except OSError as exc:
        raise OutputError(f"cannot write to {Path(folder).parent}: {exc.strerror or exc}",
                          "set MOESPEC_HOME to a writable folder") from exc


def atomic_write_text(path: str | os.PathLike, text: str, force: bool = True) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path, force=force) as tmp:
        tmp.write_text(text, encoding="utf-8")


def save_safetensors_atomic(path: Path, tensors: dict, meta: dict, meta_key: str) -> Path:
    """Write ``tensors`` + ``meta`` (as sorted JSON under ``meta_key``) to ``path`` atomically.

    Raises:
        OutputError: the path is not writable.
    """
    import json

    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        try:
            save_file(tensors, str(tmp), metadata={meta_key: json.dumps(meta, sort_keys=True)})
        except OSError as exc:
            raise OutputError(f"cannot write {path}: {exc.strerror or exc}", "choose a writable --out path") from exc
    return path


def load_safetensors_with_meta(path: Path, kind: str, fmt: str, max_version: int, meta_key: str, *,
                               name: str, missing: tuple[str, str], redo: str, again: str) -> tuple[dict, dict]:
    """Read a moespec safetensors file written by ``save_safetensors_atomic``: its JSON metadata and tensors.

    Checks the file exists, parses, carries ``fmt`` and a format version this moespec reads.

    Args:
        path: the file. kind: what it is in messages ("calibration", "estimator").
        fmt, max_version, meta_key: the expected ``format``, the newest ``format_version`` read, the key
            whose metadata value is the JSON.
        name: how messages name the file; missing: (message, hint) when it does not exist;
        redo: hint to write it again; again: the action that makes a current file ("calibrate again").

    Returns:
        (metadata dict, name -> tensor) on CPU.

    Raises:
        CalibrationError: missing, unreadable, another format, or a newer format version.
    """
    import json

    from safetensors import SafetensorError, safe_open

    from moespec.errors import CalibrationError

    if not path.is_file():
        raise CalibrationError(*missing)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[meta_key])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, KeyError, ValueError) as exc:
        raise CalibrationError(f"{name} is not a readable moespec {kind} file ({exc})", redo) from exc
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != fmt:
        raise CalibrationError(f"{name} is not a moespec {kind} file (format {found!r})", redo)
    if int(meta.get("format_version", 0)) > max_version:
        raise CalibrationError(f"{name} has format version {meta['format_version']}; this moespec reads up to "
                               f"{max_version}", f"upgrade moespec or {again}")
    return meta, tensors
