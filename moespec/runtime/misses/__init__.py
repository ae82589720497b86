"""Where a cache miss runs (``--on-miss``): fetched into a slot, or computed on the host pool.

planner.py (MissPlanner: measured costs, the per-layer fetch-or-host plan, prefetch budget and
whether predicting pays under ``auto``), host_pool.py (HostExpertPool: worker threads computing
missed experts from their store rows), handlers.py (what the layer runner asks, one class per mode:
FetchMisses, the no-op twin, HostMisses, AutoMisses).
"""

from moespec.runtime.misses.handlers import AutoMisses, FetchMisses, HostMisses, miss_handler
from moespec.runtime.misses.host_pool import HostExpertPool, default_host_threads
from moespec.runtime.misses.planner import Costs, MissPlanner, measure_costs

__all__ = ["AutoMisses", "Costs", "FetchMisses", "HostExpertPool", "HostMisses", "MissPlanner", "default_host_threads",
           "measure_costs", "miss_handler"]
