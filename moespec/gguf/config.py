"""A GGUF model's metadata -> the transformers config of the same model.

llama.cpp names architectures its own way ("qwen3moe", "gpt-oss", "deepseek2"; Mixtral is "llama"
with experts) and keeps hyper-parameters under ``{arch}.*`` keys (gguf.Keys.LLM). Each function
below maps one architecture, reading what llama.cpp's converter writes and, where the file is
silent, llama.cpp's own behaviour for that architecture (e.g. Qwen3-MoE renormalises its top-k,
Qwen2-MoE does not). Two traps seen in transformers 5.24's GGUF reader are handled: a qwen3moe /
qwen2moe expert's width is ``expert_feed_forward_length`` (transformers leaves it at its default),
and ``feed_forward_length`` is the dense MLP's.
"""

from __future__ import annotations

from moespec.errors import UnsupportedModelError
from moespec.gguf.reader import GgufCheckpoint

# GGUF architecture -> (what it is, the transformers model_type moespec runs it as).
SUPPORTED = {"qwen3moe": "Qwen3-MoE", "qwen2moe": "Qwen2-MoE", "llama": "Mixtral: llama with experts",
             "olmoe": "OLMoE", "gpt-oss": "GPT-OSS", "deepseek2": "DeepSeek-V2/V3, GLM-4.7-Flash"}


def supported_text() -> str:
    """The architectures moespec runs from GGUF, for messages."""
    return ", ".join(f"{a} ({what})" for a, what in SUPPORTED.items())


def _tokens(ck: GgufCheckpoint) -> dict:
    """bos/eos/pad ids and the vocabulary size from the tokenizer metadata (and token_embd's shape)."""
    out = {}
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        value = ck.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            out[name] = int(value)
    embd = ck.tensors.get("token_embd.weight")
    tokens = ck.get("tokenizer.ggml.tokens")
    vocab = ck.get(".vocab_size") or (embd.shape[0] if embd else None)
    if vocab is None and isinstance(tokens, dict):
        vocab = tokens["array_length"]
    if vocab is not None:
        out["vocab_size"] = int(vocab)
    return out


def _max(value) -> int:
    """A per-layer array (some files store head_count_kv per layer) or a scalar -> one int."""
    return int(max(value)) if isinstance(value, list) else int(value)


def _decimal(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06):
    float32 holds ~7.2 significant digits, so 7 recover the original wherever it had at most 7."""
    return float(f"{float(value):.7g}")


def _rope(ck: GgufCheckpoint) -> dict:
    rope = {"rope_type": "default", "rope_theta": _decimal(ck.get(".rope.freq_base", 10000.0))}
    if str(ck.get(".rope.scaling.type", "")) == "yarn":
        rope.update(rope_type="yarn", factor=_decimal(ck.get(".rope.scaling.factor")),
                    original_max_position_embeddings=int(ck.get(".rope.scaling.original_context_length")),
                    beta_fast=float(ck.get(".rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(ck.get(".rope.scaling.yarn_beta_slow", 1.0)))
        log_mul = ck.get(".rope.scaling.yarn_log_multiplier")
        if log_mul:  # DeepSeek: llama.cpp keeps 0.1 * mscale_all_dim (mscale equals it in their configs)
            rope.update(mscale=float(log_mul) / 0.1, mscale_all_dim=float(log_mul) / 0.1)
    return rope


def hf_config_dict(ck: GgufCheckpoint) -> dict:
    """The transformers config (as config.json would hold it) of the model in ``ck``.

    Raises:
        UnsupportedModelError: an architecture moespec does not run (lists those it does), or a
            dense model (no experts).
    """
    arch = ck.arch
    if arch not in SUPPORTED:
        raise UnsupportedModelError(f"{ck.files.name} is a GGUF of architecture {arch!r}, which moespec does not run",
                                    f"supported GGUF architectures: {supported_text()}")
    experts = int(ck.get(".expert_count", 0) or 0)
    if experts == 0 and not any(".ffn_gate_exps." in n for n in ck.tensors):
        raise UnsupportedModelError(f"{ck.files.name} is a dense {arch} model (no experts): moespec offloads the "
                                    f"experts of Mixture-of-Experts models",
                                    "run it with llama.cpp, or pick a MoE model (e.g. a Qwen3-30B-A3B GGUF)")
    heads = int(ck.get(".attention.head_count"))
    hidden = int(ck.get(".embedding_length"))
    # blocks past the main ones are multi-token-prediction heads (GLM's NextN), not decoder layers
    layers = int(ck.get(".block_count")) - int(ck.get(".nextn_predict_layers", 0) or 0)
    common = {"hidden_size": hidden, "num_hidden_layers": layers,
              "max_position_embeddings": int(ck.get(".context_length", 4096)), "num_attention_heads": heads,
              "num_key_value_heads": _max(ck.get(".attention.head_count_kv", heads)),
              "rms_norm_eps": _decimal(ck.get(".attention.layer_norm_rms_epsilon", 1e-6)),
              "num_experts_per_tok": int(ck.get(".expert_used_count")), "rope_parameters": _rope(ck),
              "tie_word_embeddings": "output.weight" not in ck.tensors, **_tokens(ck)}
    norm = ck.get(".expert_weights_norm")
    ff = ck.get(".feed_forward_length")
    head_dim = ck.get(".attention.key_length")
    bias = "blk.0.attn_q.bias" in ck.tensors
    if arch in ("qwen3moe", "qwen2moe"):
        moe = int(ck.get(".expert_feed_forward_length", ff))
        out = {**common, "num_experts": experts, "moe_intermediate_size": moe, "intermediate_size": int(ff or moe),
               "head_dim": int(head_dim or hidden // heads), "decoder_sparse_step": 1, "mlp_only_layers": []}
        if arch == "qwen3moe":
            return {**out, "model_type": "qwen3_moe", "norm_topk_prob": True if norm is None else bool(norm),
                    "attention_bias": bias}
        shared = int(ck.get(".expert_shared_feed_forward_length", 0) or 0)
        return {**out, "model_type": "qwen2_moe", "norm_topk_prob": bool(norm), "qkv_bias": bias,
                "shared_expert_intermediate_size": shared}
    if arch == "llama":
        dim = ck.get(".rope.dimension_count") or head_dim or hidden // heads
        return {**common, "model_type": "mixtral", "num_local_experts": experts, "intermediate_size": int(ff),
                "head_dim": int(dim), "sliding_window": None}
    if arch == "olmoe":
        return {**common, "model_type": "olmoe", "num_experts": experts, "intermediate_size": int(ff),
                "norm_topk_prob": bool(norm)}
    if arch == "gpt-oss":
        rope = common["rope_parameters"]
        if rope["rope_type"] == "yarn":  # GPT-OSS's YaRN does not truncate its frequency bounds (transformers' default)
            rope["truncate"] = False
        return {**common, "model_type": "gpt_oss", "num_local_experts": experts,
                "intermediate_size": int(ck.get(".expert_feed_forward_length", ff)), "head_dim": int(head_dim or 64),
                "sliding_window": int(ck.get(".attention.sliding_window", 128)), "attention_bias": True}
    return _deepseek(ck, common, experts, norm, ff)


def _deepseek(ck: GgufCheckpoint, common: dict, experts: int, norm, ff) -> dict:
    """deepseek2: DeepSeek-V3 (and GLM-4.7-Flash) route by sigmoid (expert_gating_func 2), V2 by softmax."""
    rope_dim = int(ck.get(".rope.dimension_count"))
    key = int(ck.get(".attention.key_length_mla") or ck.get(".attention.key_length"))
    value = int(ck.get(".attention.value_length_mla") or ck.get(".attention.value_length"))
    groups, used = int(ck.get(".expert_group_count", 1) or 1), int(ck.get(".expert_group_used_count", 1) or 1)
    q_lora = int(ck.get(".attention.q_lora_rank", 0) or 0) or None
    sigmoid = int(ck.get(".expert_gating_func", 1) or 1) == 2
    out = {**common, "num_key_value_heads": common["num_attention_heads"], "n_routed_experts": experts,
           "n_shared_experts": int(ck.get(".expert_shared_count", 0) or 0),
           "moe_intermediate_size": int(ck.get(".expert_feed_forward_length")), "intermediate_size": int(ff),
           "first_k_dense_replace": int(ck.get(".leading_dense_block_count", 0) or 0),
           "routed_scaling_factor": float(ck.get(".expert_weights_scale", 1.0)), "norm_topk_prob": bool(norm),
           "n_group": groups, "topk_group": used, "q_lora_rank": q_lora,
           "kv_lora_rank": int(ck.get(".attention.kv_lora_rank")), "qk_rope_head_dim": rope_dim,
           "qk_nope_head_dim": key - rope_dim, "v_head_dim": value, "rope_interleave": True}
    if sigmoid:
        return {**out, "model_type": "deepseek_v3"}
    return {**out, "model_type": "deepseek_v2", "topk_method": "group_limited_greedy" if groups > 1 else "greedy"}


def hf_config(ck: GgufCheckpoint, dtype: str):
    """The transformers config object, with ``dtype`` ("float32", "bfloat16", ...) as its default dtype.

    Raises:
        UnsupportedModelError: see :func:`hf_config_dict`.
    """
    from transformers import AutoConfig

    d = hf_config_dict(ck)
    return AutoConfig.for_model(d.pop("model_type"), dtype=dtype, **d)
