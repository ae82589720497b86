"""Prefetcher: the next MoE layer's routing predicted inside layer l, and its experts pinned ahead.

Shapes: T tokens, H hidden, K top-k.

Inside decode layer l (once r_l exists) :meth:`Prefetcher.predict` asks the predictor for the
routing of l' (the next MoE layer), unless the miss handler's prediction gate says it does not pay
(``--on-miss auto``). After l's demand copies are queued, :meth:`Prefetcher.prefetch` keeps the
prediction for l' (speculative mode runs it there; its recall is measured there) and has the
ledger pin or copy its experts (runtime/cache/ledger.py). Exact and guarded layers predict only while the per-layer gate
(gate.py) says prefetching pays. At the start of a decode forward :meth:`Prefetcher.prefetch_first`
predicts the new token's first MoE layer (token_start.py) and prefetches it the same way, under the
gate's ``TOKEN_START`` entry. :class:`NoPrefetcher` is the no-op twin for ``--predictor none``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moespec.models.base import Routing
from moespec.predict.base import NextLayerPredictor
from moespec.runtime.cache.ledger import PrefetchLedger
from moespec.runtime.layer.gate import PredictionGate
from moespec.runtime.layer.token_start import TOKEN_START, TokenStart
from moespec.runtime.misses.handlers import FetchMisses
from moespec.runtime.stats import LayerStats, StatsRecorder


@dataclass(frozen=True)
class Prediction:
    """A predicted routing (ids/weights [1, K] on the device), its ids already read to the host (in
    the routing's order: speculative mode runs them), and the same ids highest predicted weight first
    (the prefetch order: the likeliest rows are read first, so a demand miss more often finds its
    row landed; ``best_first`` empty: use ``host_ids``)."""

    routing: Routing
    host_ids: list[int]
    best_first: list[int] = ()


class NoPrefetcher:
    """``--predictor none``: nothing is predicted, nothing prefetched (on-demand loading)."""

    def take(self, layer: int) -> Prediction | None:
        """The prediction made for ``layer`` by the layer before it (consumed), or None."""
        return None

    def predict(self, layer: int, residual: torch.Tensor | None, used: Routing, stats: LayerStats) -> Routing | None:
        """The predicted routing of the MoE layer after ``layer`` [1, K] (on the device), or None;
        ``stats``: ``layer``'s, where a prediction made or gated is counted."""
        return None

    def clear(self) -> None:
        """Forget the predictions of an unfinished forward."""

    def observed(self, layer: int, used: int, wasted: int) -> None:
        """``layer``, which a prediction was made for, ran: ``used`` / ``wasted`` of its prefetch copies."""

    def prefetch_first(self, start: TokenStart, recorder: StatsRecorder) -> None:
        """A decode forward starts: predict its first MoE layer from the token's quasi-hidden state
        (``start.state()`` [1, H], token_start.py) and prefetch it."""


class Prefetcher(NoPrefetcher):
    """Predicts with ``predictor`` and prefetches through ``ledger``; ``misses`` gates and bounds it.

    Args:
        predictor: the next-layer predictor.
        ledger: the prefetch ledger of the model's cache.
        misses: the miss handler of the policy (``--on-miss auto``'s gate and prefetch plan).
        gate: the per-layer prediction gate (gate.py); None: every layer predicts (speculative mode).
    """

    def __init__(self, predictor: NextLayerPredictor, ledger: PrefetchLedger, misses: FetchMisses,
                 gate: PredictionGate | None = None) -> None:
        self.predictor = predictor
        self.ledger = ledger
        self.misses = misses
        self.gate = gate
        self.predicted: dict[int, Prediction] = {}  # target layer -> its prediction
        self._source: dict[int, int] = {}  # target layer -> the layer that predicted it
        self._predict_s = 0.0  # the running layer's prediction time (the gate's overhead)

    def take(self, layer: int) -> Prediction | None:
        return self.predicted.pop(layer, None)

    def predict(self, layer: int, residual: torch.Tensor | None, used: Routing, stats: LayerStats) -> Routing | None:
        if residual is None or not self.misses.pays():
            return None
        if self.gate is not None and self.predictor.target(layer) is not None and not self.gate.admits(layer):
            stats.predict_gated += 1
            return None
        t0 = time.perf_counter()
        # `used` is the true routing in exact/guarded, as NextLayerPredictor says
        nxt = self.predictor.predict(layer, residual.reshape(-1, residual.shape[-1]), used)
        self._predict_s = time.perf_counter() - t0
        stats.predicted += nxt is not None
        return nxt

    def prefetch(self, layer: int, prediction: Prediction, recorder: StatsRecorder) -> None:
        """Keep ``prediction`` for the MoE layer after ``layer`` and pin its experts (resident ones
        first, then copies the cache admits); its copies count in that layer's stats."""
        t0 = time.perf_counter()
        target = self.predictor.target(layer).layer
        self.predicted[target] = prediction
        self._issue(layer, target, list(prediction.best_first or prediction.host_ids), recorder, t0)

    def _issue(self, source: int, target: int, best_first: list[int], recorder: StatsRecorder, t0: float) -> None:
        """Pin / copy ``best_first`` of layer ``target`` (predicted at ``source``: a layer, or
        TOKEN_START); the main-thread time since ``t0`` and the prediction's go to the gates."""
        wanted, budget = self.misses.prefetch_plan(best_first, self.ledger.cache)
        self.ledger.issue(target, wanted, recorder.layer(target), budget)
        ms = (self._predict_s + time.perf_counter() - t0) * 1e3
        self.misses.observe_predict(ms)
        if self.gate is not None:
            self.gate.observe_predict(source, ms)
            self._source[target] = source

    def prefetch_first(self, start: TokenStart, recorder: StatsRecorder) -> None:
        first = self.predictor.first
        if first is None or not self.misses.pays():
            return
        if self.gate is not None and not self.gate.admits(TOKEN_START):  # counted in the gate's report only
            return
        t0 = time.perf_counter()
        got = self.predictor.predict_first(start.state())
        if got is None:
            return
        t1 = time.perf_counter()
        self._predict_s = t1 - t0
        flat = got.ids.reshape(-1)  # [K]
        best = flat[got.weights.reshape(-1).argsort(descending=True, stable=True)].tolist()  # the one host read
        self._issue(TOKEN_START, first.layer, best, recorder, t1)

    def observed(self, layer: int, used: int, wasted: int) -> None:
        source = self._source.pop(layer, None)
        if source is not None and self.gate is not None:
            self.gate.observe_outcome(source, used, wasted)

    def clear(self) -> None:
        self.predicted.clear()
        self._source.clear()
