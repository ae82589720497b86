"""Predictors that need a file made offline: `quasi` (calibration), `estimator` and `hybrid`.

``moespec.runtime.offload.make_predictor`` calls :func:`make_calibrated_predictor` for these
kinds. Each kind has one builder in ``BUILDERS``; the estimator issue adds its builders there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from moespec.config import Predictor, RuntimeConfig
from moespec.errors import CalibrationError, OptionError
from moespec.models.base import MoeAdapter
from moespec.predict.base import LayerRef, NextLayerPredictor

Builder = Callable[[MoeAdapter, list[LayerRef], RuntimeConfig, Path], NextLayerPredictor]


def build_quasi(adapter: MoeAdapter, refs: list[LayerRef], cfg: RuntimeConfig, model_path: Path) -> NextLayerPredictor:
    """QuasiPredictor with the model's calibration file (found automatically or ``cfg.calibration_path``).

    Raises:
        CalibrationError: no file (names `moespec calibrate MODEL`), corrupt, or made for another model.
    """
    from moespec.calibrate.file import check_matches, load_calibration, router_fingerprint
    from moespec.calibrate.locate import find_calibration, model_key
    from moespec.predict.quasi import QuasiPredictor

    path = find_calibration(model_path, cfg.calibration_path)
    calib = load_calibration(path)
    layers = [r.layer for r in refs]
    check_matches(calib, path, adapter.config, layers, router_fingerprint([r.block.gate.weight for r in refs]),
                  model_key(model_path))
    device = refs[0].block.gate.weight.device if refs else "cpu"
    vectors = {layer: calib.vectors[m].to(device) for m, layer in enumerate(layers)}  # [E, H] float32 each
    return QuasiPredictor(adapter, refs, vectors)


def _needs_estimator(adapter: MoeAdapter, refs: list[LayerRef], cfg: RuntimeConfig, model_path: Path) -> NextLayerPredictor:
    raise CalibrationError(f"--predictor {cfg.predictor.value} needs trained router estimators for this model",
                           "run `moespec train-estimator MODEL` first, or use --predictor quasi or router")


# Predictor kind -> builder. Extension point: `train-estimator` registers ESTIMATOR and HYBRID here.
BUILDERS: dict[Predictor, Builder] = {
    Predictor.QUASI: build_quasi,
    Predictor.ESTIMATOR: _needs_estimator,
    Predictor.HYBRID: _needs_estimator,
}


def make_calibrated_predictor(kind: Predictor, adapter: MoeAdapter, refs: list[LayerRef], cfg: RuntimeConfig,
                              model_path: Path) -> NextLayerPredictor:
    """The predictor of ``kind`` built from its offline file.

    Raises:
        CalibrationError: its file is missing, corrupt or made for another model.
        OptionError: a kind that needs no file or that this build cannot make.
    """
    builder = BUILDERS.get(kind)
    if builder is None:
        raise OptionError(f"--predictor {kind.value} is not made from a calibration file",
                          "use --predictor none, router, quasi, estimator or hybrid")
    return builder(adapter, refs, cfg, Path(model_path))
