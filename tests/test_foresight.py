"""The look-ahead rules of the policy replay: ForesightRule (the routers' rankings, foresight.py)
and MIN with a horizon of W tokens (belady.HorizonMinRule)."""

from __future__ import annotations

import random
from functools import partial

import pytest

from moespec.runtime.cache.belady import BeladyRule, HorizonMinRule
from moespec.runtime.cache.eviction import NEXT_TOKEN, LfruRule
from moespec.runtime.cache.foresight import ForesightRule
from moespec.runtime.cache.lookahead import LookaheadRule
from moespec.runtime.cache.replay import replay
from moespec.runtime.cache.slot import Slot


def _random_trace(rng: random.Random, layers: int, experts: int, k: int, steps: int):
    return [{layer: sorted(rng.sample(range(experts), k)) for layer in range(layers)} for _ in range(steps)]


def _slots(*keys):
    return [Slot(i, key) for i, key in enumerate(keys)]


def _uniform(layers: int, experts: int, k: int) -> dict:
    return {(layer, e): k / experts for layer in range(layers) for e in range(experts)}


def test_rankings_move_scores_only_at_commit():
    rule = ForesightRule(_uniform(2, 4, 1), top_k=1)
    slots = _slots((1, 0), (1, 3))
    before = rule.victim(slots)
    rule.visit(0)
    rule.predicted(1, [3, 2, 1, 0])  # (1, 3) is the predictor's first choice for layer 1
    assert rule.victim(slots) is before  # buffered: nothing moved yet
    rule.commit()
    assert rule.victim(slots).key == (1, 0)  # the expert ranked last goes, the first is kept


def test_the_next_layer_s_prediction_is_nearer_than_the_next_token():
    # Layer 0 just ran with expert 0 (its own ranking is about the next token, M visits away);
    # layer 1's predicted expert 2 is one visit away: with equal rates and rank odds, the far one goes.
    rule = ForesightRule(_uniform(2, 4, 1), top_k=1)
    rule.visit(0)
    rule.routed(0, [0, 1, 2, 3])
    rule.predicted(1, [2, 1, 0, 3])
    rule.commit()
    assert rule.victim(_slots((0, 0), (1, 2))).key == (0, 0)


def test_rank_odds_are_learned_from_the_visits_they_were_about():
    rule = ForesightRule(_uniform(1, 4, 1), top_k=1)
    first = rule.rank_probability(0, 0)
    assert first == pytest.approx(0.25)  # the prior K / E
    for _ in range(20):  # every token the same expert leads and is used
        rule.visit(0)
        rule.routed(0, [2, 0, 1, 3])
        rule.commit()
    # 19 outcomes (the first ranking is scored at the second visit), on a prior of 4 pseudo-visits at 1/4
    assert rule.rank_probability(0, 0) == pytest.approx((1 + 19) / (4 + 19))
    assert rule.rank_probability(0, 1) == pytest.approx(1 / (4 + 19))


@pytest.mark.parametrize("seed", range(6))
def test_horizon_zero_is_the_fallback_and_a_long_one_is_min(seed):
    rng = random.Random(seed)
    layers, experts, k = 3, 6, 2
    trace = _random_trace(rng, layers, experts, k, 30)
    prior = {(layer, e): rng.random() for layer in range(layers) for e in range(experts)}
    for slots in (k, 5, 9):
        lfru = replay(trace, slots, partial(LfruRule, prior, k), prefetch_slots=0)
        zero = replay(trace, slots, lambda: HorizonMinRule(trace, 0, LfruRule(prior, k)), prefetch_slots=0)
        assert (zero.hits, zero.misses) == (lfru.hits, lfru.misses)

        class KeepingLast(BeladyRule):  # MIN under the constraint lfru keeps (the layer before's last)
            keeps_last_visit = True

        bound = replay(trace, slots, partial(KeepingLast, trace), prefetch_slots=0)
        long = replay(trace, slots, lambda: HorizonMinRule(trace, 100, LfruRule(prior, k)), prefetch_slots=0)
        assert long.hit_rate() == bound.hit_rate()
        one = replay(trace, slots, lambda: HorizonMinRule(trace, 1, LfruRule(prior, k)), prefetch_slots=0)
        assert one.hit_rate() <= bound.hit_rate()


def test_lookahead_keeps_the_predicted_experts_from_commit_to_their_layer_s_commit():
    # Equal counts: lfru would evict in LRU order, (1, 0) first. Layer 1's prediction keeps (1, 0)
    # from the commit of layer 0's visit until the commit of layer 1's own visit.
    rule = LookaheadRule(_uniform(3, 4, 1), top_k=1)
    slots = _slots((1, 0), (2, 1))
    rule.visit(0)
    rule.predicted(1, [0, 1, 2, 3])
    rule.predicted(2, [3, 2, 1, 0], distance=2)
    assert rule.victim(slots).key == (1, 0)  # buffered: nothing moved yet
    rule.commit()
    assert rule.victim(slots).key == (2, 1)
    rule.visit(1)
    assert rule.victim(slots).key == (2, 1)  # a visit moves nothing
    rule.commit()  # layer 1's visit: its protection ends
    assert rule.victim(slots).key == (1, 0)


def test_lookahead_evicts_protected_keys_last_lowest_count_first():
    seed = {(0, 0): 0.1, (0, 1): 0.9, (1, 0): 0.2, (1, 1): 0.8}
    rule = LookaheadRule(seed, top_k=2, protect=2)
    rule.visit(0)
    rule.predicted(1, [0, 1])
    rule.commit()
    slots = _slots((1, 1), (1, 0), (0, 1))
    assert rule.victim(slots).key == (0, 1)  # the only unprotected key, though the most used
    assert rule.victim(slots[:2]).key == (1, 0)  # then lfru's order among the protected


def test_lookahead_ignores_the_distances_it_was_not_given():
    rule = LookaheadRule(_uniform(3, 4, 1), top_k=1, distances=(1,))
    rule.visit(0)
    rule.predicted(2, [0, 1, 2, 3], distance=2)
    rule.commit()
    assert rule.victim(_slots((2, 0), (2, 1))).key == (2, 0)  # plain lfru (LRU order on ties)


def test_a_next_token_ranking_keeps_its_layer_s_experts_until_its_visit():
    rule = LookaheadRule(_uniform(3, 4, 1), top_k=1, distances=(NEXT_TOKEN,))
    for layer in range(3):  # made before layer 0's visit, about this token's layers
        rule.predicted(layer, [1, 0, 2, 3], distance=NEXT_TOKEN)
    rule.visit(0)
    rule.commit()
    assert rule.kept == {1: {1}, 2: {1}}  # layer 0's is about the running visit: spent
    slots = _slots((2, 1), (2, 0))
    assert rule.victim(slots).key == (2, 0)
    rule.visit(1)
    rule.commit()
    assert rule.victim(slots).key == (2, 0)  # layer 2's still held
    rule.visit(2)
    rule.commit()
    assert rule.victim(slots).key == (2, 1)  # its visit came: plain lfru, LRU order
