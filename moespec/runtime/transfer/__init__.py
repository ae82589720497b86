"""Host -> device copies of packed experts: the interface, the CPU thread engine, the CUDA engine.

base.py (Span, Ticket, TransferEngine: what the cache asks of any engine), thread.py (CPU: one copy
thread, demand before prefetch, an emulated link), cuda.py (a demand stream and a windowed,
cancellable prefetch stream). This is the only package that touches CUDA streams and events; the
loader (runtime/load.py) picks the engine for the device.
"""

from moespec.runtime.transfer.base import Span, Ticket, TransferEngine
from moespec.runtime.transfer.cuda import CudaBackend, CudaTransferEngine
from moespec.runtime.transfer.thread import ThreadTransferEngine

__all__ = ["CudaBackend", "CudaTransferEngine", "Span", "ThreadTransferEngine", "Ticket", "TransferEngine"]
