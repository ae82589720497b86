"""The default model's weights checked by their bytes: an XXH3-128 recorded at build, verified at load.

The build marker (build.MARKER_FILE) records ``file_xxh3``: the XXH3-128 of ``model.safetensors``'s
bytes (integrity.file_digest), written when the build finishes. At load, :func:`start_check` hashes
the file on a second thread while the caller loads the model (xxhash hashes without the GIL, so
the load is not held up: the same overlap as integrity.BackgroundCheck for the int4 store), and
:meth:`ModelCheck.result` joins it before the first token:

- the digest matches: nothing to do;
- it differs: the marker is removed (so the next start builds the model again, like a damaged
  int4 store is rebuilt) and CheckpointError says so in one line;
- the marker has no ``file_xxh3`` (a build made before it existed): it is NOT rebuilt; the digest
  just computed is written into the marker ("trust on first use") and checked from then on.

A copy of the build elsewhere (a folder passed as MODEL that holds a build marker) is checked the
same way, but its marker is kept: moespec cannot build it again there, so every start refuses it.
Every command that loads a model goes through :mod:`moespec.default_model.checked`, which starts
this check for any folder with a marker (chat, serve, eval, calibrate, train-estimator, profile).
"""

from __future__ import annotations

import threading
from pathlib import Path

from moespec.default_model.build import (  # noqa: F401 (re-exported)
    DIGEST_FIELD,
    WEIGHTS_FILE,
    default_model_dir,
    record_digest,
)
from moespec.errors import CheckpointError


class ModelCheck:
    """A running check of ``folder / model.safetensors`` against its build marker (see module doc).

    Args:
        folder: a finished default-model folder (build.is_complete).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.note: str | None = None  # one line for the user, set by result() on first use
        self._digest: str | None = None
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._hash, name="moespec-model-check", daemon=True)
        self._thread.start()

    def _hash(self) -> None:
        from moespec.integrity import file_digest

        try:
            self._digest = file_digest(self.folder / WEIGHTS_FILE)
        except OSError as exc:
            self._error = exc

    def join(self) -> None:
        """Wait for the hash without acting on it (the load failed: nothing is compared)."""
        self._thread.join()

    def result(self) -> None:
        """Wait for the hash and act on it (see module doc).

        Raises:
            CheckpointError: the weights differ from the digest recorded at build, or cannot be read;
                the marker is removed first, so the next start builds the model again.
        """
        from moespec.default_model import build

        self._thread.join()
        path = self.folder / WEIGHTS_FILE
        marker = build.build_marker(self.folder)
        if marker is None:  # removed or damaged meanwhile: the next start rebuilds; nothing to compare
            return
        want = (marker.get(DIGEST_FIELD) or {}).get(WEIGHTS_FILE)
        if self._error is None and want == self._digest:
            return
        if self._error is None and want is None:  # trust on first use: a build from before the field
            try:
                build.write_marker(self.folder, {**marker, DIGEST_FIELD: {WEIGHTS_FILE: self._digest}})
                self.note = f"recorded the checksum of {path} (built before checksums)"
            except OSError as exc:  # a read-only cache still runs; checked once it is writable
                self.note = f"could not record the checksum of {path}: {exc.strerror}"
            return
        what = f"cannot be read ({self._error.strerror})" if self._error else "does not match its checksum"
        if not is_default_folder(self.folder):  # a copy: nothing here can build it again
            raise CheckpointError(f"default model weights {path} {what}",
                                  "copy the folder again from a good build, or run without MODEL to use the built one")
        (self.folder / build.MARKER_FILE).unlink(missing_ok=True)
        raise CheckpointError(f"default model weights {path} {what}",
                              "run the command again: the default model is built again")


def start_check(folder: Path) -> ModelCheck:
    """Start checking ``folder``'s weights on a second thread; call ``.result()`` before the first token."""
    return ModelCheck(folder)


def is_default_folder(folder: Path) -> bool:
    """True when ``folder`` is the default model's own place (build.default_model_dir()), however named."""
    try:
        return Path(folder).resolve() == default_model_dir().resolve()
    except OSError:
        return False


def check_for(folder: Path) -> ModelCheck | None:
    """A started check of ``folder``'s weights when it holds a default-model build (a build marker that
    records ``file_xxh3``, or a marker from before the field); None for any other model folder."""
    from moespec.default_model import build

    folder = Path(folder)
    if not (folder / WEIGHTS_FILE).is_file() or build.build_marker(folder) is None:
        return None
    return start_check(folder)
