"""Where moespec keeps the files it derives from a model: calibration, estimators, quantised stores.

Every derived file lives under ``moespec_home()`` and is keyed by :func:`model_key`: the Hub id for
a Hub cache snapshot, the folder name for a model moespec built (e.g. ``smollm2-135m-moe-e16k4``,
the name MODEL accepts), the absolute folder path otherwise; the same keys ``moespec models``
shows, so every command (calibrate, train-estimator, chat, profile, serve, models) finds the same
file. A file under the key earlier versions used (the absolute path of a built model), or one next
to the model (``moespec-calibration.safetensors``, ``moespec-estimator.safetensors``, for folders
carried between machines), is found too, and last, for the embedded default model, the calibration
shipped with moespec (``shipped_calibration``). What the files contain is below their readers:
``moespec.predict.calibration_file``, ``moespec.predict.estimator_file``,
``moespec.runtime.host.quant_store``. Nothing here imports torch: the CLI checks these files
before it loads a model.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

from moespec.errors import CalibrationError
from moespec.paths import display_path, models_dir, moespec_home

# The file in a folder moespec prepared for a GGUF model that says which GGUF it is (moespec.gguf).
GGUF_SOURCE_FILE = "moespec-gguf.json"
# Files carried inside a model folder (found too, for folders moved between machines).
CALIBRATION_BESIDE_MODEL = "moespec-calibration.safetensors"
ESTIMATOR_BESIDE_MODEL = "moespec-estimator.safetensors"
# The default model's calibration, shipped with moespec (scripts/record_default_calibration.py
# writes it), and the build marker that says which recipe a folder was built by. The marker's name
# is default_model.build.MARKER_FILE, not imported: that package imports torch (a test checks them).
SHIPPED_CALIBRATION = Path(__file__).parent / "default_model" / "default_calibration.safetensors"
BUILD_MARKER_FILE = "moespec_build.json"


def model_key(model_path: str | Path) -> str:
    """The id a model folder is known by: ``org/name`` for a Hub cache snapshot, the folder name for a
    model moespec built (in ``moespec.paths.models_dir()``), the GGUF's key (its path, or
    ``org/repo:QUANT``) for a folder moespec prepared for a GGUF, else its absolute path."""
    path = Path(os.path.abspath(Path(model_path).expanduser()))
    gguf = _gguf_key(path)
    if gguf is not None:
        return gguf
    parts = path.parts
    for i in range(len(parts) - 2):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            return parts[i][len("models--"):].replace("--", "/")
    if path.parent == Path(os.path.abspath(models_dir())):
        return path.name
    return str(path)


def gguf_marker_digest(marker: dict) -> str:
    """XXH3-128 hex of a GGUF folder's marker (``moespec-gguf.json``) without its ``digest`` field:
    its canonical JSON (sorted keys), as moespec.gguf.sidecar seals the marker it writes."""
    import json

    from moespec.integrity import new_hasher

    h = new_hasher()
    h.update(json.dumps({k: v for k, v in marker.items() if k != "digest"}, sort_keys=True).encode())
    return h.hexdigest()


def _gguf_key(folder: Path) -> str | None:
    """The key recorded in a folder moespec prepared for a GGUF (moespec.gguf.sidecar), or None.

    None too when the marker does not match its own ``digest`` (damaged: its key is not trusted;
    the next use of the GGUF prepares the folder again, moespec.gguf.sidecar.read_marker). A marker
    without a digest (format 1, before markers were sealed) is read as before. Only the marker is
    hashed here (a few kB), not the folder's other files: sidecar.read_marker checks those before use.
    """
    import json

    marker = folder / GGUF_SOURCE_FILE
    if not marker.is_file():
        return None
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
        if "digest" in data and data["digest"] != gguf_marker_digest(data):
            return None
        return str(data["key"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def legacy_model_key(model_path: str | Path) -> str:
    """The key earlier versions used for a model moespec built: its absolute path."""
    return os.path.abspath(Path(model_path).expanduser())


def sanitize_model_id(model_id: str) -> str:
    """A file name for ``model_id``: ``Qwen/Qwen3-30B-A3B`` -> ``Qwen--Qwen3-30B-A3B``.

    Callers pass a :func:`model_key` (``/data/m`` -> ``data--m``). Characters other than letters,
    digits, ``-``, ``_`` and ``.`` become ``_``; the result is never empty.
    """
    text = model_id.strip().strip("/").replace("/", "--")
    text = re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip(".")
    return text or "_"


def calibration_path(model_id: str) -> Path:
    """``<moespec home>/calib/<sanitized id>.safetensors``: default vectors, frequencies, recall."""
    return moespec_home() / "calib" / f"{sanitize_model_id(model_id)}.safetensors"


def estimator_path(model_id: str) -> Path:
    """``<moespec home>/estimators/<sanitized id>.safetensors``: per-layer router estimators."""
    return moespec_home() / "estimators" / f"{sanitize_model_id(model_id)}.safetensors"


def quant_store_path(model_folder: str | Path, bits: int, group_size: int) -> Path:
    """``<moespec home>/experts/<sanitized key>/int<bits>-g<group>.safetensors``: the quantised expert
    store of ``model_folder`` (runtime.host.quant_store), so a second start does not quantise again."""
    name = f"int{bits}-g{group_size}.safetensors"
    return moespec_home() / "experts" / sanitize_model_id(model_key(model_folder)) / name


def default_calibration_path(model_path: str | Path) -> Path:
    """Where `moespec calibrate` writes without --out, and where the runtime looks first."""
    return calibration_path(model_key(model_path))


def default_estimator_path(model_path: str | Path) -> Path:
    """Where `moespec train-estimator` writes without --out, and where the runtime looks first."""
    return estimator_path(model_key(model_path))


def artifact_candidates(model_path: str | Path, path_for: Callable[[str], Path], beside: str) -> list[Path]:
    """Where a per-model file (calibration, estimators) is looked for, in order, duplicates dropped:
    ``path_for`` of the model's key (the default, first), of the key earlier versions used, and the
    file named ``beside`` inside the model folder."""
    paths = [path_for(model_key(model_path)), path_for(legacy_model_key(model_path)), Path(model_path) / beside]
    return list(dict.fromkeys(paths))


def first_existing(paths: list[Path]) -> Path | None:
    """The first of ``paths`` that is a file, or None."""
    return next((p for p in paths if p.is_file()), None)


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file, from its JSON header alone (no tensor is read).

    Raises:
        OSError, ValueError: unreadable, or not a safetensors header.
    """
    import json
    import struct

    with open(path, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        if size > 100_000_000:
            raise ValueError(f"{path}: a {size}-byte header is not a safetensors header")
        header = json.loads(fh.read(size))
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    return meta if isinstance(meta, dict) else {}


def shipped_calibration(model_path: str | Path) -> Path | None:
    """The calibration shipped with moespec when ``model_path`` is a build of the recipe it was made on, else None.

    The default model is built on first use from a recorded recipe (default_model.recipe: its digest
    is in the folder's build marker), so one calibration made on a build of that recipe fits every
    build of it: shipping it makes the default cache policy (lfru) and ``--predictor quasi`` work
    without `moespec calibrate`. Matched here by recipe digest only (the marker and the file's
    header, a few kB); its readers then check it as any calibration file (config hash, MoE layers,
    router fingerprint: predict.calibration_file.load_checked).
    """
    import json

    try:
        marker = json.loads((Path(model_path) / BUILD_MARKER_FILE).read_text(encoding="utf-8"))
        made_on = json.loads(safetensors_metadata(SHIPPED_CALIBRATION)["moespec"]).get("recipe_digest")
        built_by = marker.get("recipe_digest")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return SHIPPED_CALIBRATION if made_on is not None and made_on == built_by else None


def calibration_candidates(model_path: str | Path) -> list[Path]:
    """Where a calibration file for the model is looked for, in order (the first is the default;
    the one shipped for the default model, when it is one, is last: `moespec calibrate` overrides it)."""
    paths = artifact_candidates(model_path, calibration_path, CALIBRATION_BESIDE_MODEL)
    shipped = shipped_calibration(model_path)
    return paths + ([shipped] if shipped is not None and shipped not in paths else [])


def estimator_candidates(model_path: str | Path) -> list[Path]:
    """Where an estimator file for the model is looked for, in order (the first is the default)."""
    return artifact_candidates(model_path, estimator_path, ESTIMATOR_BESIDE_MODEL)


def _find(explicit: str | Path | None, candidates: list[Path], missing_explicit: Callable[[Path], CalibrationError],
          missing: Callable[[Path], CalibrationError]) -> Path:
    """``explicit`` when given (it must exist), else the first of ``candidates`` that exists; each
    refusal is the error its function makes of the path it looked at."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise missing_explicit(path)
        return path
    found = first_existing(candidates)
    if found is None:
        raise missing(candidates[0])
    return found


def find_calibration(model_path: str | Path, explicit: str | Path | None = None) -> Path:
    """The calibration file for the model at ``model_path``.

    Args:
        explicit: a path given by the user (``RuntimeConfig.calibration_path``); must exist.

    Raises:
        CalibrationError: no file found (the message names `moespec calibrate MODEL`).
    """
    key = model_key(model_path)
    return _find(explicit, calibration_candidates(model_path), lambda path: CalibrationError(
        f"calibration file {display_path(path)} does not exist",
        f"run `moespec calibrate {key} --out {display_path(path)}`, or drop --calibration"), lambda path: CalibrationError(
        f"--predictor quasi needs a calibration file for {key}; none at {display_path(path)}",
        f"run `moespec calibrate {key}` first, or use --predictor router"))


def describe_estimator(path: Path, flag: str | None = None) -> str:
    """How error messages name an estimator file: "estimator file PATH", plus the flag that gave it."""
    return f"estimator file {display_path(path)}" + (f" (given with {flag})" if flag else "")


def find_estimator(model_path: str | Path, explicit: str | Path | None = None, flag: str = "--estimator") -> Path:
    """The estimator file for the model at ``model_path``: ``explicit`` when given (it must exist), else
    the one `moespec train-estimator` wrote for the model (its default path, or beside the model).

    Args:
        model_path: the model folder.
        explicit: a path the user gave with ``flag`` (``RuntimeConfig.estimator_path``); it wins over the default.
        flag: how errors name the option that gave ``explicit``.

    Raises:
        CalibrationError: ``explicit`` does not exist (names the path and ``flag``), or no file was found
            (names `moespec train-estimator MODEL`).
    """
    key = model_key(model_path)
    return _find(explicit, estimator_candidates(model_path), lambda path: CalibrationError(
        f"{describe_estimator(path, flag)} does not exist",
        f"check the path, run `moespec train-estimator {key} --out {display_path(path)}`, "
        f"or drop {flag} to use the file found automatically"), lambda path: CalibrationError(
        f"--predictor estimator/hybrid needs trained router estimators for {key}; none at {display_path(path)}",
        f"run `moespec train-estimator {key}` first, or use --predictor quasi or router"))
