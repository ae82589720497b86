"""GPT-OSS, DeepSeek-V2/V3 and GLM-4.7-Flash: `exact` mode equals transformers' logits (1e-5, float32).

Across cache sizes and predictors, prefill and token-by-token decode (GPT-OSS decodes past its
sliding window of 4), and GPT-OSS MXFP4 experts both packed (dequantised on the device after each
copy) and dequantised once at load; the reference is transformers' own dequantised model.
"""

from __future__ import annotations

import pytest
import torch
from test_exactness import _incremental_logits
from tiny import reference_model

from moespec.config import Predictor, RuntimeConfig
from moespec.models.gpt_oss_experts import GptOssLayout, GptOssMxfp4Layout
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder

FAMILIES = ["gpt_oss", "gpt_oss_mxfp4", "deepseek_v2", "deepseek_v3", "glm4_moe_lite"]


def _logits(folder, cfg: RuntimeConfig, ids):
    om = load_offloaded(folder, cfg, StatsRecorder())
    try:
        with torch.inference_mode():
            full = om.model(ids).logits
        return full, _incremental_logits(om, ids), om
    finally:
        om.close()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("predictor", [Predictor.NONE, Predictor.ROUTER])
def test_logits_equal_transformers_for_every_cache_size(adapter_models, family, predictor):
    folder = adapter_models[family]
    ref = reference_model(folder)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
    k = ref.config.num_experts_per_tok
    minimum = k if predictor == Predictor.NONE else 2 * k
    for slots in sorted({minimum, minimum + 1, 16}):
        full, inc, _ = _logits(folder, RuntimeConfig(cache_experts=slots, predictor=predictor), ids)
        assert torch.allclose(full, want, atol=1e-5, rtol=0), (family, slots, (full - want).abs().max())
        assert torch.allclose(inc, want, atol=1e-5, rtol=0), (family, slots, (inc - want).abs().max())


def test_mxfp4_experts_stay_packed_or_dequantise_at_load(adapter_models):
    folder = adapter_models["gpt_oss_mxfp4"]
    ref = reference_model(folder)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(ids).logits
    _, packed, om_packed = _logits(folder, RuntimeConfig(cache_experts=4), ids)
    _, dense, om_dense = _logits(folder, RuntimeConfig(cache_experts=4, expert_dtype="float32"), ids)
    assert isinstance(om_packed.store.layout, GptOssMxfp4Layout) and om_packed.store.buffer.dtype == torch.uint8
    assert type(om_dense.store.layout) is GptOssLayout
    h = i = 32
    assert om_packed.store.expert_bytes == (2 * i + h) * 4 + 2 * i * (h // 2 + h // 32) + h * (i // 2 + i // 32)
    assert om_dense.store.expert_bytes == (3 * h * i + 2 * i + h) * 4
    assert torch.allclose(packed, want, atol=1e-5, rtol=0) and torch.allclose(dense, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite"])
def test_router_weight_and_correction_bias_stay_float32_in_bf16(adapter_models, family):
    om = load_offloaded(adapter_models[family], RuntimeConfig(dtype="bfloat16", cache_experts=8))
    try:
        gate = om.model.model.layers[1].mlp.gate
        assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
        assert om.model.model.layers[1].mlp.shared_experts.gate_proj.weight.dtype == torch.bfloat16
        assert om.store.moe_layers == [1, 2]  # layer 0 is dense: not offloaded
        with torch.inference_mode():
            assert torch.isfinite(om.model(torch.tensor([[1, 2, 3]])).logits).all()
    finally:
        om.close()
