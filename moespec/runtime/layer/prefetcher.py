"""Prefetcher: the next MoE layer's routing predicted inside layer l, and its experts pinned ahead.

Shapes: T tokens, H hidden, K top-k.

Inside decode layer l (once r_l exists) :meth:`Prefetcher.predict` asks the predictor for the
routing of l' (the next MoE layer), unless the miss handler's prediction gate says it does not pay
(``--on-miss auto``). After l's demand copies are queued, :meth:`Prefetcher.prefetch` keeps the
prediction for l' (speculative mode runs it there; its recall is measured there) and has the
ledger pin or copy its experts (runtime/cache/ledger.py). :class:`NoPrefetcher` is the no-op twin
for ``--predictor none``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moespec.models.base import Routing
from moespec.predict.base import NextLayerPredictor
from moespec.runtime.cache.ledger import PrefetchLedger
from moespec.runtime.misses.handlers import FetchMisses
from moespec.runtime.stats import StatsRecorder


@dataclass(frozen=True)
class Prediction:
    """A predicted routing (ids/weights [1, K] on the device) and its ids already read to the host."""

    routing: Routing
    host_ids: list[int]


class NoPrefetcher:
    """``--predictor none``: nothing is predicted, nothing prefetched (on-demand loading)."""

    def take(self, layer: int) -> Prediction | None:
        """The prediction made for ``layer`` by the layer before it (consumed), or None."""
        return None

    def predict(self, layer: int, residual: torch.Tensor | None, used: Routing) -> Routing | None:
        """The predicted routing of the MoE layer after ``layer`` [1, K] (on the device), or None."""
        return None

    def clear(self) -> None:
        """Forget the predictions of an unfinished forward."""


class Prefetcher(NoPrefetcher):
    """Predicts with ``predictor`` and prefetches through ``ledger``; ``misses`` gates and bounds it.

    Args:
        predictor: the next-layer predictor.
        ledger: the prefetch ledger of the model's cache.
        misses: the miss handler of the policy (its prediction gate and prefetch plan).
    """

    def __init__(self, predictor: NextLayerPredictor, ledger: PrefetchLedger, misses: FetchMisses) -> None:
        self.predictor = predictor
        self.ledger = ledger
        self.misses = misses
        self.predicted: dict[int, Prediction] = {}  # target layer -> its prediction
        self._predict_s = 0.0  # the running layer's prediction time (the gate's overhead)

    def take(self, layer: int) -> Prediction | None:
        return self.predicted.pop(layer, None)

    def predict(self, layer: int, residual: torch.Tensor | None, used: Routing) -> Routing | None:
        if residual is None or not self.misses.pays():
            return None
        t0 = time.perf_counter()
        # `used` is the true routing in exact/guarded, as NextLayerPredictor says
        nxt = self.predictor.predict(layer, residual.reshape(-1, residual.shape[-1]), used)
        self._predict_s = time.perf_counter() - t0
        return nxt

    def prefetch(self, layer: int, prediction: Prediction, recorder: StatsRecorder) -> None:
        """Keep ``prediction`` for the MoE layer after ``layer`` and pin its experts (resident ones
        first, then copies the cache admits); its copies count in that layer's stats."""
        t0 = time.perf_counter()
        target = self.predictor.target(layer).layer
        self.predicted[target] = prediction
        wanted, budget = self.misses.prefetch_plan(prediction.host_ids, self.ledger.cache)
        self.ledger.issue(target, wanted, recorder.layer(target), budget)
        self.misses.observe_predict((self._predict_s + time.perf_counter() - t0) * 1e3)

    def clear(self) -> None:
        self.predicted.clear()
