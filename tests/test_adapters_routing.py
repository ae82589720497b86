"""Each adapter's `select` (what predictors use) equals the transformers router on random inputs.

Including exact ties, group-limited top-K where every biased score is negative (masking with 0
instead of -inf would pick experts of dropped groups), norm_topk_prob off, and GPT-OSS's top-K of
the biased logits followed by a softmax over those K only.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny import make_config

from moespec.models import adapter_for

T, H, E = 64, 32, 8


def _router(family: str, **cfg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = make_config(family, **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mlp = model.model.layers[1].mlp
    router = mlp.router if family == "gpt_oss" else mlp.gate
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
    return adapter_for(config), router


def _sorted(ids: torch.Tensor, weights: torch.Tensor):
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


def _check(adapter, router, x: torch.Tensor) -> torch.Tensor:
    block = SimpleNamespace(gate=router)
    want_logits, want_w, want_ids = router(x)
    logits = adapter.router_logits(block, x)
    got = adapter.select(block, logits)
    assert torch.equal(logits, want_logits)
    gi, gw = _sorted(got.ids, got.weights)
    wi, ww = _sorted(want_ids, want_w)
    assert torch.equal(gi, wi)
    assert gw.dtype == ww.dtype and torch.equal(gw, ww)
    return got.ids


def _inputs(seed: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,cfg", [
    ("gpt_oss", {}), ("deepseek_v3", {}), ("deepseek_v3", {"norm_topk_prob": False}), ("glm4_moe_lite", {}),
    ("deepseek_v2", {}), ("deepseek_v2", {"topk_method": "greedy"}), ("deepseek_v2", {"num_experts_per_tok": 3}),
])
def test_select_equals_the_transformers_router(family, cfg):
    adapter, router = _router(family, **cfg)
    if hasattr(router, "e_score_correction_bias"):
        router.e_score_correction_bias.normal_(0, 0.3)
    if hasattr(router, "bias"):
        with torch.no_grad():
            router.bias.normal_(0, 0.5)
    for seed in range(3):
        _check(adapter, router, _inputs(seed))


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "glm4_moe_lite", "deepseek_v2"])
def test_ties_are_broken_as_transformers_does(family):
    adapter, router = _router(family)
    with torch.no_grad():
        router.weight[1::2] = router.weight[0::2]  # experts 2j and 2j+1 always score the same
        router.weight[4:] = router.weight[:4]  # and so do whole groups
    _check(adapter, router, _inputs(7))
    _check(adapter, router, torch.zeros(3, H))  # every logit equal


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite"])
def test_all_negative_biased_scores_keep_experts_inside_the_chosen_groups(family):
    adapter, router = _router(family, top_k=3)  # V3: 4 groups of 2, top-2 groups; GLM: one group
    router.e_score_correction_bias.fill_(-5.0)  # sigmoid < 1: every biased score is negative
    router.e_score_correction_bias[::3] = -4.0
    x = _inputs(3)
    ids = _check(adapter, router, x)
    n_group, topk_group = adapter.config.n_group, adapter.config.topk_group
    scores = torch.sigmoid(x @ router.weight.T) + router.e_score_correction_bias  # [T, E]
    group = scores.view(T, n_group, -1).topk(2, dim=-1)[0].sum(-1)  # a group's score: sum of its top-2
    kept = group.topk(topk_group, dim=-1)[1]  # [T, topk_group]
    assert (ids.unsqueeze(-1) // (E // n_group) == kept.unsqueeze(1)).any(-1).all()


def test_gpt_oss_weights_are_a_softmax_over_the_top_k_only():
    adapter, router = _router("gpt_oss")
    x = _inputs(4)
    got = adapter.select(SimpleNamespace(gate=router), adapter.router_logits(SimpleNamespace(gate=router), x))
    torch.testing.assert_close(got.weights.sum(-1), torch.ones(T))
    top = (x @ router.weight.T + router.bias).topk(2, dim=-1)[0]
    torch.testing.assert_close(got.weights, top.softmax(-1))
