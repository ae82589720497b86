"""Belady's MIN through the real cache (runtime/cache/belady.py) is the optimum: an exhaustive search
over every eviction choice finds no fewer misses, and no online policy beats it."""

from __future__ import annotations

import itertools
import random
from functools import lru_cache, partial

import pytest

from moespec.config import CachePolicy
from moespec.runtime.cache.belady import BeladyRule
from moespec.runtime.cache.eviction import make_rule
from moespec.runtime.cache.replay import replay


def _optimal_misses(trace, slots: int) -> int:
    """The fewest misses of any demand-paging cache of ``slots`` slots on ``trace``: every choice of
    victims tried (a layer's experts are resident together while it runs)."""
    visits = [frozenset((layer, e) for e in ids) for step in trace for layer, ids in step.items()]

    @lru_cache(maxsize=None)
    def best(t: int, held: frozenset) -> int:
        if t == len(visits):
            return 0
        need = visits[t]
        missing = need - held
        evict = max(0, len(held) + len(missing) - slots)
        return len(missing) + min(best(t + 1, (held - set(out)) | need)
                                  for out in itertools.combinations(sorted(held - need), evict))

    return best(0, frozenset())


def _random_trace(rng: random.Random, layers: int, experts: int, k: int, steps: int):
    return [{layer: sorted(rng.sample(range(experts), k)) for layer in range(layers)} for _ in range(steps)]


@pytest.mark.parametrize("seed", range(12))
def test_min_equals_the_exhaustive_optimum(seed):
    rng = random.Random(seed)
    k = rng.choice([1, 2])
    trace = _random_trace(rng, rng.choice([1, 2, 3]), rng.choice([3, 4]), k, rng.randint(3, 6))
    keys = {(layer, e) for step in trace for layer, ids in step.items() for e in ids}
    for slots in range(k, min(len(keys), 6) + 1):
        res = replay(trace, slots, partial(BeladyRule, trace), prefetch_slots=0)
        assert sum(res.misses.values()) == _optimal_misses(trace, slots), slots


@pytest.mark.parametrize("seed", range(6))
def test_no_policy_hits_more_than_min(seed):
    rng = random.Random(100 + seed)
    layers, experts, k = 3, 8, 2
    trace = _random_trace(rng, layers, experts, k, 40)
    prior = {(layer, e): rng.random() for layer in range(layers) for e in range(experts)}
    for slots in (k, 5, 8, 12):
        bound = replay(trace, slots, partial(BeladyRule, trace), prefetch_slots=0).hit_rate()
        for policy in CachePolicy:
            rate = replay(trace, slots, partial(make_rule, policy, prior, slots, k), prefetch_slots=0).hit_rate()
            assert rate <= bound, (policy, slots)


def test_min_keeps_what_comes_back_soonest():
    # one layer, top-1, 2 slots: a b c a b. At c, LRU evicts a, then misses a and b (5 misses);
    # MIN evicts b (a comes back sooner), hits a, misses b (4 misses).
    trace = [{0: [e]} for e in (0, 1, 2, 0, 1)]
    res = replay(trace, 2, partial(BeladyRule, trace), prefetch_slots=0)
    assert res.hits == {0: 1} and res.misses == {0: 4}
    lru = replay(trace, 2, None, prefetch_slots=0)
    assert lru.hits == {} and lru.misses == {0: 5}
