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
