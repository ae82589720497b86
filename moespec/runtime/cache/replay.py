"""Replay a routing trace through the real ExpertCache without moving bytes (hit rates per policy).

Shapes: K top-k; a trace is, per decode step, decoder layer -> the K expert ids it ran.

The cache, its eviction rule and the layer protocol are the runtime's own: each layer settles its
prefetch pins (ledger.py), streams its experts (stream.py: resident ones first, the
next layer's prediction issued once its demand copies are queued), exactly as the layer runner does
(runtime/layer/runner.py). Only the store and the transfer engine are stand-ins (a 1-element row per
expert, copies that land at once), so a replay costs microseconds per expert and gives exactly the
hits, misses and copies the runtime's cache would see for the same sequence of uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from moespec.runtime.cache.eviction import NEXT_TOKEN, EvictionRule
from moespec.runtime.cache.ledger import PrefetchLedger
from moespec.runtime.cache.slots import ExpertCache
from moespec.runtime.cache.stream import stream
from moespec.runtime.stats import LayerStats, NullRecorder
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

    def row_numel(self, layer: int) -> int:
        return 1

    def slot_rows(self, num_slots: int, device: torch.device) -> torch.Tensor:
        return torch.empty(num_slots, 1, dtype=self.dtype, device=device)  # [S, 1]

    def copy_bytes(self, layer: int) -> int:
        return self.expert_bytes


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
           predictions: Trace | None = None, prefetch_slots: int | None = None,
           engine: TransferEngine | None = None, ranks: Trace | None = None,
           predicted_ranks: Trace | None = None, lookahead_ranks: Trace | None = None,
           next_token_ranks: Trace | None = None, token_start: bool = True) -> ReplayResult:
    """Run ``trace`` through a fresh ExpertCache of ``num_slots`` slots.

    Args:
        trace: per step, layer -> expert ids run (layers in execution order).
        rule: makes the eviction rule (None = LRU).
        predictions: per step, layer -> predicted ids for that layer, prefetched while the layer
            before it runs (None = on-demand); the step's first layer's, with ``token_start``, at the
            start of the step, before any layer runs (the runtime's token-start prefetch:
            runtime/layer/token_start.py).
        prefetch_slots: most unused prefetch copies pinned at once (None: the cache's default).
        engine: the stand-in transfer engine (None: NullEngine, copies land at once).
        ranks: per step, layer -> its router's expert ids best first (the rule's ``routed``).
        predicted_ranks: per step, layer -> the predictor's expert ids best first for that layer,
            made while the layer before it ran (the rule's ``predicted``; also without ``predictions``:
            a rule may look at a prediction that nothing prefetches).
        lookahead_ranks: per step, layer -> the predictor's expert ids best first for that layer,
            made while the layer two MoE layers before it ran (the rule's ``predicted``, distance 2).
        next_token_ranks: per step, layer -> a ranking of that layer's experts for this step, made
            before its first layer (the rule's ``predicted``, distance NEXT_TOKEN).
    """
    cache = ExpertCache(_NullStore(1), num_slots, torch.device("cpu"), engine or NullEngine(), rule, prefetch_slots)
    ledger = PrefetchLedger(cache)
    recorder = NullRecorder()
    stats: dict[int, LayerStats] = {}
    dropped = 0
    for s, step in enumerate(trace):
        layers = list(step)
        if predictions is not None and token_start and layers and layers[0] in predictions[s]:
            first = layers[0]
            ledger.issue(first, sorted(set(predictions[s][first])), stats.setdefault(first, LayerStats()))
        for layer, ranked in (next_token_ranks[s] if next_token_ranks is not None else {}).items():
            cache.rule.predicted(layer, ranked, distance=NEXT_TOKEN)
        for i, layer in enumerate(layers):
            ids = step[layer]
            here = stats.setdefault(layer, LayerStats())
            kept = ledger.settle(layer, ids, here)
            queued = None
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            rule = cache.rule
            if ranks is not None and layer in ranks[s]:
                rule.routed(layer, ranks[s][layer])
            if predicted_ranks is not None and nxt is not None and nxt in predicted_ranks[s]:
                rule.predicted(nxt, predicted_ranks[s][nxt])
            far = layers[i + 2] if i + 2 < len(layers) else None
            if lookahead_ranks is not None and far is not None and far in lookahead_ranks[s]:
                rule.predicted(far, lookahead_ranks[s][far], distance=2)
            if predictions is not None and nxt is not None:
                wanted = sorted(set(predictions[s].get(nxt, [])))
                queued = partial(ledger.issue, nxt, wanted, stats.setdefault(nxt, LayerStats()))
            for _ in stream(cache, layer, ids, here, recorder, kept, queued):
                pass  # nothing to compute: the slot is released when the next one is asked for
        dropped += ledger.drop(cancel=False).wasted  # the last layer has no successor in this step
    out = ReplayResult(steps=len(trace), copies=cache.copies)
    for layer, st in stats.items():
        if st.hits:
            out.hits[layer] = st.hits
        if st.misses:
            out.misses[layer] = st.misses
        out.prefetch_copies += st.prefetched
        out.wasted += st.prefetch_wasted
    out.wasted += dropped
    return out
