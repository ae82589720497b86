"""The predictor named by ``--predictor``; the ones that need a file made offline: `quasi`
(calibration), `estimator` and `hybrid`.

:func:`make_predictor` makes every kind but `oracle` (profile builds it from a recorded trace);
the file-based kinds have one builder each in ``BUILDERS``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from moespec.artifacts import find_calibration, find_estimator, model_key
from moespec.config import Predictor, RuntimeConfig
from moespec.errors import CalibrationError, OptionError
from moespec.models.base import MoeAdapter
from moespec.predict.base import LayerRef, NextLayerPredictor, NoPredictor, RouterPredictor
from moespec.predict.calibration_file import load_checked, router_fingerprint
from moespec.predict.estimator import EstimatorPredictor
from moespec.predict.estimator_file import check_matches, load_estimator
from moespec.predict.quasi import QuasiPredictor

Builder = Callable[[MoeAdapter, list[LayerRef], RuntimeConfig, Path], NextLayerPredictor]


def _calibration_vectors(adapter: MoeAdapter, refs: list[LayerRef], cfg: RuntimeConfig,
                         model_path: Path) -> dict[int, torch.Tensor]:
    """Decoder layer -> calibrated default vectors [E, H] (float32, on the routers' device).

    Raises:
        CalibrationError: no file (names `moespec calibrate MODEL`), corrupt, or made for another model.
    """
    path = find_calibration(model_path, cfg.calibration_path)
    layers = [r.layer for r in refs]
    calib = load_checked(path, adapter.config, layers, [r.block.gate.weight for r in refs], model_path)
    device = refs[0].block.gate.weight.device if refs else "cpu"
    return {layer: calib.vectors[m].to(device) for m, layer in enumerate(layers)}  # [E, H] float32 each


def build_quasi(adapter: MoeAdapter, refs: list[LayerRef], cfg: RuntimeConfig, model_path: Path) -> NextLayerPredictor:
    """QuasiPredictor with the model's calibration file (found automatically or ``cfg.calibration_path``).

    Raises:
        CalibrationError: no file (names `moespec calibrate MODEL`), corrupt, or made for another model.
    """
    return QuasiPredictor(adapter, refs, _calibration_vectors(adapter, refs, cfg, model_path))


def build_estimator(adapter: MoeAdapter, refs: list[LayerRef], cfg: RuntimeConfig, model_path: Path) -> NextLayerPredictor:
    """`estimator`: trained estimators wherever the file has them; `quasi` elsewhere when the model is
    calibrated, else `router`. The file is ``cfg.estimator_path`` (``--estimator``) when set, else the
    one `moespec train-estimator` wrote for the model.

    Raises:
        CalibrationError: no estimator file (names `moespec train-estimator MODEL`), corrupt, or another
            model's; for an explicit file the message names the path and ``--estimator``.
    """
    return _estimator_predictor(adapter, refs, cfg, model_path, hybrid=False)


def build_hybrid(adapter: MoeAdapter, refs: list[LayerRef], cfg: RuntimeConfig, model_path: Path) -> NextLayerPredictor:
    """`hybrid`: the per-layer choice `moespec train-estimator` recorded in the estimator file
    (``cfg.estimator_path`` when set, else found automatically).

    Raises:
        CalibrationError: no estimator file (or an explicit one that is missing, corrupt or another model's),
            or a layer chose `quasi` and the calibration file is missing.
    """
    return _estimator_predictor(adapter, refs, cfg, model_path, hybrid=True)


def _estimator_predictor(adapter: MoeAdapter, refs: list[LayerRef], cfg: RuntimeConfig, model_path: Path,
                         hybrid: bool) -> NextLayerPredictor:
    flag = "--estimator" if cfg.estimator_path is not None else None  # an explicit file wins over the default one
    path = find_estimator(model_path, cfg.estimator_path)
    ef = load_estimator(path, flag)
    check_matches(ef, path, adapter.config, [r.layer for r in refs],
                  router_fingerprint([r.block.gate.weight for r in refs]), model_key(model_path), flag)
    weight = refs[0].block.gate.weight
    bank = ef.bank.to(device=weight.device, dtype=weight.dtype)
    if hybrid:
        modes = dict(ef.choice)
        quasi = _calibration_vectors(adapter, refs, cfg, model_path) if "quasi" in modes.values() else None
    else:
        quasi = _calibration_vectors(adapter, refs, cfg, model_path) if _has_calibration(cfg, model_path) else None
        fallback = "quasi" if quasi is not None else "router"
        modes = {r.layer: "estimator" if r.layer in ef.layers else fallback for r in refs}
    inputs = None
    if ef.vectors is not None:
        inputs = {layer: ef.vectors[i].to(weight.device) for i, layer in enumerate(ef.layers)}  # [E, H] each
    return EstimatorPredictor(adapter, refs, bank, modes, inputs, quasi, name="hybrid" if hybrid else "estimator")


def _has_calibration(cfg: RuntimeConfig, model_path: Path) -> bool:
    try:
        find_calibration(model_path, cfg.calibration_path)
    except CalibrationError:
        return False
    return True


# Predictor kind -> builder.
BUILDERS: dict[Predictor, Builder] = {
    Predictor.QUASI: build_quasi,
    Predictor.ESTIMATOR: build_estimator,
    Predictor.HYBRID: build_hybrid,
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


def make_predictor(kind: Predictor, adapter: MoeAdapter, refs: list[LayerRef], cfg: RuntimeConfig,
                   model_path: Path) -> NextLayerPredictor:
    """The predictor named by ``--predictor`` over the MoE layers ``refs``.

    Raises:
        CalibrationError: a file-based predictor whose file is missing, corrupt or another model's.
        OptionError: `oracle` (profile builds it from a recorded trace).
    """
    if kind == Predictor.NONE:
        return NoPredictor(adapter, refs)
    if kind == Predictor.ROUTER:
        return RouterPredictor(adapter, refs)
    return make_calibrated_predictor(kind, adapter, refs, cfg, model_path)
