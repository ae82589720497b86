"""Predictors: from layer l's state, the routing that the next MoE layer will most likely use."""

from moespec.predict.base import LayerRef, NextLayerPredictor, NoPredictor, RouterPredictor

__all__ = ["LayerRef", "NextLayerPredictor", "NoPredictor", "RouterPredictor"]
