"""Ahead prefetch: while layer l computes, layer l+2's predicted rows are read too, where recall allows.

Shapes: T tokens (decode: 1), H hidden, K top-k.

The prefetcher (prefetcher.py) reads layer l+1's predicted experts while layer l computes. On the disk
tier a row takes milliseconds to read, and the disk idles whenever l+1's reads are done before l's
compute is; this reads layer l+2's predicted rows then (issue 27): router_{l+2}(LN_{l+2}(r_l)), the
lookahead (predict/base.py ``predict_ahead``), at the lowest read priority (below every demand read
and every l+1 prefetch read: Ticket.ahead, transfer/queue.py), into free room only (an empty slot or
an unused prediction, while K more stay free for l+1's misses: cache/ahead_slot.py), so a wrong one
never evicts a cached expert. When layer l+1 predicts l+2 again, an ahead copy it agrees with is
confirmed (moved up to the l+1 prefetch priority); when l+2 runs, the ledger settles its ahead pins
with its other pins (kept, cancelled, cut or wasted).

Reads happen only while the lookahead's own running recall (measured at every decode layer it
predicted, ``recall``: mean |predicted ∩ true| / K over the last ``window`` predicted layers) is at
least ``min_recall``; it predicts (one norm and one H x E router product) always, so the recall stays
measured while reads are off. :class:`NoAhead` is the no-op twin and the default: on the disk tier
a full RAM tier never has the free room (docs/decisions.md, 2026-12-03 "Layer l+2 ahead reads").
"""

from __future__ import annotations

from collections import deque

import torch

from moespec.models.base import Routing
from moespec.predict.base import NextLayerPredictor
from moespec.runtime.cache.ledger import PrefetchLedger
from moespec.runtime.stats import StatsRecorder

MIN_RECALL = 0.5  # the lookahead's running recall@K at or above which its rows are read
WINDOW = 64  # predicted layers the running recall averages over
MIN_SEEN = 8  # predicted layers seen before the recall is trusted (reads off until then)


class NoAhead:
    """No ahead prefetch (the default)."""

    recall: float | None = None

    def predict(self, layer: int, residual: torch.Tensor | None) -> Routing | None:
        """The predicted routing [1, K] of the layer after the next, or None."""
        return None

    def observe(self, layer: int, ids: list[int]) -> None:
        """``layer`` runs with the true expert ids ``ids``: the recall of what was predicted for it."""

    def issue(self, layer: int, best_first: list[int], recorder: StatsRecorder) -> int:
        """Read the ahead prediction made at ``layer`` (its ids, highest weight first); copies issued."""
        return 0

    def clear(self) -> None:
        """Forget the predictions of an unfinished forward."""


class AheadPrefetch(NoAhead):
    """Predicts layer l+2 with ``predictor``'s lookahead and reads it through ``ledger`` (module docstring).

    Args:
        predictor: the next-layer predictor (its ``predict_ahead``).
        ledger: the prefetch ledger of the model's cache.
        top_k: K, the free slots kept for the next layer's misses (ahead_slot.py).
        min_recall: the running recall at which reads start.
        window, min_seen: the running recall's window and the layers seen before it counts.
    """

    def __init__(self, predictor: NextLayerPredictor, ledger: PrefetchLedger, top_k: int,
                 min_recall: float = MIN_RECALL, window: int = WINDOW, min_seen: int = MIN_SEEN) -> None:
        self.predictor, self.ledger, self.top_k = predictor, ledger, top_k
        self.min_recall, self.min_seen = min_recall, min_seen
        self._recalls: deque[float] = deque(maxlen=window)
        self._made: dict[int, set[int]] = {}  # target layer -> its predicted ids (for the recall)
        self.issued = 0  # ahead copies issued since creation

    @property
    def recall(self) -> float | None:
        """Running recall@K of the lookahead (None until ``min_seen`` predicted layers, and one, ran)."""
        if not self._recalls or len(self._recalls) < self.min_seen:
            return None
        return sum(self._recalls) / len(self._recalls)

    def reads(self) -> bool:
        """True while the lookahead's recall allows reads (``min_seen`` 0: also before any was measured)."""
        recall = self.recall
        return self.min_seen == 0 if recall is None else recall >= self.min_recall

    def predict(self, layer: int, residual: torch.Tensor | None) -> Routing | None:
        if residual is None:
            return None
        return self.predictor.predict_ahead(layer, residual.reshape(-1, residual.shape[-1]))

    def observe(self, layer: int, ids: list[int]) -> None:
        made = self._made.pop(layer, None)
        if made is not None and ids:
            self._recalls.append(len(made.intersection(ids)) / len(ids))

    def issue(self, layer: int, best_first: list[int], recorder: StatsRecorder) -> int:
        far = self.predictor.ahead(layer)
        if far is None or not best_first:
            return 0
        self._made[far.layer] = set(best_first)
        if not self.reads():
            return 0
        got = self.ledger.issue_ahead(far.layer, best_first, recorder.layer(far.layer), self.top_k)
        self.issued += got
        return got

    def clear(self) -> None:
        self._made.clear()
