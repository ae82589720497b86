"""Where moespec keeps its own files (built models, wheels, calibration) on this machine."""

from __future__ import annotations

import os
from pathlib import Path


def moespec_home() -> Path:
    """moespec's cache folder: ``$MOESPEC_HOME`` or ``~/.cache/moespec``."""
    env = os.environ.get("MOESPEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moespec"


# The embedded default model's folder name in models_dir(), the name MODEL accepts. It equals
# moespec.default_model.DEFAULT_MODEL_NAME (a test checks); kept here too because that package imports torch.
DEFAULT_MODEL_FOLDER = "smollm2-135m-moe-e16k4"


def models_dir() -> Path:
    """Folder of models that moespec built itself (the embedded default model)."""
    return moespec_home() / "models"


def display_path(path: str | os.PathLike) -> str:
    """``path`` as a user reads it: the home folder written ``~`` (``~/.cache/moespec/models``)."""
    text, home = os.fspath(path), str(Path.home())
    if text == home or text.startswith(home + os.sep):
        return "~" + text[len(home):]
    return text
