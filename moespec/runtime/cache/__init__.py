"""The device side: slots holding packed experts, eviction rules, the prefetch ledger, the replay.

slots.py (ExpertCache: one record per slot; a prefetch takes slots as a miss would), eviction.py
(``--cache-policy``: lru, lfu, lfru, static, seeded from the calibration file), replay.py (a routing
trace through the real cache, no bytes moved: hit rates per policy).
"""

from moespec.runtime.cache.eviction import EvictionRule, make_rule, resolve_policy
from moespec.runtime.cache.replay import ReplayResult, replay
from moespec.runtime.cache.slots import Acquired, ExpertCache

__all__ = ["Acquired", "EvictionRule", "ExpertCache", "ReplayResult", "make_rule", "replay", "resolve_policy"]
