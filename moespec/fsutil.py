"""Atomic file writes (a locked temp folder beside the target, fsync, rename) and moespec's safetensors files."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from moespec.errors import OutputError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, force: bool = True, size: int | None = None) -> Iterator[Path]:
    """Yield a temporary path for ``path``; rename it onto ``path`` only on success.

    The temp path lies in a folder ``.NAME.XXXXXXXX.tmp`` beside ``path``, locked while it is
    written, so whatever a writer makes there (safetensors makes its own ``.tmpXXXXXX`` beside the
    file it writes) goes with it. An exception or Ctrl-C removes the folder; after a SIGKILL the next
    write of ``path`` sweeps it, as does ``moespec models --clean`` (moespec.cleanup). The file gets
    the usual mode (0666 less the umask), whatever made it.

    Args:
        path: the target file.
        force: overwrite an existing ``path``.
        size: bytes about to be written, when known: refused up front if the disk cannot hold them.

    Raises:
        OutputError: the folder is not writable, ``path`` exists and ``force`` is False, the disk is
            full (naming the path and the bytes needed), or the write failed with an OS error
            (safetensors' own error type included).
    """
    from moespec import tempfiles

    path = Path(path)
    if path.exists() and not force:
        raise OutputError(f"{path} exists already", "pass --force to overwrite it")
    prefix, suffix = tempfiles.temp_name(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfiles.sweep_target(path)
        if size is not None:
            check_free_space(path, size)
        folder = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=path.parent))
    except OSError as exc:
        raise OutputError(f"cannot write to {path.parent}: {exc.strerror}", "choose a writable --out path") from exc
    lock = None
    try:
        lock = tempfiles.lock_fd(folder)
        tmp_path = folder / path.name
        try:
            yield tmp_path
            with open(tmp_path, "rb+") as fh:
                os.fsync(fh.fileno())
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp_path, 0o666 & ~umask)
            os.replace(tmp_path, path)
        except Exception as exc:
            error = write_error(path, exc, size)
            if error is None:
                raise
            raise error from exc
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if lock is not None:
            os.close(lock)


def write_error(path: Path, exc: BaseException, size: int | None = None) -> OutputError | None:
    """The OutputError for a failed write of ``path`` (None: not an I/O failure, re-raise it).

    Maps OSError and safetensors' SafetensorError (which wraps the OS error in its message); a full
    disk names the path, the bytes needed (when known) and the bytes free.
    """
    if isinstance(exc, OutputError):
        return exc
    text = str(exc)
    full = (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left" in text or "os error 28" in text
    if full:
        return disk_full(path, size)
    if isinstance(exc, OSError):
        return OutputError(f"cannot write {path}: {exc.strerror or exc}", "choose a writable --out path")
    if type(exc).__name__ == "SafetensorError" and ("I/O error" in text or "os error" in text):
        return OutputError(f"cannot write {path}: {text}", "choose a writable --out path")
    return None


def free_bytes(path: Path) -> int:
    """Bytes free for an unprivileged writer in ``path``'s folder (its nearest existing parent)."""
    folder = Path(path)
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def disk_full(path: Path, size: int | None = None) -> OutputError:
    """The one-line error of a full disk at ``path``."""
    from moespec.units import format_bytes

    need = f"needs {format_bytes(size)}, " if size else ""
    try:
        free = f"{format_bytes(free_bytes(path))} free"
    except OSError:
        free = "no room"
    return OutputError(f"disk full: {path} {need}{free}",
                       "free some space there, or write elsewhere (--out, or MOESPEC_HOME for moespec's files)")


def check_free_space(path: str | os.PathLike, size: int) -> None:
    """Refuse, before any work, a write of ``size`` bytes that ``path``'s disk cannot hold.

    Raises:
        OutputError: names the path, the bytes needed and the bytes free.
    """
    path = Path(path)
    if free_bytes(path) < size:
        raise disk_full(path, size)


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


@contextlib.contextmanager
def atomic_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Yield a new temp folder to build ``folder`` in; it replaces ``folder`` only on success.

    The temp folder is ``.NAME.XXXXXXXX.tmp`` beside ``folder``, locked while it is built, like an
    :func:`atomic_path` temp: an exception or Ctrl-C removes it, and after a SIGKILL the next build of
    ``folder`` sweeps it, as does ``moespec models --clean``. An old ``folder`` is removed just
    before the rename (a kill in between leaves no folder: the next run builds it again).

    Raises:
        OutputError: the parent folder is not writable (names it).
    """
    from moespec import tempfiles

    folder = Path(folder)
    prefix, suffix = tempfiles.temp_name(folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tempfiles.sweep_target(folder)
        tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=folder.parent))
    except OSError as exc:
        raise OutputError(f"cannot write to {folder.parent}: {exc.strerror or exc}",
                          "set MOESPEC_HOME to a writable folder") from exc
    lock = tempfiles.lock_fd(tmp)
    try:
        yield tmp
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after the rename
        if lock is not None:
            os.close(lock)


def atomic_write_text(path: str | os.PathLike, text: str, force: bool = True) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path, force=force) as tmp:
        tmp.write_text(text, encoding="utf-8")


def save_safetensors_atomic(path: Path, tensors: dict, meta: dict, meta_key: str) -> Path:
    """Write ``tensors`` + ``meta`` (as sorted JSON under ``meta_key``) to ``path`` atomically, with a
    checksum of the data (moespec.integrity) that the loader verifies.

    Raises:
        OutputError: the path is not writable, or its disk cannot hold the file (said before writing).
    """
    import json

    from safetensors.torch import save_file

    from moespec.integrity import with_digest

    size = sum(t.numel() * t.element_size() for t in tensors.values()) + 65536  # + header, generously
    metadata = {meta_key: json.dumps(with_digest(meta, tensors), sort_keys=True)}
    with atomic_path(path, size=size) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return path


def load_safetensors_with_meta(path: Path, kind: str, fmt: str, max_version: int, meta_key: str, *,
                               name: str, missing: tuple[str, str], redo: str, again: str,
                               nan_ok: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Read a moespec safetensors file written by ``save_safetensors_atomic``: its JSON metadata and tensors.

    Checks the file exists, is whole (a truncated file is said to be truncated), parses, carries
    ``fmt`` and a format version this moespec reads, that its data matches the checksum written with
    it (files from before checksums are read unchecked), and that its float tensors are finite.

    Args:
        path: the file. kind: what it is in messages ("calibration", "estimator").
        fmt, max_version, meta_key: the expected ``format``, the newest ``format_version`` read, the key
            whose metadata value is the JSON.
        name: how messages name the file; missing: (message, hint) when it does not exist;
        redo: hint to write it again; again: the action that makes a current file ("calibrate again").
        nan_ok: name prefixes of tensors where NaN means "no value" (per-layer metrics); Inf is
            refused there too.

    Returns:
        (metadata dict, name -> tensor) on CPU.

    Raises:
        CalibrationError: missing, truncated, corrupt (checksum), NaN/Inf, unreadable, another
            format, or a newer format version.
    """
    import json

    from safetensors import SafetensorError, safe_open

    from moespec.errors import CalibrationError
    from moespec.integrity import DIGEST_KEY, nonfinite, safetensors_damage, verify_digest

    if not path.is_file():
        raise CalibrationError(*missing)
    damage = safetensors_damage(path)
    if damage is not None and damage.startswith("truncated"):
        raise CalibrationError(f"{name} is {damage}: a damaged {kind} file", redo)
    if damage is not None:
        raise CalibrationError(f"{name} is not a readable moespec {kind} file ({damage})", redo)
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
    if verify_digest(meta, tensors) is False:
        raise CalibrationError(f"{name} is corrupt: its data does not match the checksum written with it", redo)
    metrics = [k for k in tensors if k.startswith(nan_ok)] if nan_ok else []
    bad = nonfinite(tensors, [k for k in tensors if k not in metrics]) + nonfinite(tensors, metrics, allow_nan=True)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CalibrationError(f"{name} holds NaN or infinite values in {bad[0]}{more}: a corrupt {kind} file", redo)
    meta.pop(DIGEST_KEY, None)
    return meta, tensors


class AtomicFile:
    """:func:`atomic_path` for a writer that cannot sit inside one ``with`` block (e.g. one that writes
    while a generator yields): the same locked temp folder, swept the same way after a SIGKILL.

    ``tmp`` is the path to write; :meth:`commit` syncs it and renames it onto the target;
    :meth:`discard` drops it (idempotent; a no-op after commit).

    Raises:
        OutputError: from the constructor (unwritable folder, a disk that cannot hold ``size``) and
            from :meth:`commit` (the write failed), as atomic_path raises them.
    """

    def __init__(self, path: str | os.PathLike, size: int | None = None) -> None:
        self._cm = atomic_path(path, size=size)
        self.tmp: Path = self._cm.__enter__()
        self._open = True

    def commit(self) -> None:
        if self._open:
            self._open = False
            self._cm.__exit__(None, None, None)

    def discard(self) -> None:
        if self._open:
            self._open = False
            drop = _Discarded()
            self._cm.__exit__(_Discarded, drop, None)  # atomic_path re-raises it: __exit__ returns False


class _Discarded(Exception):
    """Thrown into atomic_path by AtomicFile.discard: what an exception inside its ``with`` does."""
