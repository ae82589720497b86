"""Where experts live on the host: the packed store, pinned memory, checkpoint reading, the quantised-store file.

store.py (ExpertStore: every expert one contiguous row of one buffer, so one copy moves one expert),
memory.py (the host RAM check; exact-size pinned buffers), checkpoint.py (a checkpoint read tensor by
tensor through a bounded window of its file mapping), quant_store.py (the int8/int4 store kept on
disk, so the second start does not quantise again).
"""

from moespec.runtime.host.memory import PinnedBuffer, available_bytes, check_host_memory
from moespec.runtime.host.checkpoint import iter_tensors, safetensors_files
from moespec.runtime.host.quant_store import QuantStoreCache
from moespec.runtime.host.store import ExpertStore

__all__ = ["ExpertStore", "PinnedBuffer", "QuantStoreCache", "available_bytes", "check_host_memory", "iter_tensors", "safetensors_files"]
