"""One MoE layer of a forward pass: the runner, the guard, the expert sums, routing statistics.

runner.py (MoeLayerRunner: route, predict, one host read, plan misses, stream, prefetch, combine),
guard.py (`guarded` mode's skip-and-substitute decision), experts.py (expert compute from packed
rows, summed as transformers sums; the slow references), routing_stats.py (recall and skipped
mass, kept on the device until the step ends).
"""

from moespec.runtime.layer.runner import MoeLayerRunner

__all__ = ["MoeLayerRunner"]
