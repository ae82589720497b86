"""Device-side counters of a routing against the true one: recall@K of a prediction, skipped experts.

Shapes: T tokens, K top-k. Counters stay on the device (StatsRecorder.count) until the step ends,
so recording adds no host sync to a layer.
"""

from __future__ import annotations

from moespec.models.base import Routing
from moespec.runtime.stats import LayerStats, StatsRecorder


def record_recall(rec: StatsRecorder, stats: LayerStats, predicted: Routing, true: Routing) -> None:
    """recall@K and weighted recall of ``predicted`` against ``true`` (ids/weights [T, K]), kept on the device."""
    hit = (predicted.ids.unsqueeze(-1) == true.ids.unsqueeze(-2)).any(dim=-2)  # [T, K] true k predicted?
    w = true.weights.float()
    rec.count(stats, "recall_hits", hit.sum())
    stats.recall_total += hit.numel()
    rec.count(stats, "weighted_hit", (w * hit).sum())
    rec.count(stats, "weighted_total", w.sum())


def record_skipped(rec: StatsRecorder, stats: LayerStats, ran: Routing, true: Routing) -> None:
    """True top-K experts that did not run, and their share of the true top-K gate mass (device counters)."""
    ran_hit = (true.ids.unsqueeze(-1) == ran.ids.unsqueeze(-2)).any(dim=-1)  # [T, K]
    rec.count(stats, "skipped", (~ran_hit).sum())
    w = true.weights.float()  # [T, K]
    rec.count(stats, "skipped_mass", (w / w.sum(dim=-1, keepdim=True) * ~ran_hit).sum())  # renormalised share
