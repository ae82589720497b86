"""A prediction is prefetched highest predicted weight first (issue 27, lever (a)).

The likeliest rows are read first, so the layer's demand more often finds its row landed. The
prefetch order is read in the layer's one host read beside the routing-order ids (speculative mode
runs those, so their order must not change); DeepSeek's top-k is unsorted, so the order is the
prediction's weights', not top-k's.
"""

from __future__ import annotations

import pytest
from tiny import GREEDY_PROMPT, reference_greedy

from moespec.config import Predictor, RuntimeConfig, SamplingConfig
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded
from moespec.runtime.misses.handlers import FetchMisses


def test_fetch_prefetches_in_the_given_order_once_each():
    assert FetchMisses().prefetch_plan([5, 1, 3, 1], None) == ([5, 1, 3], None)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_ledger_gets_the_prediction_best_first_and_exact_mode_is_unchanged(tiny_models, adapter_models, family):
    folder = {**tiny_models, **adapter_models}[family]
    om = load_offloaded(folder, RuntimeConfig(predictor=Predictor.ROUTER, cache_experts=6, prediction_gate=False))
    seen, issued = [], []
    prefetcher, ledger = om.runner.prefetcher, om.ledger
    real_prefetch, real_issue = prefetcher.prefetch, ledger.issue

    def prefetch(layer, prediction, recorder):
        seen.append(prediction)
        return real_prefetch(layer, prediction, recorder)

    first = min(om.store.moe_layers)

    def issue(target, experts, stats, budget=None):
        if target != first:  # the first layer's are the token start's (token_start.py), no layer's prediction
            issued.append(list(experts))
        return real_issue(target, experts, stats, budget)

    prefetcher.prefetch, ledger.issue = prefetch, issue
    try:
        out = list(Engine(om).generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=5)))
    finally:
        om.close()
    assert out == reference_greedy(folder, GREEDY_PROMPT, 5)
    assert seen and len(seen) == len(issued)
    for prediction, experts in zip(seen, issued):
        ids = prediction.routing.ids.reshape(-1).tolist()  # [K]
        weights = prediction.routing.weights.reshape(-1).tolist()  # [K]
        assert prediction.host_ids == ids  # the routing's order: what speculative mode runs
        best = [e for _, e in sorted(zip(weights, ids), key=lambda we: -we[0])]
        assert list(prediction.best_first) == best
        assert experts == list(dict.fromkeys(best))  # resident ones first, each group in this order: ledger

