"""Hit rate of every cache policy on the profile's own routing trace (replayed, no bytes moved).

Each prompt length's `exact` run recorded the routing of every decode step; it is replayed
through the runtime's ExpertCache (runtime/cache/replay.py) at the profile's cache size, from an
empty cache, on-demand (no prediction), once per policy. Seeded policies (lfu, lfru, static)
appear only when the model has a calibration file. Per layer and in total.
"""

from __future__ import annotations

from functools import partial

from moespec.config import CachePolicy
from moespec.runtime.cache.eviction import make_rule
from moespec.runtime.cache.replay import replay


def policy_hit_rates(routings: list[dict], num_slots: int, top_k: int, seed: dict | None) -> dict:
    """policy -> {"hit_rate": float, "per_layer": {layer (str): float}} for one trace.

    Args:
        routings: per decode step, layer -> Routing (ids [1, K]) as TokenTrace.routings holds them.
        num_slots: S, the profile's cache slots.
        top_k: K.
        seed: use probabilities from the calibration file, or None (then only lru).
    """
    trace = [{layer: r.ids[0].tolist() for layer, r in sorted(step.items())} for step in routings]
    out = {}
    for policy in CachePolicy:
        if policy.needs_calibration and seed is None:
            continue
        res = replay(trace, num_slots, partial(make_rule, policy, seed, num_slots, top_k), prefetch_slots=0)
        layers = sorted(set(res.hits) | set(res.misses))
        out[policy.value] = {"hit_rate": res.hit_rate(), "per_layer": {str(la): res.hit_rate(la) for la in layers}}
    return out
