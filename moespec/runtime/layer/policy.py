"""LayerPolicy: how the MoE layers of a loaded model run, as one frozen value.

The loader makes one from the RuntimeConfig; a job swaps the whole value (``OffloadedModel.use_policy``),
e.g. ``moespec profile`` runs every strategy with its own and puts the first one back.
"""

from __future__ import annotations

from dataclasses import dataclass

from moespec.config import DEFAULT_FETCH_THRESHOLD, ExecuteMode, GuardRule, OnMiss, RuntimeConfig
from moespec.predict.base import NextLayerPredictor


@dataclass(frozen=True)
class LayerPolicy:
    """The settings of the layer runner.

    Attributes:
        predictor: predicts the next MoE layer's routing (NoPredictor: on-demand loading).
        execute: what runs when a prediction was wrong (``--execute``).
        on_miss: where a cache miss runs (``--on-miss``).
        fetch_threshold: τ of `guarded` mode, in renormalised gate weight (``--fetch-threshold``).
        guard_rule: how τ picks the misses `guarded` skips (``--guard-rule``; guard.py).
        guard_substitute: run the best resident expert in place of a skipped one.
        prediction_gate: exact and guarded layers predict only while it pays (gate.py).
        batch_experts: a decode layer whose experts are all resident computes them in one call
            (runner.py ``_batched``); False: one at a time, through the stream (the reference).
        ahead_recall: read layer l+2's predicted rows while l computes once the lookahead's running
            recall is at least this (ahead.py); None: off (the default).
        token_start: a decode step predicts and prefetches its first MoE layer before that layer runs
            (token_start.py); False: only layer l -> l+1 (the reference it is measured against).
    """

    predictor: NextLayerPredictor
    execute: ExecuteMode = ExecuteMode.EXACT
    on_miss: OnMiss = OnMiss.FETCH
    fetch_threshold: float = DEFAULT_FETCH_THRESHOLD
    guard_rule: GuardRule = GuardRule.BUDGET
    guard_substitute: bool = True
    prediction_gate: bool = True
    batch_experts: bool = True
    ahead_recall: float | None = None
    token_start: bool = True

    @classmethod
    def from_config(cls, cfg: RuntimeConfig, predictor: NextLayerPredictor) -> LayerPolicy:
        """The policy ``cfg`` asks for, with ``predictor`` (made from ``cfg.predictor``)."""
        return cls(predictor, cfg.execute, cfg.on_miss, cfg.fetch_threshold, cfg.guard_rule, cfg.guard_substitute,
                   cfg.prediction_gate)
