"""Where a model's calibration file lives, so `calibrate` writes it where chat/profile look.

The default place is ``moespec.hub.artifacts.calibration_path(model_id)`` (under moespec's home),
keyed by the Hub id for a Hub cache snapshot and by the absolute folder path otherwise, the same
keys ``moespec models`` uses. A file next to the model (``moespec-calibration.safetensors``) is
also found, for folders carried between machines.
"""

from __future__ import annotations

import os
from pathlib import Path

from moespec.errors import CalibrationError

BESIDE_MODEL = "moespec-calibration.safetensors"


def model_key(model_path: str | Path) -> str:
    """The id a model folder is known by: ``org/name`` for a Hub cache snapshot, else its absolute path."""
    path = Path(os.path.abspath(Path(model_path).expanduser()))
    parts = path.parts
    for i in range(len(parts) - 2):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            return parts[i][len("models--"):].replace("--", "/")
    return str(path)


def default_calibration_path(model_path: str | Path) -> Path:
    """Where `moespec calibrate` writes without --out, and where the runtime looks first."""
    try:
        from moespec.hub.artifacts import calibration_path
    except ModuleNotFoundError:  # no artifacts module in this build: keep it next to the model
        return Path(model_path) / BESIDE_MODEL
    return calibration_path(model_key(model_path))


def find_calibration(model_path: str | Path, explicit: str | Path | None = None) -> Path:
    """The calibration file for the model at ``model_path``.

    Args:
        explicit: a path given by the user (``RuntimeConfig.calibration_path``); must exist.

    Raises:
        CalibrationError: no file found (the message names `moespec calibrate MODEL`).
    """
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise CalibrationError(f"calibration file {path} does not exist",
                                   f"run `moespec calibrate {model_key(model_path)} --out {path}`, or drop --calibration")
        return path
    candidates = [default_calibration_path(model_path), Path(model_path) / BESIDE_MODEL]
    for path in candidates:
        if path.is_file():
            return path
    raise CalibrationError(
        f"--predictor quasi needs a calibration file for {model_key(model_path)}; none at {candidates[0]}",
        f"run `moespec calibrate {model_key(model_path)}` first, or use --predictor router",
    )
