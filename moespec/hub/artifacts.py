"""Where moespec keeps the files it derives from a model (calibration, estimators).

Both live under ``moespec_home()``, keyed by a file-system-safe form of the model id, so every
command (calibrate, train-estimator, chat, profile, models) finds the same file.
"""

from __future__ import annotations

import re
from pathlib import Path

from moespec.paths import moespec_home

# A calibration file carried inside a model folder (found too, for folders moved between machines).
CALIBRATION_BESIDE_MODEL = "moespec-calibration.safetensors"


def sanitize_model_id(model_id: str) -> str:
    """A file name for ``model_id``: ``Qwen/Qwen3-30B-A3B`` -> ``Qwen--Qwen3-30B-A3B``.

    Callers pass the Hub id for a Hub model and the absolute folder path for a local folder
    (``/data/m`` -> ``data--m``), as ``moespec.calibrate.locate.model_key`` does. Characters other
    than letters, digits, ``-``, ``_`` and ``.`` become ``_``; the result is never empty.
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
