"""Time bounds of one decode step from measured per-layer times and the measured link bandwidth.

For each decoder layer l of a step:
  compute_l = the layer's wall time minus the time it stalled on copies (attention, router,
              predictor and expert compute: what the compute side itself spends);
  copy_l    = bytes of the experts layer l needed that the cache did not hold from earlier tokens
              (demand misses + prefetched experts it used) / link bandwidth.
Then, with other = step wall time outside the decoder layers (embedding, final norm, lm_head):
  on-demand = other + Σ_l (compute_l + copy_l)        every copy waited for (no overlap)
  floor     = other + Σ_l max(compute_l, copy_l)      every copy hidden behind compute (perfect overlap)
Only fewer bytes (more cache hits, smaller experts) go below the floor. Wasted prefetches are
not in it: they are the cost of a wrong prediction, which the distance to the floor shows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepBounds:
    """Bounds of one decode step, in milliseconds.

    Attributes:
        on_demand_ms: Σ (compute + copy) + other.
        floor_ms: Σ max(compute, copy) + other.
        compute_ms: Σ compute_l + other (the step without any copy).
        copy_ms: Σ copy_l (the needed bytes at the link bandwidth).
    """

    on_demand_ms: float
    floor_ms: float
    compute_ms: float
    copy_ms: float


def step_bounds(wall_ms: float, layer_ms: dict[int, float], stall_ms: dict[int, float],
                missed: dict[int, int], expert_bytes: int, link_gbps: float) -> StepBounds:
    """Bounds of one step.

    Args:
        wall_ms: the step's measured wall time.
        layer_ms: decoder layer -> its measured wall time in this step.
        stall_ms: decoder layer -> time it waited for copies (absent = 0).
        missed: decoder layer -> experts it used that were not resident from earlier tokens.
        expert_bytes: bytes of one packed expert.
        link_gbps: measured host-to-device bandwidth in GB/s (10^9 bytes/s).
    """
    other = max(0.0, wall_ms - sum(layer_ms.values()))
    on_demand = floor = compute_total = other
    copy_total = 0.0
    for layer, ms in layer_ms.items():
        compute = max(0.0, ms - stall_ms.get(layer, 0.0))
        copy = missed.get(layer, 0) * expert_bytes / (link_gbps * 1e9) * 1e3
        on_demand += compute + copy
        floor += max(compute, copy)
        compute_total += compute
        copy_total += copy
    return StepBounds(on_demand_ms=on_demand, floor_ms=floor, compute_ms=compute_total, copy_ms=copy_total)
