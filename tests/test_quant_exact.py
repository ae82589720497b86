"""int8/int4 experts: `exact` equals transformers running the same dequantised expert weights.

On every architecture's tiny model (except GPT-OSS, which refuses int8/int4), for a small cache with
and without prefetch: full-sequence and token-by-token logits within 1e-5 (float32) and the same
greedy tokens. The reference is the plain transformers model whose fused expert weights were
quantised and dequantised projection by projection (fake_quantize_experts_).
"""

from __future__ import annotations

import pytest
import torch
from test_exactness import _incremental_logits
from tiny import reference_model

from moespec.config import Predictor, RuntimeConfig
from moespec.models.quant_layout import QuantLayout, fake_quantize_experts_
from moespec.runtime.load import load_offloaded

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe_lite"]


def _folder(tiny_models, adapter_models, family):
    return tiny_models[family] if family in tiny_models else adapter_models[family]


def _reference_logits(folder, layout: QuantLayout, ids):
    ref = reference_model(folder)
    assert fake_quantize_experts_(ref, layout) > 0
    with torch.no_grad():
        return ref(ids).logits


def _run(folder, cfg: RuntimeConfig, ids):
    """(layout, reference logits, full-sequence logits, token-by-token logits) of one load."""
    om = load_offloaded(folder, cfg)
    try:
        layout = om.store.layout
        want = _reference_logits(folder, layout, ids)
        with torch.inference_mode():
            full = om.model(ids).logits
        return layout, want, full, _incremental_logits(om, ids)
    finally:
        om.close()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("expert_dtype,predictor", [("int4", Predictor.ROUTER), ("int8", Predictor.NONE)])
def test_exact_equals_transformers_on_dequantised_experts(tiny_models, adapter_models, family, expert_dtype,
                                                          predictor):
    folder = _folder(tiny_models, adapter_models, family)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    k = 2  # tiny models are top-2
    cfg = RuntimeConfig(cache_experts=2 * k + 1, predictor=predictor, expert_dtype=expert_dtype)
    layout, want, full, inc = _run(folder, cfg, ids)
    assert isinstance(layout, QuantLayout) and layout.bits == int(expert_dtype[3:])
    assert torch.allclose(full, want, atol=1e-5, rtol=0), (full - want).abs().max()
    assert torch.allclose(inc, want, atol=1e-5, rtol=0), (inc - want).abs().max()
    assert torch.equal(inc.argmax(-1), want.argmax(-1))  # greedy tokens


def test_quantised_model_differs_from_float_but_stays_close(tiny_models):
    """The reference really changed: int4 moves the logits, by less than the logits' spread."""
    folder = tiny_models["qwen3_moe"]
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = reference_model(folder)(ids).logits
    om = load_offloaded(folder, RuntimeConfig(cache_experts=4, expert_dtype="int4"))
    try:
        with torch.inference_mode():
            quant = om.model(ids).logits
    finally:
        om.close()
    diff = (quant - plain).abs().max()
    assert 1e-4 < diff < plain.std()


# Measured on these tiny models (max |logit - reference| over the 10 positions, full and incremental
# alike): w4a8 0.004-0.039 (qwen2_moe the largest), w8a8 0.004-0.015, logits of std 0.42-0.46;
# stated tolerance 0.08 (~0.18 std).
A8_ATOL = 0.08


@pytest.mark.parametrize("family,expert_dtype", [(f, "w4a8") for f in FAMILIES] +
                         [("qwen3_moe", "w8a8"), ("deepseek_v3", "w8a8")])
def test_int8_activations_stay_within_their_stated_tolerance(tiny_models, adapter_models, family, expert_dtype):
    """w8a8 / w4a8 (not exact): the same rows as int8 / int4, activations quantised to int8 by the CPU
    kernels; logits within A8_ATOL of transformers on the dequantised weights, and really different."""
    folder = _folder(tiny_models, adapter_models, family)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    cfg = RuntimeConfig(cache_experts=5, predictor=Predictor.NONE, expert_dtype=expert_dtype)
    layout, want, full, inc = _run(folder, cfg, ids)
    assert layout.act_int8 and layout.bits == int(expert_dtype[1])
    for got in (full, inc):
        diff = float((got - want).abs().max())
        assert 1e-6 < diff < A8_ATOL, (family, expert_dtype, diff)


def test_device_path_without_cpu_kernels_equals_the_kernels(tiny_models, monkeypatch):
    """What a GPU slot computes (dequantise with torch ops after the copy, F.linear) against the CPU
    kernels on the same rows: within 1e-5, the same greedy tokens."""
    from moespec.kernels import native

    folder = tiny_models["qwen3_moe"]
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(5))
    out = {}
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(native, "library", lambda: None)
        om = load_offloaded(folder, RuntimeConfig(cache_experts=5, predictor=Predictor.NONE, expert_dtype="int4"))
        try:
            out[kernels] = _incremental_logits(om, ids)
        finally:
            om.close()
    assert torch.allclose(out[True], out[False], atol=1e-5, rtol=0)
    assert torch.equal(out[True].argmax(-1), out[False].argmax(-1))
