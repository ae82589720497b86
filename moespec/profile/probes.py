"""Measurement probes installed on one model instance for the duration of a profile.

- LayerTimer: a forward pre-hook and hook on every decoder layer mark the start and end of the
  layer on the transfer engine's clock (perf_counter on CPU, timing events on CUDA: no host sync
  inside the step). Per-layer wall time minus the layer's stall is its compute time (bounds).
- CopyLog: wraps the cache's transfer engine and remembers every copy with its expert and
  whether it was a demand copy or a prefetch (Chrome trace).

Both are read after the step ended (the recorder synchronised the device), and both are removed
when the profile ends, so the model is left as it was.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

from moespec.runtime.transfer import Span, Ticket, TransferEngine


class LayerTimer:
    """One Span per decoder layer per step.

    Args:
        layers: the decoder layers (``model.model.layers``).
        engine: the transfer engine whose ``mark()`` gives the clock.
    """

    def __init__(self, layers, engine: TransferEngine) -> None:
        self.engine = engine
        self.current: int | None = None  # the decoder layer running now
        self._start = None
        self._spans: list[tuple[int, Span]] = []
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre(i)))
            self._handles.append(layer.register_forward_hook(self._post(i)))

    def _pre(self, i: int):
        def hook(module, args):
            self.current = i
            self._start = self.engine.mark()

        return hook

    def _post(self, i: int):
        def hook(module, args, output):
            self._spans.append((i, Span(self._start, self.engine.mark())))
            self.current = None

        return hook

    def take(self) -> list[tuple[int, Span]]:
        """The (layer, span) pairs since the last call (resolve only after a synchronize)."""
        out, self._spans = self._spans, []
        return out

    def remove(self) -> None:
        """Detach the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


@dataclass
class CopyRecord:
    """One host-to-device copy: expert (layer, expert), kind "demand" or "prefetch", its ticket."""

    layer: int
    expert: int
    kind: str
    ticket: Ticket


class CopyLog:
    """Stands in for the cache's transfer engine: delegates everything to ``inner`` and logs each copy.

    Args:
        inner: the real engine.
        cache: the expert cache (to name the expert a slot receives).
    """

    def __init__(self, inner: TransferEngine, cache) -> None:
        self.inner = inner
        self.cache = cache
        self.copies: list[CopyRecord] = []

    def submit(self, dst, src, slot: int, prefetch: bool = False) -> Ticket:
        ticket = self.inner.submit(dst, src, slot, prefetch)
        layer, expert = self.cache.key_of(slot)  # set by the cache before it submits
        self.copies.append(CopyRecord(layer, expert, "prefetch" if prefetch else "demand", ticket))
        return ticket

    def take(self) -> list[CopyRecord]:
        """Copies since the last call (cancelled prefetches never get a start time)."""
        out, self.copies = self.copies, []
        return out

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # wait, cancel, mark, synchronize, bytes_moved, ...


@contextlib.contextmanager
def installed(om) -> Iterator[tuple[LayerTimer, CopyLog]]:
    """Install a LayerTimer and a CopyLog on ``om``; remove both on exit."""
    inner = om.cache.engine
    timer = LayerTimer(om.model.model.layers, inner)
    log = CopyLog(inner, om.cache)
    om.cache.engine = log
    try:
        yield timer, log
    finally:
        om.cache.engine = inner
        timer.remove()
