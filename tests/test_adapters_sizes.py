"""Sizes of GPT-OSS, DeepSeek-V2/V3 and GLM-4.7-Flash from config.json, and the bytes the runtime moves.

Counts are checked against the transformers models of tiny configs; the real models' zero-cache H2D
bytes per decode token against design.md, from their config.json fields (no weights); and the host
store's bytes per expert against the size estimate.
"""

from __future__ import annotations

import pytest
import torch

from moespec.hub.sizes import format_bytes, model_sizes

TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2, vocab_size=64,
            num_experts_per_tok=2, dtype="bfloat16")
MLA = dict(moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2, kv_lora_rank=8, qk_rope_head_dim=4,
           qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=2)
FAMILIES = {
    "gpt_oss": dict(num_local_experts=4, num_key_value_heads=1, head_dim=8, intermediate_size=32),
    "deepseek_v2": dict(**MLA, q_lora_rank=None, first_k_dense_replace=2),
    "deepseek_v3": dict(**MLA, q_lora_rank=16, first_k_dense_replace=1, n_group=2, topk_group=1),
    "glm4_moe_lite": dict(**MLA, q_lora_rank=16, mlp_layer_types=["dense", "sparse", "dense", "sparse"]),
}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_counts_match_the_transformers_model(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {"model_type": model_type, **TINY, **FAMILIES[model_type]}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))
    params = {name: p.numel() for name, p in model.named_parameters()}
    experts = sum(n for name, n in params.items() if ".experts." in name)
    moe_layers = {name.split(".layers.")[1].split(".")[0] for name in params if ".experts." in name}
    sizes = model_sizes(raw)
    assert sizes.params.total_params == sum(params.values())
    assert sizes.params.total_expert_params == experts
    assert sizes.params.num_moe_layers == len(moe_layers)


GPT_OSS_20B = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                   num_experts_per_tok=4, experts_per_token=4, vocab_size=201088, tie_word_embeddings=False,
                   attention_bias=True, swiglu_limit=7.0, torch_dtype="bfloat16",
                   quantization_config={"quant_method": "mxfp4",
                                        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                   "model.embed_tokens", "lm_head"]})
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128}
GLM_47_FLASH = dict(model_type="glm4_moe_lite", hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
                    num_hidden_layers=47, num_attention_heads=20, num_key_value_heads=20, n_shared_experts=1,
                    n_routed_experts=64, num_experts_per_tok=4, first_k_dense_replace=1, n_group=1, topk_group=1,
                    routed_scaling_factor=1.8, norm_topk_prob=True, q_lora_rank=768, kv_lora_rank=512,
                    qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, vocab_size=154880,
                    tie_word_embeddings=False, torch_dtype="bfloat16")


def test_published_models_match_design_numbers():
    small, small_bf16 = model_sizes(GPT_OSS_20B), model_sizes(GPT_OSS_20B, expert_dtype="bf16")
    assert small.expert_format == "mxfp4" and small_bf16.expert_format == "bfloat16"
    assert small_bf16.expert_bytes == (3 * 2880 * 2880 + 2 * 2880 + 2880) * 2  # weights + biases, bf16
    assert small.expert_bytes == 3 * 2880 * 2880 * 17 // 32 + (2 * 2880 + 2880) * 2  # 4.25 bits + bf16 biases
    assert format_bytes(small_bf16.zero_cache_h2d_bytes_per_token) == "4.78 GB"  # design.md
    assert format_bytes(small.zero_cache_h2d_bytes_per_token) == "1.27 GB"
    assert round(small.params.total_params / 1e9, 1) == 20.9  # "21B"
    big, big_bf16 = model_sizes(GPT_OSS_120B), model_sizes(GPT_OSS_120B, expert_dtype="bf16")
    assert format_bytes(big_bf16.zero_cache_h2d_bytes_per_token) == "7.17 GB"
    assert format_bytes(big.zero_cache_h2d_bytes_per_token) == "1.91 GB"
    assert round(big.params.total_params / 1e9, 1) == 116.8  # "117B"
    glm = model_sizes(GLM_47_FLASH)
    assert glm.params.num_moe_layers == 46 and glm.expert_bytes == 3 * 2048 * 1536 * 2
    assert format_bytes(glm.zero_cache_h2d_bytes_per_token) == "3.47 GB"
    assert round(glm.params.total_params / 1e9, 1) == 29.9  # "30B-A3B"


@pytest.mark.parametrize("family", ["gpt_oss", "gpt_oss_mxfp4", "deepseek_v3"])
def test_the_store_moves_what_the_size_estimate_says(adapter_models, family):
    import json

    from moespec.config import RuntimeConfig
    from moespec.runtime.load import load_offloaded

    folder = adapter_models[family]
    config = json.loads((folder / "config.json").read_text())
    om = load_offloaded(folder, RuntimeConfig(cache_experts=4))
    try:
        assert om.store.expert_bytes == model_sizes(config).expert_bytes
    finally:
        om.close()
