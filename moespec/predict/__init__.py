"""Predictors: from layer l's state, the routing that the next MoE layer will most likely use.

base.py (the interface, `none`, `router`), quasi.py, estimator.py (`estimator`, `hybrid`), oracle.py
(profile only), factory.py (the predictor ``--predictor`` names). Below every reader of the files the
jobs write: calibration_file.py (what `moespec calibrate` writes), estimator_file.py and
estimator_net.py (what `moespec train-estimator` writes and the network in it), recall.py (recall@K
of predictors against the true routing). Where those files live: moespec.artifacts.
"""

from moespec.predict.base import LayerRef, NextLayerPredictor, NoPredictor, RouterPredictor

__all__ = ["LayerRef", "NextLayerPredictor", "NoPredictor", "RouterPredictor"]
