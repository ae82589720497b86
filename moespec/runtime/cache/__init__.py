"""The device side: slots holding packed experts, eviction rules, the layer protocol, the replay.

slot.py (one record per slot: its state, pins, copy), slots.py (ExpertCache: a prefetch takes slots
as a miss would), eviction.py (``--cache-policy``: lru, lfu, lfru, static, seeded from the
calibration file), ledger.py (the pins a prediction holds for a later layer: issue, settle, drop),
stream.py (one call streams a layer's experts in the order their copies land), replay.py (a routing
trace through the same cache, ledger and stream, no bytes moved: hit rates per policy).
"""

from moespec.runtime.cache.eviction import EvictionRule, make_rule, resolve_policy
from moespec.runtime.cache.ledger import PrefetchLedger
from moespec.runtime.cache.replay import ReplayResult, replay
from moespec.runtime.cache.slot import Slot, SlotState
from moespec.runtime.cache.slots import Acquired, ExpertCache
from moespec.runtime.cache.stream import stream

__all__ = ["Acquired", "EvictionRule", "ExpertCache", "PrefetchLedger", "ReplayResult", "Slot", "SlotState",
           "make_rule", "replay", "resolve_policy", "stream"]
