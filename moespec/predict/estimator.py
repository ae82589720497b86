"""`estimator` and `hybrid`: per layer, the router, the quasi state or a trained estimator.

Shapes: T tokens, H hidden, E experts, K top-k.

At a layer served by an estimator, the state q = LN_{l'}(r_l + d_l) (or LN_{l'}(r_l) for estimators
trained without calibration) goes through the small network, whose logits z_{l'} [T, E] are turned
into a routing by the next layer's own rule. Elsewhere the prediction is the `quasi` or `router`
one. `estimator` uses estimators wherever the file has them; `hybrid` follows the per-layer choice
that `moespec train-estimator` made by held-out recall and measured cost.
"""

from __future__ import annotations

import torch

from moespec.models.base import MoeAdapter, Routing
from moespec.predict.base import LayerRef, RouterPredictor
from moespec.predict.estimator_net import EstimatorBank
from moespec.predict.quasi import quasi_delta


class EstimatorPredictor(RouterPredictor):
    """Per-layer router / quasi / estimator prediction.

    Args:
        adapter, refs: as RouterPredictor.
        bank: the trained estimators (on the device, in the dense dtype).
        modes: source MoE layer -> "router", "quasi" or "estimator" (absent = "router").
        input_vectors: served layer -> default vectors [E, H] the estimator's input adds (None: input r_l).
        quasi_vectors: layer -> calibrated default vectors [E, H] for the "quasi" layers.
        name: "estimator" or "hybrid" (how statistics and reports call it).
    """

    def __init__(self, adapter: MoeAdapter, refs: list[LayerRef], bank: EstimatorBank, modes: dict[int, str],
                 input_vectors: dict[int, torch.Tensor] | None, quasi_vectors: dict[int, torch.Tensor] | None,
                 name: str = "estimator") -> None:
        super().__init__(adapter, refs)
        self.bank = bank
        self.modes = dict(modes)
        self.input_vectors = input_vectors
        self.quasi_vectors = quasi_vectors or {}
        self.name = name
        self._dtype = next(bank.parameters()).dtype

    def signal(self, layer: int, residual: torch.Tensor, used: Routing) -> torch.Tensor:
        """r_l + d_l on "quasi" layers, r_l elsewhere (the router-based layers)."""
        if self.modes.get(layer) == "quasi":
            d = quasi_delta(self.quasi_vectors[layer], used)  # [T, H] float32
            return (residual.float() + d).to(residual.dtype)
        return residual

    def estimator_input(self, layer: int, residual: torch.Tensor, used: Routing) -> torch.Tensor:
        """The estimator's state q [T, H] at served ``layer``."""
        sig = residual
        if self.input_vectors is not None:
            sig = (residual.float() + quasi_delta(self.input_vectors[layer], used)).to(residual.dtype)  # [T, H]
        return self.target(layer).norm(sig)

    def predict(self, layer: int, residual: torch.Tensor, used: Routing) -> Routing | None:
        nxt = self.target(layer)
        if nxt is None:
            return None
        if self.modes.get(layer) != "estimator":
            return super().predict(layer, residual, used)
        q = self.estimator_input(layer, residual, used)  # [T, H]
        z = self.bank(q.to(self._dtype), layer)  # [T, E]
        return self.adapter.select(nxt.block, z.to(residual.dtype))
