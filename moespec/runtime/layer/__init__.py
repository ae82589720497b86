"""One MoE layer of a forward pass: the runner, its policy and twins, the guard, the expert sums.

runner.py (MoeLayerRunner: route, predict, one host read, plan misses, stream, prefetch, combine),
policy.py (LayerPolicy: the runner's settings as one frozen value), prefetcher.py (the next layer's
prediction and its prefetch; NoPrefetcher), observer.py (what jobs may watch; the no-op Observer,
RoutingLog), guard.py (`guarded` mode's skip-and-substitute decision), experts.py (expert compute
from packed rows, summed as transformers sums; the slow references), routing_stats.py (recall and
skipped mass, kept on the device until the step ends).
"""

from moespec.runtime.layer.observer import Observer, RoutingLog
from moespec.runtime.layer.policy import LayerPolicy
from moespec.runtime.layer.runner import MoeLayerRunner

__all__ = ["LayerPolicy", "MoeLayerRunner", "Observer", "RoutingLog"]
