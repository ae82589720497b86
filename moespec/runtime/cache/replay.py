"""Replay a routing trace through the real ExpertCache without moving bytes (hit rates per policy).

Shapes: K top-k; a trace is, per decode step, decoder layer -> the K expert ids it ran.

The cache, its areas and its eviction rule are the runtime's own (slots.py); only the store and
the transfer engine are stand-ins (a 1-element row per expert, copies that land at once), so a
replay costs microseconds per expert and gives exactly the hits, misses and copies the runtime's
cache would see for the same sequence of uses. The order inside a step follows layer/runner.py:
unused prefetch pins of layer l are released, l's experts are acquired (resident ones first, all
pinned), l+1's prediction is prefetched (resident ones first), then l's experts are released.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from moespec.runtime.cache.slots import ExpertCache
from moespec.runtime.cache.eviction import EvictionRule
from moespec.runtime.transfer.base import Span, Ticket, TransferEngine

Trace = list[dict[int, list[int]]]  # per step: layer -> expert ids that ran


class _Layout:
    numel = 1


class _NullStore:
    """Stands in for ExpertStore: one float per expert, ``expert_bytes`` as given."""

    def __init__(self, expert_bytes: int) -> None:
        self.layout = _Layout()
        self.dtype = torch.float32
        self.expert_bytes = expert_bytes
        self._row = torch.zeros(1)

    def expert(self, layer: int, e: int) -> torch.Tensor:
        return self._row


class NullEngine(TransferEngine):
    """A transfer engine whose copies land at once and move nothing (cancel always succeeds)."""

    def submit(self, dst: torch.Tensor, src: torch.Tensor, slot: int, prefetch: bool = False) -> Ticket:
        return Ticket(nbytes=0, slot=slot, prefetch=prefetch)

    def cancel(self, ticket: Ticket) -> bool:
        return False  # copies land at once: an unused prefetch has moved its bytes

    def wait(self, ticket: Ticket) -> Span | None:
        ticket.waited = True
        return None

    def landed(self, ticket: Ticket) -> bool:
        return True

    def mark(self) -> float:
        return 0.0


@dataclass
class ReplayResult:
    """Counts of a replay: hits/misses per layer, copies (demand + prefetch), wasted predictions."""

    hits: dict[int, int] = field(default_factory=dict)
    misses: dict[int, int] = field(default_factory=dict)
    copies: int = 0
    prefetch_copies: int = 0
    wasted: int = 0
    steps: int = 0

    def hit_rate(self, layer: int | None = None) -> float:
        """hits / (hits + misses), over every layer or one."""
        h = sum(self.hits.values()) if layer is None else self.hits.get(layer, 0)
        m = sum(self.misses.values()) if layer is None else self.misses.get(layer, 0)
        return h / (h + m) if h + m else float("nan")

    def copies_per_step(self) -> float:
        """Experts copied per decode step (x expert bytes = H2D bytes per token)."""
        return self.copies / max(self.steps, 1)


def replay(trace: Trace, num_slots: int, rule: Callable[[], EvictionRule] | None = None,
           predictions: Trace | None = None, prefetch_slots: int | None = None) -> ReplayResult:
    """Run ``trace`` through a fresh ExpertCache of ``num_slots`` slots.

    Args:
        trace: per step, layer -> expert ids run (layers in execution order).
        rule: makes the eviction rule (None = LRU).
        predictions: per step, layer -> predicted ids for that layer, prefetched while the layer
            before it runs (None = on-demand).
        prefetch_slots: most unused prefetch copies pinned at once (None: the cache's default).
    """
    cache = ExpertCache(_NullStore(1), num_slots, torch.device("cpu"), NullEngine(), rule, prefetch_slots)
    out = ReplayResult()
    pins: dict[int, list[int]] = {}
    for s, step in enumerate(trace):
        layers = list(step)
        for i, layer in enumerate(layers):
            ids = step[layer]
            kept = []
            for slot in pins.pop(layer, []):
                key = cache.key_of(slot)
                if key is not None and key[1] in ids:
                    kept.append(slot)
                    continue
                out.wasted += cache.unused_prefetch(slot)
                cache.release(slot)
            held = []
            for e in cache.resident_first(layer, ids):
                got = cache.acquire((layer, e))
                if got is None:
                    raise ValueError(f"replay: {num_slots} slots cannot hold layer {layer}'s experts")
                held.append(got.slot)
                if got.hit:
                    out.hits[layer] = out.hits.get(layer, 0) + 1
                else:
                    out.misses[layer] = out.misses.get(layer, 0) + 1
            for slot in kept:  # now pinned by acquire as well
                cache.release(slot)
            if predictions is not None and i + 1 < len(layers):
                nxt = layers[i + 1]
                got_pins = []
                for e in cache.resident_first(nxt, sorted(set(predictions[s].get(nxt, [])))):
                    got = cache.prefetch((nxt, e))
                    if got is None:
                        break
                    got_pins.append(got[0])
                    out.prefetch_copies += got[1]
                pins[nxt] = got_pins
            for slot in held:
                cache.release(slot)
        for slots in pins.values():  # the last layer has no successor in this step
            for slot in slots:
                out.wasted += cache.unused_prefetch(slot)
                cache.release(slot)
        pins.clear()
        out.steps += 1
    out.copies = cache.copies
    return out
