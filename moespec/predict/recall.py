"""Per-layer prediction quality on held-out tokens: recall@K, weighted recall, cosine similarity.

Shapes: T tokens, H hidden, K top-k, E experts.

For every MoE layer l with a next MoE layer l', each predictor turns (r_l, routing of l) into a
state q = LN_{l'}(signal) and a predicted routing of l'; when l' runs, both are compared with the
truth: recall@K = |predicted ∩ true top-K| / K, weighted recall = true gate mass covered, and
cos(q, s_{l'}) against the true router input s_{l'} (the paper's Figures 3 and 4). Results are
indexed by the *predicted* layer l', as the runtime's per-layer statistics are; the first MoE
layer has none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moespec.models.base import MoeAdapter, Routing
from moespec.predict.base import NextLayerPredictor

METRICS = ("recall", "weighted_recall", "cosine")  # the RecallCounts methods, as calibration files name them


@dataclass
class RecallCounts:
    """Accumulated comparison of predictions with the truth at one layer."""

    hits: int = 0  # predicted ∩ true top-K, summed over tokens
    total: int = 0  # K * tokens
    weighted_hit: float = 0.0  # true gate mass of the hits
    weighted_total: float = 0.0  # true gate mass
    cosine_sum: float = 0.0  # sum over tokens of cos(q, s_{l'})
    tokens: int = 0

    def recall(self) -> float:
        return self.hits / self.total if self.total else float("nan")

    def weighted_recall(self) -> float:
        return self.weighted_hit / self.weighted_total if self.weighted_total else float("nan")

    def cosine(self) -> float:
        return self.cosine_sum / self.tokens if self.tokens else float("nan")


def routing_hits(predicted: Routing, true: Routing) -> tuple[int, int, float, float]:
    """(hits, K*T, weighted hit, weighted total) of ``predicted`` against ``true`` (ids [T, K])."""
    hit = (true.ids.unsqueeze(-1) == predicted.ids.unsqueeze(-2)).any(dim=-1)  # [T, K] true k predicted?
    w = true.weights.double()  # [T, K]
    return int(hit.sum()), hit.numel(), float((w * hit).sum()), float(w.sum())


def predict_state(adapter: MoeAdapter, predictor: NextLayerPredictor, layer: int, residual: torch.Tensor,
                  used: Routing) -> tuple[torch.Tensor, Routing] | None:
    """(state q [T, H], predicted routing) of ``predictor`` for the MoE layer after ``layer``.

    The same computation as RouterPredictor.predict, keeping the state for the cosine.
    """
    nxt = predictor.target(layer)
    if nxt is None:
        return None
    state = nxt.norm(predictor.signal(layer, residual, used))  # [T, H]
    return state, adapter.select(nxt.block, adapter.router_logits(nxt.block, state))


class RecallObserver:
    """A MoE-layer observer (runtime.chunks.run_chunks) that scores predictors against the true routing.

    Args:
        adapter: the architecture adapter.
        predictors: name -> a RouterPredictor (or subclass) over the model's layer refs.
    """

    def __init__(self, adapter: MoeAdapter, predictors: dict[str, NextLayerPredictor]) -> None:
        self.adapter = adapter
        self.predictors = predictors
        self.counts: dict[str, dict[int, RecallCounts]] = {name: {} for name in predictors}
        self._pending: dict[int, dict[str, tuple[torch.Tensor, Routing]]] = {}  # target layer -> name -> (q, pred)
        self.ids: dict[int, list[torch.Tensor]] = {}  # layer -> true ids [T, K] per chunk (cache policy replay)

    def routing(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None, routing: Routing) -> None:
        """Score the predictions made for ``layer``; then predict the next MoE layer from r_l."""
        self.ids.setdefault(layer, []).append(routing.ids.detach().cpu())
        for name, (state, pred) in self._pending.pop(layer, {}).items():
            c = self.counts[name].setdefault(layer, RecallCounts())
            hits, total, whit, wtot = routing_hits(pred, routing)
            c.hits += hits
            c.total += total
            c.weighted_hit += whit
            c.weighted_total += wtot
            c.cosine_sum += float(F.cosine_similarity(state.float(), x.float(), dim=-1).double().sum())
            c.tokens += x.shape[0]
        nxt = next(iter(self.predictors.values())).target(layer) if self.predictors else None
        if residual is None or nxt is None:
            return
        r = residual.reshape(-1, residual.shape[-1])  # [T, H]
        self._pending[nxt.layer] = {name: predict_state(self.adapter, p, layer, r, routing)
                                    for name, p in self.predictors.items()}

    def expert_output(self, layer: int, expert: int, token_idx: torch.Tensor, raw_output: torch.Tensor) -> None:
        """Not needed for recall."""

    def reset(self) -> None:
        """Drop predictions of an unfinished forward pass."""
        self._pending.clear()
