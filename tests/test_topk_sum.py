"""The runner's top-k sum (fast paths) against its references and against transformers' experts.

Shapes: T tokens, K top-k, E experts, H hidden, I intermediate.
"""

from __future__ import annotations

import pytest
import torch

from moespec.models.base import ExpertLayout, Routing
from moespec.runtime.layer.experts import (TopkSum, decode_contribution, gated, group_by_expert, reference_moe,
                                     reference_moe_eager, sum_one_token, sum_stacked)

H, I, E = 16, 8, 6


def _case(tokens: int, k: int, dtype, wdtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    layout = ExpertLayout(hidden=H, intermediate=I)
    rows = (torch.randn(E, layout.numel, generator=g) * 0.3).to(dtype)  # [E, P]
    x = torch.randn(tokens, H, generator=g).to(dtype)  # [T, H]
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])  # [T, K]
    w = torch.rand(tokens, k, generator=g)
    return layout, rows, x, Routing(ids=ids, weights=(w / w.sum(-1, keepdim=True)).to(wdtype))


def _runner_sum(layout, rows, x, routing, act):
    """What MoeLayerRunner computes: the one-token path for T == 1, the argsort grouping otherwise."""
    if x.shape[0] == 1:
        return sum_one_token([decode_contribution(x, routing, k, rows[e], layout, act)[0]
                              for k, e in enumerate(routing.ids[0].tolist())], routing.weights, x)
    groups = group_by_expert(routing.ids, E)
    acc = TopkSum(x, routing.weights)
    for e in groups.experts:
        tok, kpos, flat = groups.positions(e)
        acc.put_pairs(flat, gated(layout.forward(x[tok], rows[e], act), routing.weights[tok, kpos, None]))
    return acc.result()


@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                          (torch.bfloat16, torch.bfloat16)])
def test_fast_sum_equals_reference_bit_for_bit(tokens, dtype, wdtype):
    layout, rows, x, routing = _case(tokens, 4, dtype, wdtype)
    act = torch.nn.functional.silu
    fast = _runner_sum(layout, rows, x, routing, act)
    assert fast.dtype == dtype
    assert torch.equal(fast, reference_moe(x, routing, rows, layout, act))
    eager = reference_moe_eager(x, routing, rows, layout, act)
    if dtype == torch.float32:
        assert torch.allclose(fast, eager, atol=1e-6, rtol=0)  # same sum, other order


@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_reference_equals_transformers_default_experts(tokens, wdtype):
    """Against transformers' own MixtralExperts with its default implementation, in bf16."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    layout, rows, x, routing = _case(tokens, 4, torch.bfloat16, wdtype, seed=2)
    config = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=4)
    config._experts_implementation = "grouped_mm"
    experts = MixtralExperts(config).to(torch.bfloat16)
    with torch.no_grad():
        for e in range(E):
            gate_up, down = layout.unpack(rows[e])
            experts.gate_up_proj[e].copy_(gate_up)
            experts.down_proj[e].copy_(down)
        want = experts(x, routing.ids, routing.weights)
        config._experts_implementation = "eager"
        eager = experts(x, routing.ids, routing.weights)
    got = _runner_sum(layout, rows, x, routing, experts.act_fn)
    assert torch.equal(got, want)
    assert torch.equal(reference_moe_eager(x, routing, rows, layout, experts.act_fn), eager)
    assert not torch.equal(want, eager)  # the two sums really differ here


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                          (torch.bfloat16, torch.bfloat16)])
def test_stacked_sum_equals_the_one_token_sum_bit_for_bit(dtype, wdtype):
    """sum_stacked over one [K, 1, H] buffer (the batched decode layer's) against sum_one_token over
    the K views of it (the stream's raws): the same values."""
    layout, rows, x, routing = _case(1, 4, dtype, wdtype, seed=3)
    act = torch.nn.functional.silu
    raws = [layout.forward(x, rows[e], act) for e in routing.ids[0].tolist()]  # top-k order, [1, H] each
    stacked = torch.stack(raws)  # [K, 1, H]
    got = sum_stacked(stacked, routing.weights, x)
    assert got.dtype == dtype and got.shape == (1, H)
    assert torch.equal(got, sum_one_token(raws, routing.weights, x))
    assert not torch.equal(got, sum_stacked(stacked.flip(0), routing.weights, x))  # the order is the top-k's
