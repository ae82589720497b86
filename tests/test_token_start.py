"""The token-start prefetch (runtime/layer/token_start.py): a decode step's first MoE layer is
predicted from the new token's quasi-hidden state and prefetched before that layer runs."""

from __future__ import annotations

from dataclasses import replace

import torch
from tiny import engine_steps

from moespec.config import Predictor, RuntimeConfig
from moespec.runtime.layer.token_start import TOKEN_START, TokenStart
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder


def test_default_vector_is_the_mean_of_r_minus_e():
    ts = TokenStart(first=2)
    e = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # [T=2, H=2]
    ts.started(e)
    assert torch.equal(ts.state(), e)  # nothing measured yet: the embedding alone
    ts.observe(1, torch.zeros(1, 2, 2))  # not the first MoE layer: ignored
    ts.observe(2, (e + torch.tensor([[1.0, 0.0], [3.0, 2.0]])).unsqueeze(0))  # r = e + [1,0] / [3,2]
    ts.started(torch.tensor([[0.0, 1.0]]))
    assert torch.equal(ts.state(), torch.tensor([[2.0, 2.0]]))  # e + mean([1,0], [3,2])
    ts.observe(2, torch.zeros(1, 2, 2))  # rows that are not the started tokens': not measured
    assert torch.equal(ts.state(), torch.tensor([[2.0, 2.0]]))
    ts.clear()
    assert ts.state() is None


def _decode(path, token_start, n=10, slots=6):
    rec = StatsRecorder()
    om = load_offloaded(path, RuntimeConfig(predictor=Predictor.ROUTER, cache_experts=slots), rec)
    try:
        om.use_policy(replace(om.policy, token_start=token_start))
        _, out = engine_steps(om, [5, 17, 99, 3], n)  # a prefill and n greedy decode steps
        first = min(om.store.moe_layers)
        decode = [s for s in rec.steps if s.kind == "decode"]
        prefetched = sum(s.layers[first].prefetched + s.layers[first].prefetch_cancelled for s in decode)  # issued
        gate = om.runner.prefetcher.gate.report()
        return out, prefetched, gate
    finally:
        om.close()


def test_first_layer_is_prefetched_at_token_start_and_stays_exact(tiny_models):
    path = tiny_models["qwen3_moe"]
    off, before, gate_off = _decode(path, token_start=False)
    on, after, gate_on = _decode(path, token_start=True)
    assert on == off  # exact mode: a prefetch changes where an expert comes from, never the output
    assert before == 0 and TOKEN_START not in gate_off  # nothing predicted the first layer before
    assert after > 0 and gate_on[TOKEN_START]["ran"] > 0
