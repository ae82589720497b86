"""A decode layer's resident experts in one native call equal the per-expert path bit for bit.

Shapes: S slots, P packed elements per expert, t tokens, H hidden.

Kernel: moespec.kernels.swiglu.swiglu_experts (one call over n slots) against swiglu_expert per slot.
Runner: LayerPolicy.batch_experts on (one call per decode layer) against off (the stream, one
expert at a time): the same logits on every family, with all experts resident (and the same hits,
misses and bytes) and with small caches where layers miss and prefetch (a layer whose experts
have not all landed streams either way).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny import GREEDY_PROMPT, reference_greedy

from moespec.config import ExecuteMode, Predictor, RuntimeConfig, SamplingConfig
from moespec.kernels import native
from moespec.kernels.swiglu import swiglu_expert, swiglu_experts
from moespec.models.layout import ExpertLayout
from moespec.models.quant_layout import QuantLayout
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
needs_kernels = pytest.mark.skipif(native.library() is None, reason="no native CPU kernels here")


def _slots(fmt: str, n: int) -> tuple[object, torch.Tensor, torch.dtype]:
    """(layout, slots [n, P] of random experts, activation dtype) for one storage format."""
    gen = torch.Generator().manual_seed(7)
    if fmt in ("float32", "bfloat16"):
        layout, dtype = ExpertLayout(96, 48), getattr(torch, fmt)
        return layout, (torch.randn(n, layout.numel, generator=gen) * 0.1).to(dtype), dtype
    layout = QuantLayout(96, 48, bits=8 if fmt == "int8" else 4, act_int8=fmt == "w4a8")
    slots = torch.randint(0, 256, (n, layout.numel), dtype=torch.uint8, generator=gen)
    for row in slots:
        for name in ("gate_up_scales", "down_scales"):
            layout.views(row)[name].view(torch.float16).fill_(0.01)
    return layout, slots, torch.float32


@needs_kernels
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4", "w4a8"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_one_call_over_slots_equals_one_call_per_expert(fmt, tokens):
    layout, slots, dtype = _slots(fmt, 6)
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(8)).to(dtype)
    rows = [4, 0, 5, 2]
    got = swiglu_experts(x, slots, rows, layout, torch.nn.functional.silu)
    assert got is not None and got.shape == (4, tokens, 96) and got.dtype == dtype
    for j, r in enumerate(rows):
        assert torch.equal(got[j], swiglu_expert(x, slots[r], layout, torch.nn.functional.silu)), (fmt, r)


@needs_kernels
@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_experts_shared_with_the_spin_pool_equal_the_serial_call(fmt):
    """Inside a thread-plan step (a SpinPool active) the experts go one per chunk to the workers and
    the caller: the same values, every time (repeated: whichever thread takes which expert)."""
    from moespec.kernels import spin

    layout, slots, dtype = _slots(fmt, 8)
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(10)).to(dtype)
    rows, silu = [7, 1, 3, 0, 6], torch.nn.functional.silu
    want = swiglu_experts(x, slots, rows, layout, silu)
    pool = spin.SpinPool(1)
    try:
        with spin.using(pool):
            got = [swiglu_experts(x, slots, rows, layout, silu) for _ in range(20)]
    finally:
        pool.close()
    assert all(torch.equal(g, want) for g in got)


def test_forward_many_takes_the_per_expert_reference_where_the_kernel_does_not_apply():
    """Another activation (no one-call kernel): forward per row, the same values."""
    layout, slots, _ = _slots("float32", 4)
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(9))
    gelu = torch.nn.functional.gelu
    assert swiglu_experts(x, slots, [1, 3], layout, gelu) is None
    got = layout.forward_many(x, slots, [1, 3], gelu)
    assert [torch.equal(g, layout.forward(x, slots[r], gelu)) for g, r in zip(got, [1, 3])] == [True, True]


def _decode_run(folder, cfg: RuntimeConfig, batch: bool, ids: torch.Tensor):
    """(logits [1, T, V] of a 4-token prefill then one decode step per token, the decode steps'
    per-layer (hits, misses, h2d_bytes, prefetched)) with batch_experts set to ``batch``."""
    from transformers import DynamicCache

    rec = StatsRecorder()
    om = load_offloaded(folder, cfg, rec)
    try:
        om.use_policy(dataclasses.replace(om.policy, batch_experts=batch))
        outs = []
        with torch.inference_mode():
            kv = DynamicCache(config=om.config)
            om.reset_step(prefill=True)
            outs.append(om.model(ids[:, :4], cache=kv, use_cache=True).logits)
            for t in range(4, ids.shape[1]):
                om.reset_step()
                outs.append(om.model(ids[:, t : t + 1], cache=kv, use_cache=True).logits)
                rec.end_step()
        counts = [[(s.hits, s.misses, s.h2d_bytes, s.prefetched) for _, s in sorted(step.layers.items())]
                  for step in rec.steps]
        return torch.cat(outs, dim=1), counts
    finally:
        om.close()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("slots,predictor,execute", [
    (24, Predictor.NONE, ExecuteMode.EXACT),  # every expert resident after its first use
    (5, Predictor.ROUTER, ExecuteMode.EXACT),  # misses and prefetches: layers batch or stream
    (12, Predictor.ROUTER, ExecuteMode.GUARDED),
])
def test_batched_decode_layers_equal_the_stream(tiny_models, family, slots, predictor, execute, monkeypatch):
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    cfg = RuntimeConfig(cache_experts=slots, predictor=predictor, execute=execute, link_gbps=None)
    calls, many, stacked = [], ExpertLayout.forward_many, ExpertLayout.forward_stacked
    monkeypatch.setattr(ExpertLayout, "forward_many", lambda self, *a: calls.append(1) or many(self, *a))
    monkeypatch.setattr(ExpertLayout, "forward_stacked", lambda self, *a: calls.append(1) or stacked(self, *a))
    got, got_counts = _decode_run(tiny_models[family], cfg, True, ids)
    batched, calls[:] = len(calls), []
    want, want_counts = _decode_run(tiny_models[family], cfg, False, ids)
    assert not calls  # only with batch_experts
    assert torch.equal(got, want), (got - want).abs().max()
    if predictor == Predictor.NONE:  # prefetch counts follow the copy thread's timing: not compared
        assert batched > 0  # every decode layer batched
        assert got_counts == want_counts


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_equals_transformers(tiny_models, family):
    folder = tiny_models[family]
    cfg = RuntimeConfig(cache_experts=24, predictor=Predictor.NONE, link_gbps=None)
    om = load_offloaded(folder, cfg)
    try:
        assert om.policy.batch_experts
        got = list(Engine(om).generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=10)))
    finally:
        om.close()
    assert got == reference_greedy(folder, GREEDY_PROMPT, 10)
