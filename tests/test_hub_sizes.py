"""Size breakdowns from config.json, checked against the transformers models they describe."""

from __future__ import annotations

import pytest

from moespec.errors import UnsupportedModelError
from moespec.hub.sizes import format_bytes, model_sizes

BASE = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=64, num_experts_per_tok=2, dtype="bfloat16")
FAMILIES = {
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=8, head_dim=8, decoder_sparse_step=2),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=8, shared_expert_intermediate_size=12, mlp_only_layers=[0]),
    "mixtral": dict(num_local_experts=4),
    "olmoe": dict(num_experts=4),
}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_counts_match_the_transformers_model(model_type):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {"model_type": model_type, **BASE, **FAMILIES[model_type]}
    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = {name: p.numel() for name, p in model.named_parameters()}
    experts = sum(n for name, n in params.items() if ".experts." in name)
    moe_layers = {name.split(".layers.")[1].split(".")[0] for name in params if ".experts." in name}

    sizes = model_sizes(raw)
    assert sizes.params.total_params == sum(params.values())
    assert sizes.params.total_expert_params == experts
    assert sizes.params.num_moe_layers == len(moe_layers)
    assert sizes.bytes_per_param == 2
    assert sizes.experts_bytes + sizes.dense_bytes == sizes.total_bytes == 2 * sum(params.values())


def test_moe_layer_placement_of_qwen_configs():
    assert model_sizes({"model_type": "qwen3_moe", **BASE, **FAMILIES["qwen3_moe"]}).params.num_moe_layers == 2
    assert model_sizes({"model_type": "qwen2_moe", **BASE, **FAMILIES["qwen2_moe"]}).params.num_moe_layers == 3


QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, intermediate_size=6144, torch_dtype="bfloat16")
OLMOE_1B_7B = dict(model_type="olmoe", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                   num_key_value_heads=16, vocab_size=50304, num_experts=64, num_experts_per_tok=8,
                   intermediate_size=1024, torch_dtype="bfloat16")
MIXTRAL_8X7B = dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=14336, torch_dtype="bfloat16")


def test_published_models_match_design_numbers():
    qwen = model_sizes(QWEN3_30B_A3B)
    assert qwen.zero_cache_h2d_bytes_per_token == 48 * 8 * 3 * 2048 * 768 * 2
    assert format_bytes(qwen.zero_cache_h2d_bytes_per_token) == "3.62 GB"  # design.md
    assert round(qwen.params.total_params / 1e9, 1) == 30.5  # "30B"
    olmoe = model_sizes(OLMOE_1B_7B)
    assert format_bytes(olmoe.zero_cache_h2d_bytes_per_token) == "1.61 GB"  # design.md
    assert round(olmoe.params.total_params / 1e9, 2) == 6.92  # "7B"
    mixtral = model_sizes(MIXTRAL_8X7B)
    assert round(mixtral.params.total_params / 1e9, 1) == 46.7  # Mixtral-8x7B: 46.7B parameters
    assert format_bytes(mixtral.expert_bytes) == "352.32 MB"


def test_dtype_and_errors():
    assert model_sizes({**OLMOE_1B_7B, "torch_dtype": "float32"}).bytes_per_param == 4
    assert model_sizes({k: v for k, v in OLMOE_1B_7B.items() if k != "torch_dtype"}).dtype == "bfloat16"
    with pytest.raises(UnsupportedModelError, match="no size rule for model_type 'llama'"):
        model_sizes({"model_type": "llama"})
    with pytest.raises(UnsupportedModelError, match="moe_intermediate_size"):
        model_sizes({k: v for k, v in QWEN3_30B_A3B.items() if k != "moe_intermediate_size"})


def test_format_bytes():
    assert [format_bytes(n) for n in (0, 999, 1536, 3_623_878_656)] == ["0 B", "999 B", "1.54 kB", "3.62 GB"]


def test_from_disk_needs_the_dense_part_two_k_rows_and_the_headroom():
    qwen = model_sizes(QWEN3_30B_A3B)  # bf16 rows of 3 x 2048 x 768 x 2 B = 9 MiB exactly (4 KiB multiples)
    assert qwen.expert_bytes == 9 * 2**20
    assert qwen.from_disk_min_ram_bytes == qwen.dense_bytes + 16 * 9 * 2**20 + 512 * 2**20
    assert qwen.runs_from_disk(32 * 2**30) and not qwen.runs_from_disk(128 * 2**30)  # 61 GB on CPU
