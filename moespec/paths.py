"""Where moespec keeps its own files (built models, wheels, calibration) on this machine."""

from __future__ import annotations

import os
from pathlib import Path


def moespec_home() -> Path:
    """moespec's cache folder: ``$MOESPEC_HOME`` or ``~/.cache/moespec``."""
    env = os.environ.get("MOESPEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moespec"


def models_dir() -> Path:
    """Folder of models that moespec built itself (the embedded default model)."""
    return moespec_home() / "models"
