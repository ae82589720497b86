"""ForesightRule: evict the expert whose next use is expected farthest away, from the router's rankings.

Shapes: M MoE layers, E experts per layer, K top-k.

Belady's MIN evicts the key used again farthest in the future. A running model does not know its
future routing, but it knows two rankings of each layer's experts before the layer's misses pick
their slots (the layer runner posts them; the policy replay reads them from a trace):

- ``routed(l, ranked)``: layer l's true router logits for this token, as expert ids best first.
  They rank l's experts for l's next visit (the next token): an expert used now is used at the
  next token with probability ~0.43 on the default model against a base rate of K/E = 0.25.
- ``predicted(l', ranked)``: the predictor's logits for the next MoE layer l' (the router
  predictor's recall@K is ~0.87), ranking l' experts for its visit one layer from now.

Each ranking gives a key (layer j, expert e) an expected absolute time of its next use, in layer
visits (the rule's clock, M visits per decode token):

    next_use = t_j + (1 - p) * M / q

where t_j is the visit of layer j the ranking is about (now + 1 for l', now + M for l), p the
probability that the expert at that rank is used at that visit (learned online: per ranking kind
and rank, the share of the experts at that rank that the visit then used, prior K/E), and q the
key's long-run use rate per visit, from lfru's decayed count (count x (1 - LFRU_DECAY)). The
victim is the key with the largest next_use (ties: LRU order), as MIN's; a key no ranking has
reached yet is at M / q (its seed).

Rankings are buffered and applied by ``commit``, which the layer protocol calls once the running
layer's demand copies are queued (stream.py), before the next layer's prefetch. So between a
prefetch's choice of slot and its target layer's demand misses no score changes (a score moves
only at commit, never on a use or a visit): a prefetch still takes exactly the slot its demand
miss would take (slots.py; tests/test_prefetch_bound.py), and a perfect prediction moves no more
bytes than on-demand loading.

Measured (scripts/policy_hit_rates.py, the default model's generated-text trace, on demand, 12.5 /
25 / 50 % of the experts): 0.289 / 0.515 / 0.792 against lfru's 0.279 / 0.529 / 0.807 (MIN 0.411 /
0.626 / 0.849), so it is not a ``--cache-policy``. The rankings of the current token say little
about the next one beyond what lfru's counts say; fed the NEXT token's true rankings instead (an
oracle of one token) the same rule closes 45 / 44 / 21 % of the lfru-MIN gap (belady.py's
HorizonMinRule, which knows the next token's uses exactly, 80 / 66 / 27 %). Kept for the replay, so a
better next-token predictor can be tried against the bound.

Source: Belady 1966 (MIN), with the expected-reuse-distance approximation of "Back to the Future:
Leveraging Belady's Algorithm for Improved Cache Replacement" (Jain & Lin, ISCA 2016: learn
from past MIN decisions), here replaced by the router's own look at the next visit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from moespec.runtime.cache.eviction import LFRU_DECAY, LfruRule
from moespec.runtime.cache.slot import Key, Slot

ROUTED, PREDICTED = 0, 1  # ranking kinds: the layer's own routing (for its next token), the next layer's prediction
MIN_RATE = 1e-3  # floor of a key's long-run use rate per visit (a never-used key is far, not infinitely)
PRIOR_VISITS = 4.0  # pseudo-observations behind each rank's prior K / E


class ForesightRule(LfruRule):
    """Largest expected next use first (module docstring); lfru's counts give the long-run rates.

    Args:
        seed: key -> use probability per token (calibration); lfru's seed.
        top_k: K.
        layers: M, the MoE layers (None: the layers of ``seed``).
        experts: E per layer (None: from ``seed``).
    """

    policy = None  # an experiment of the policy replay (module docstring: it lost to lfru), no --cache-policy

    def __init__(self, seed: dict[Key, float], top_k: int, layers: int | None = None,
                 experts: int | None = None) -> None:
        super().__init__(seed, top_k, layers)
        self.layers = layers if layers is not None else max(len({key[0] for key in seed}), 1)
        e = experts if experts is not None else max(len({key[1] for key in seed}), top_k, 1)
        prior = min(top_k / e, 1.0)
        # [kind][rank] -> (experts used at that rank, rankings seen) with the prior folded in
        self.used_at = [[prior * PRIOR_VISITS] * e for _ in range(2)]
        self.seen_at = [[PRIOR_VISITS] * e for _ in range(2)]
        self.pending: dict[int, list[tuple[int, list[int]]]] = {}  # layer -> (kind, ranking) awaiting its visit
        self.buffered: list[tuple[int, int, list[int]]] = []  # (kind, layer, ranking) not committed yet
        self.next_use = {k: self.layers / max(p, MIN_RATE) for k, p in seed.items()}

    # --- hints ------------------------------------------------------------------------------
    def routed(self, layer: int, ranked: list[int]) -> None:
        self.buffered.append((ROUTED, layer, ranked))

    def predicted(self, layer: int, ranked: list[int], distance: int = 1) -> None:
        if distance == 1:  # its odds are per kind; a lookahead ranking would need its own
            self.buffered.append((PREDICTED, layer, ranked))

    def commit(self) -> None:
        for kind, layer, ranked in self.buffered:
            if kind == ROUTED:
                self._learn(layer, set(ranked[: self.top_k]))
            self._score(kind, layer, ranked)
        self.buffered.clear()

    def rank_probability(self, kind: int, rank: int) -> float:
        """P(the expert at ``rank`` of a ``kind`` ranking is used at the visit it ranks for)."""
        row = self.used_at[kind]
        rank = min(rank, len(row) - 1)
        return row[rank] / self.seen_at[kind][rank]

    def _learn(self, layer: int, used: set[int]) -> None:
        """``layer`` ran with ``used``: score the rankings that were about this visit."""
        for kind, ranked in self.pending.pop(layer, ()):
            hits, seen = self.used_at[kind], self.seen_at[kind]
            for r, e in enumerate(ranked[: len(hits)]):
                seen[r] += 1.0
                hits[r] += e in used

    def _score(self, kind: int, layer: int, ranked: list[int]) -> None:
        m = self.layers
        when = self.clock + (m if kind == ROUTED else 1)  # the visit this ranking is about
        self.pending.setdefault(layer, []).append((kind, ranked))
        keep = 1.0 - LFRU_DECAY
        shift = self.clock * self.step
        for r, e in enumerate(ranked):
            key = (layer, e)
            rate = max(math.exp(self.value.get(key, -math.inf) + shift) * keep, MIN_RATE)  # uses per visit
            p = self.rank_probability(kind, r)
            self.next_use[key] = when + (1.0 - p) * m / rate

    # --- the pick ---------------------------------------------------------------------------
    def score(self, key: Key) -> float:
        """Minus the expected next use (higher is kept)."""
        return -self.next_use.get(key, self.layers / MIN_RATE)

    def victim(self, order: Iterable[Slot]) -> Slot | None:
        return LfruRule.victim(self, order)
