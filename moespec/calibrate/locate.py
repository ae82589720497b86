"""Where a model's calibration file lives, so `calibrate` writes it where chat/profile look.

The default place is ``moespec.hub.artifacts.calibration_path(model_id)`` (under moespec's home),
keyed by the Hub id for a Hub cache snapshot, by the folder name for a model moespec built (e.g.
``smollm2-135m-moe-e16k4``, the name MODEL accepts), and by the absolute folder path otherwise, the
same keys ``moespec models`` uses. Files written under the absolute-path key by earlier versions are
still found, and so is a file next to the model (``moespec-calibration.safetensors``), for folders
carried between machines. Nothing here imports torch: the CLI checks these files before loading.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from moespec.errors import CalibrationError
from moespec.paths import display_path, models_dir

BESIDE_MODEL = "moespec-calibration.safetensors"


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


def _gguf_key(folder: Path) -> str | None:
    """The key recorded in a folder moespec prepared for a GGUF (moespec.gguf.sidecar), or None."""
    from moespec.gguf import SOURCE_FILE

    marker = folder / SOURCE_FILE
    if not marker.is_file():
        return None
    import json

    try:
        return str(json.loads(marker.read_text(encoding="utf-8"))["key"])
    except (OSError, ValueError, KeyError):
        return None


def legacy_model_key(model_path: str | Path) -> str:
    """The key earlier versions used for a model moespec built: its absolute path."""
    return os.path.abspath(Path(model_path).expanduser())


def default_calibration_path(model_path: str | Path) -> Path:
    """Where `moespec calibrate` writes without --out, and where the runtime looks first."""
    from moespec.hub.artifacts import calibration_path

    return calibration_path(model_key(model_path))


def artifact_candidates(model_path: str | Path, path_for: Callable[[str], Path], beside: str) -> list[Path]:
    """Where a per-model file (calibration, estimators) is looked for, in order, duplicates dropped:
    ``path_for`` of the model's key (the default, first), of the key earlier versions used, and the
    file named ``beside`` inside the model folder."""
    paths = [path_for(model_key(model_path)), path_for(legacy_model_key(model_path)), Path(model_path) / beside]
    return list(dict.fromkeys(paths))


def first_existing(paths: list[Path]) -> Path | None:
    """The first of ``paths`` that is a file, or None."""
    return next((p for p in paths if p.is_file()), None)


def calibration_candidates(model_path: str | Path) -> list[Path]:
    """Where a calibration file for the model is looked for, in order (the first is the default)."""
    from moespec.hub.artifacts import calibration_path

    return artifact_candidates(model_path, calibration_path, BESIDE_MODEL)


def find_calibration(model_path: str | Path, explicit: str | Path | None = None) -> Path:
    """The calibration file for the model at ``model_path``.

    Args:
        explicit: a path given by the user (``RuntimeConfig.calibration_path``); must exist.

    Raises:
        CalibrationError: no file found (the message names `moespec calibrate MODEL`).
    """
    key = model_key(model_path)
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise CalibrationError(f"calibration file {display_path(path)} does not exist",
                                   f"run `moespec calibrate {key} --out {display_path(path)}`, or drop --calibration")
        return path
    candidates = calibration_candidates(model_path)
    found = first_existing(candidates)
    if found is not None:
        return found
    raise CalibrationError(
        f"--predictor quasi needs a calibration file for {key}; none at {display_path(candidates[0])}",
        f"run `moespec calibrate {key}` first, or use --predictor router",
    )
