"""Where a model's estimator file lives, so `train-estimator` writes it where chat/profile look.

The default place is ``moespec.hub.artifacts.estimator_path(model_key)`` (under moespec's home, keyed
like the calibration file, see moespec.calibrate.locate); a file under the key earlier versions used,
or next to the model (``moespec-estimator.safetensors``), is found too. No torch here: the CLI checks
the file exists before it loads the model.
"""

from __future__ import annotations

from pathlib import Path

from moespec.calibrate.locate import artifact_candidates, first_existing, model_key
from moespec.errors import CalibrationError
from moespec.paths import display_path

BESIDE_MODEL = "moespec-estimator.safetensors"


def describe(path: Path, flag: str | None = None) -> str:
    """How error messages name an estimator file: "estimator file PATH", plus the flag that gave it."""
    return f"estimator file {display_path(path)}" + (f" (given with {flag})" if flag else "")


def default_estimator_path(model_path: str | Path) -> Path:
    """Where `moespec train-estimator` writes without --out, and where the runtime looks first."""
    from moespec.hub.artifacts import estimator_path

    return estimator_path(model_key(model_path))


def estimator_candidates(model_path: str | Path) -> list[Path]:
    """Where an estimator file for the model is looked for, in order (the first is the default)."""
    from moespec.hub.artifacts import estimator_path

    return artifact_candidates(model_path, estimator_path, BESIDE_MODEL)


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
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise CalibrationError(f"{describe(path, flag)} does not exist",
                                   f"check the path, run `moespec train-estimator {key} --out {display_path(path)}`, "
                                   f"or drop {flag} to use the file found automatically")
        return path
    candidates = estimator_candidates(model_path)
    found = first_existing(candidates)
    if found is not None:
        return found
    raise CalibrationError(f"--predictor estimator/hybrid needs trained router estimators for {key}; "
                           f"none at {display_path(candidates[0])}",
                           f"run `moespec train-estimator {key}` first, or use --predictor quasi or router")
