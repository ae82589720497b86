"""LookaheadRule: lfru that does not evict what the predictor expects the next layers to use.

Shapes: M MoE layers, E experts per layer, K top-k.

Under lfru a miss of layer l evicts the key with the lowest decayed use count, and among the
lowest are often experts of layer l+1 or l+2 that those layers are about to run: their counts say
how often they are used, not that they are needed in one or two visits. The predictor knows that:
while layer l runs it ranks layer l+1's experts (the router predictor's recall@K is ~0.87 on the
default model) and, as lookahead, layer l+2's (router_{l+2}(LN_{l+2}(r_l)), lower recall). This
rule keeps lfru's counts and order, but the top ``protect`` experts of each ranking are evicted
only when no other evictable slot is left (then lowest count first among them).

The rankings are buffered (``predicted``) and applied by ``commit``, which the layer protocol calls
once the running layer's demand copies are queued, before the next layer's prefetch (stream.py);
the commit also drops the protection of the running layer (its visit is now). So no protection
moves between a prefetch's choice of slot and its target layer's demand misses: a prefetch still
takes exactly the slot its demand miss would (slots.py; tests/test_prefetch_bound.py). A miss of
layer l sees the rankings made while layer l-1 ran: l's own (distance 1, mostly hits by then) and
l+1's (distance 2, the lookahead); the next layer's prefetch and l+1's misses see those made at l.

Measured by replay (scripts/policy_hit_rates.py, the default model's generated-text traces, 12.5 /
25 / 50 % of the experts): it closes 0-1 % of the lfru-MIN gap, with the router's rankings or the
true routing, because MIN knowing the next 4 layer visits exactly closes only 1-3 %; next-token
rankings (distance NEXT_TOKEN) close at most 5 % (the true routing: 10-17 %). So it is not a
``--cache-policy``; docs/decisions.md (2026-12-03, "No lookahead eviction").

Source: the prefetch-aware eviction of Cao, Felten, Karlin and Li, "A study of integrated
prefetching and caching strategies" (SIGMETRICS 1995): do not evict a block a prefetch is about to
need; here the predictor's ranking says which.
"""

from __future__ import annotations

from moespec.runtime.cache.eviction import LFRU_DECAY, LfruRule
from moespec.runtime.cache.slot import Key

PROTECTED = 1e9  # added to a protected key's lfru value (log counts stay within +-1e3)


class LookaheadRule(LfruRule):
    """lfru with the predicted experts of the coming layers kept (module docstring).

    Args:
        seed: key -> use probability per token (calibration); lfru's seed.
        top_k: K.
        layers: M, the MoE layers (None: the layers of ``seed``).
        protect: how many of a ranking's first experts are kept (None: K).
        distances: which rankings count: 1 = the next layer's prediction, 2 = the lookahead one,
            NEXT_TOKEN (0) = one made before the token's first layer (kept until its layer's visit).
        decay: lfru's decay per visit of a key's layer.
    """

    policy = None  # replay only (module docstring: it does not beat lfru)

    def __init__(self, seed: dict[Key, float], top_k: int, layers: int | None = None, protect: int | None = None,
                 distances: tuple[int, ...] = (1, 2), decay: float = LFRU_DECAY) -> None:
        super().__init__(seed, top_k, layers, decay)
        self.protect = top_k if protect is None else protect
        self.distances = distances
        self.running: int | None = None  # the layer whose visit began last
        self.kept: dict[int, set[int]] = {}  # layer -> protected expert ids (committed)
        self.buffered: list[tuple[int, list[int]]] = []  # (layer, ranking) not committed yet

    def visit(self, layer: int) -> None:
        super().visit(layer)
        self.running = layer

    def predicted(self, layer: int, ranked: list[int], distance: int = 1) -> None:
        if distance in self.distances:
            self.buffered.append((layer, ranked))

    def commit(self) -> None:
        self.kept.pop(self.running, None)
        for layer, ranked in self.buffered:  # later rankings of a layer replace earlier ones
            if layer != self.running:  # a ranking about the running visit is spent
                self.kept[layer] = set(ranked[: self.protect])
        self.buffered.clear()

    def score(self, key: Key) -> float:
        value = super().score(key)
        return value + PROTECTED if key[1] in self.kept.get(key[0], ()) else value
