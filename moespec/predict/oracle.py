"""`oracle`: the true routing of the next layer, replayed from a recorded run (profile only).

Shapes: T tokens, K top-k.

`moespec profile` records, for every decode step of the `exact` run, the routing each MoE layer
ran with. Replaying it as the prediction shows the best any predictor could do with the same
memory and the same token trace: an upper bound, never a strategy for real inference (it needs
the answer before it is computed), which is why RuntimeConfig refuses it.
"""

from __future__ import annotations

import torch

from moespec.models.base import MoeAdapter, Routing
from moespec.predict.base import LayerRef, NextLayerPredictor


class OraclePredictor(NextLayerPredictor):
    """Replays recorded routings; the caller sets ``step`` before each decode forward.

    Args:
        adapter: the architecture adapter.
        refs: the MoE layers, in order.
        routings: per decode step, the routing each MoE layer ran with (layer -> Routing).
    """

    name = "oracle"

    def __init__(self, adapter: MoeAdapter, refs: list[LayerRef], routings: list[dict[int, Routing]]) -> None:
        super().__init__(adapter, refs)
        self.routings = routings
        self.step = 0

    def predict(self, layer: int, residual: torch.Tensor, used: Routing) -> Routing | None:
        nxt = self.target(layer)
        if nxt is None or self.step >= len(self.routings):
            return None
        recorded = self.routings[self.step].get(nxt.layer)
        if recorded is None:
            return None
        return Routing(ids=recorded.ids, weights=recorded.weights)  # ids/weights [T, K]

    def predict_first(self, state: torch.Tensor) -> Routing | None:
        """The recorded routing of the first MoE layer at ``step`` (the state is not needed)."""
        first = self.first
        recorded = None if first is None or self.step >= len(self.routings) else self.routings[self.step].get(first.layer)
        return None if recorded is None else Routing(ids=recorded.ids, weights=recorded.weights)
