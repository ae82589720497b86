"""Opening a model with the default model's checks: every command that loads weights comes here.

:func:`resolve` turns MODEL into a folder: None is the default model (built on first use); the
default model named as MODEL (its name, ``smollm2-135m-moe-e16k4``, or its folder's path) is the
same folder and is built again when a failed check removed its marker. :func:`load_checked` loads
the folder with ``runtime.load.load_offloaded`` while :mod:`moespec.default_model.verify` hashes
its ``model.safetensors`` on a second thread (when the folder holds a build marker: the default
model or a copy of it; any other model is loaded as before) and joins that check before returning,
so no command computes anything from weights that differ from the ones the build wrote.

Used by chat, serve, eval (chat.open_model), calibrate, train-estimator and profile.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from moespec.config import RuntimeConfig
    from moespec.default_model.verify import ModelCheck


def names_default(model: str) -> bool:
    """True when MODEL names the default model: its name, or a path to its folder."""
    from moespec.default_model.build import DEFAULT_MODEL_NAME
    from moespec.default_model.verify import is_default_folder

    if model == DEFAULT_MODEL_NAME:
        return True
    path = Path(model).expanduser()
    return path.is_dir() and is_default_folder(path)


def resolve(model: str | None, console: Console | None = None) -> Path:
    """The folder of MODEL (see the module doc).

    Raises:
        ModelNotFoundError, CheckpointError: from hub.resolve.resolve_model (the default model named
            before it was ever built says how to build it).
        SourceUnavailableError, OutputError: building the default model failed.
    """
    from moespec.default_model.build import default_model_dir, ensure_default_model
    from moespec.hub.resolve import resolve_model

    if model is None or (names_default(model) and default_model_dir().is_dir()):
        return ensure_default_model(console)  # builds it when missing, incomplete or unchecked-and-damaged
    return resolve_model(model)


def load_checked(path: Path, cfg: RuntimeConfig, recorder=None, check: ModelCheck | None = None):
    """``load_offloaded(path, cfg, recorder)`` with the weights' check joined before it returns.

    Args:
        check: a check already started (verify.check_for) to overlap it with earlier work (the
            tokenizer's load); None starts one here when ``path`` holds a build marker.

    Returns:
        (OffloadedModel, note): note is one line for the user (a checksum recorded on first use) or None.

    Raises:
        CheckpointError: the weights differ from their recorded checksum (the model is closed first;
            the default model's marker is removed, so the next start builds it again). Whatever
            load_offloaded raises.
    """
    from moespec.default_model.verify import check_for
    from moespec.runtime.load import load_offloaded

    check = check if check is not None else check_for(path)
    try:
        om = load_offloaded(path, cfg, recorder)
    except BaseException:
        if check is not None:
            check.join()  # its thread reads the file: not left running behind an error
        raise
    if check is None:
        return om, None
    try:
        check.result()
    except BaseException:
        om.close()
        raise
    return om, check.note
