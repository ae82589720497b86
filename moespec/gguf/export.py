"""Writing a transformers MoE model as a GGUF file, the way llama.cpp's convert_hf_to_gguf.py does.

Shapes: E experts, I expert intermediate, H hidden (torch order; GGUF lists dimensions reversed).

For the round trip of the embedded default model (``scripts/export_gguf.py``), the loading-memory
script and the tests' tiny files. Tensor names come from gguf's own tables
(``gguf.get_tensor_name_map``); what llama.cpp's converter changes on the way is changed here too:
the fused experts become ffn_{gate,up,down}_exps [E, ...] (GPT-OSS: its interleaved gate/up split
and transposed, biases too), Mixtral's (arch "llama") q/k rows are permuted for ggml's rope,
DeepSeek's kv_b splits into k_b (transposed) and v_b, its correction bias is exp_probs_b.bias,
GPT-OSS's sinks are attn_sinks.weight. Tensors are stored in the asked GGUF type where gguf can
quantise it (F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1, MXFP4) and as random blocks with sane scales
where it cannot (the K-quants: every byte pattern is a valid block). :func:`export_gguf` returns
the model's state dict as the file holds it (gguf's numpy dequantisation, mapped back), which is
what a reader must reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ARCH_OF = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe",
           "gpt_oss": "gpt-oss", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "glm4_moe_lite": "deepseek2"}
EXPERT_PARTS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExportTypes:
    """GGUF types to store tensors in (names of gguf.GGMLQuantizationType).

    Attributes:
        experts: the expert tensors' type (a rows not whole blocks of it fall back to ``fallback``).
        dense: 2-D dense weights (embeddings, attention, routers, shared experts); 1-D ones stay F32.
        per_part: overrides per expert part ("gate", "up", "down").
        per_layer: overrides per (layer, part), as llama-quantize's Q4_K_M gives some ffn_down Q6_K.
        fallback: for tensors whose rows are not whole blocks of the asked type (llama.cpp: F16; F32 keeps exactness).
    """

    experts: str = "F32"
    dense: str = "F32"
    per_part: dict = field(default_factory=dict)
    per_layer: dict = field(default_factory=dict)
    fallback: str = "F32"

    def expert_type(self, layer: int, part: str) -> str:
        return self.per_layer.get((layer, part), self.per_part.get(part, self.experts))


def _qtype(name: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name]


# Random K-quant blocks: (byte offset of each fp16 scale field, its magnitude) so values stay ~0.1.
_RANDOM_SCALES = {"Q2_K": ((80, 4e-3), (82, 6e-3)), "Q3_K": ((108, 1.5e-3),), "Q4_K": ((0, 2e-4), (2, 1.5e-3)),
                  "Q5_K": ((0, 1e-4), (2, 1.5e-3)), "Q6_K": ((208, 5e-5),)}


def random_blocks(type_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random GGUF blocks of a [..., C] tensor: uint8 [..., C / block * bytes]; K-quants' fp16 scale
    fields are set so values stay ~0.1 (every other byte pattern is a valid block)."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[_qtype(type_name)]
    nb = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for at, scale in _RANDOM_SCALES.get(type_name, ()):
        raw[:, at : at + 2] = (rng.uniform(0.5, 1.5, size=(nb, 1)) * scale).astype(np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def encode(values: np.ndarray, type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """``values`` [..., C] float32 stored as ``type_name``: (array to write, type actually used).

    Random blocks for the K-quants (gguf has no quantiser for them); F32 when C is not whole blocks.
    """
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import quantize

    qtype = _qtype(type_name)
    block, size = GGML_QUANT_SIZES[qtype]
    if values.shape[-1] % block:
        return values.astype(np.float32), "F32"
    if type_name in _RANDOM_SCALES:
        return random_blocks(type_name, values.shape, rng), type_name
    return quantize(values.astype(np.float32), qtype), type_name


def decode(raw: np.ndarray, type_name: str) -> np.ndarray:
    """gguf's numpy reference: what a reader must get back, float32 in the logical shape."""
    from gguf.quants import dequantize

    if type_name == "F32":
        return raw.astype(np.float32)
    return dequantize(raw, _qtype(type_name)).astype(np.float32)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows from halves to interleaved pairs (ggml's rope)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _emits(model, arch: str, shexp_gate_3d: bool):
    """(gguf name, float32 array, expert (layer, part) or None, back) for every tensor to write.

    ``back(values, ref)`` puts the decoded ``values`` where they belong in ``ref`` (name -> numpy
    array of the state dict), undoing what was done on the way in.
    """
    import gguf

    config = model.config
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    tmap = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    out = []
    for name, w in sd.items():
        if tied and name == "lm_head.weight":
            continue
        if ".mlp.experts." in name:
            out += _expert_emits(name, w, arch)
            continue
        base, _, suffix = name.rpartition(".")
        if name.endswith("kv_b_proj.weight"):
            out += _kv_b_emits(name, w, config, tmap.get_name(base))
            continue
        if name.endswith("e_score_correction_bias"):
            gname = tmap.get_name(name.removesuffix("_bias")) + ".bias"
        elif name.endswith("self_attn.sinks"):
            gname = tmap.get_name(name) + ".weight"
        else:
            gname = tmap.get_name(base) + "." + suffix
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in name else kv_heads
            out.append((gname, _permute(w, n), None, lambda v, r, name=name, n=n: np.copyto(r[name], _unpermute(v, n))))
        elif name.endswith("shared_expert_gate.weight") and shexp_gate_3d:
            out.append((gname, w.reshape(1, 1, -1), None, lambda v, r, name=name: np.copyto(r[name], v.reshape(1, -1))))
        else:
            out.append((gname, w, None, lambda v, r, name=name: np.copyto(r[name], v.reshape(r[name].shape))))
    return out


def _expert_emits(name: str, w: np.ndarray, arch: str):
    """ffn_{gate,up,down}_exps (+ GPT-OSS biases) from transformers 5's fused experts."""
    layer, kind = int(name.split(".")[2]), name.rsplit(".", 1)[1]
    blk = f"blk.{layer}"
    if arch != "gpt-oss":  # gate_up [E, 2I, H] halves, down [E, H, I]
        if kind == "down_proj":
            return [(f"{blk}.ffn_down_exps.weight", w, (layer, "down"), lambda v, r: np.copyto(r[name], v))]
        i = w.shape[1] // 2
        return [(f"{blk}.ffn_gate_exps.weight", w[:, :i], (layer, "gate"), lambda v, r: np.copyto(r[name][:, :i], v)),
                (f"{blk}.ffn_up_exps.weight", w[:, i:], (layer, "up"), lambda v, r: np.copyto(r[name][:, i:], v))]
    # GPT-OSS: gate_up [E, H, 2I] with gate/up interleaved columns, down [E, I, H]; biases [E, 2I], [E, H]
    t = (0, 2, 1)
    if kind == "down_proj":
        return [(f"{blk}.ffn_down_exps.weight", w.transpose(t), (layer, "down"),
                 lambda v, r: np.copyto(r[name], v.transpose(t)))]
    if kind == "down_proj_bias":
        return [(f"{blk}.ffn_down_exps.bias", w, None, lambda v, r: np.copyto(r[name], v))]
    if kind == "gate_up_proj_bias":
        return [(f"{blk}.ffn_gate_exps.bias", w[:, ::2], None, lambda v, r: np.copyto(r[name][:, ::2], v)),
                (f"{blk}.ffn_up_exps.bias", w[:, 1::2], None, lambda v, r: np.copyto(r[name][:, 1::2], v))]
    return [(f"{blk}.ffn_gate_exps.weight", w[:, :, ::2].transpose(t), (layer, "gate"),
             lambda v, r: np.copyto(r[name][:, :, ::2], v.transpose(t))),
            (f"{blk}.ffn_up_exps.weight", w[:, :, 1::2].transpose(t), (layer, "up"),
             lambda v, r: np.copyto(r[name][:, :, 1::2], v.transpose(t)))]


def _kv_b_emits(name: str, w: np.ndarray, config, kv_b: str):
    """DeepSeek kv_b [n*(nope+v), r] -> attn_k_b [n, r, nope] (transposed) and attn_v_b [n, v, r], as llama.cpp splits it."""
    n, nope, vd = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    kv = w.reshape(n, nope + vd, w.shape[-1])  # [n, nope+v, r]

    def view(r):
        return r[name].reshape(n, nope + vd, -1)

    return [(kv_b.replace("attn_kv_b", "attn_k_b") + ".weight", kv[:, :nope].transpose(0, 2, 1), None,
             lambda v, r: np.copyto(view(r)[:, :nope], v.transpose(0, 2, 1))),
            (kv_b.replace("attn_kv_b", "attn_v_b") + ".weight", kv[:, nope:], None,
             lambda v, r: np.copyto(view(r)[:, nope:], v))]


def _n_experts(config) -> int:
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
               or config.n_routed_experts)


def write_metadata(w, config, arch: str, name: str) -> None:
    """The keys llama.cpp's converter writes for ``arch`` (and expert_weights_norm where it would be lost)."""
    mt = config.model_type
    rope = dict(config.rope_parameters or {})
    w.add_name(name)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(1 if arch == "deepseek2" else config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_expert_count(_n_experts(config))
    w.add_expert_used_count(config.num_experts_per_tok)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if mt in ("qwen3_moe", "qwen2_moe", "gpt_oss"):
        w.add_expert_feed_forward_length(config.moe_intermediate_size if mt != "gpt_oss" else config.intermediate_size)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if mt == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if mt in ("qwen2_moe", "olmoe") and config.norm_topk_prob:  # llama.cpp's default for these is False
        w.add_expert_weights_norm(True)
    if mt == "mixtral":
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(config.vocab_size)
    if mt == "gpt_oss":
        w.add_sliding_window(config.sliding_window)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf_rope_yarn())
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if "mscale_all_dim" in rope:
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if arch == "deepseek2":
        _write_deepseek(w, config)


def gguf_rope_yarn():
    from gguf import RopeScalingType

    return RopeScalingType.YARN


def _write_deepseek(w, config) -> None:
    """DeepSeek-V2/V3 (MLA written as llama.cpp writes it since its MLA absorption: key/value lengths per kv_lora)."""
    from gguf import ExpertGatingFuncType

    first_dense = getattr(config, "first_k_dense_replace", None)
    if first_dense is None:  # GLM-4.7-Flash names its dense layers instead
        first_dense = sum(1 for t in getattr(config, "mlp_layer_types", []) if t == "dense")
    w.add_leading_dense_block_count(first_dense)
    w.add_expert_feed_forward_length(config.moe_intermediate_size)
    w.add_expert_shared_count(config.n_shared_experts)
    w.add_expert_weights_scale(config.routed_scaling_factor)
    w.add_expert_weights_norm(bool(getattr(config, "norm_topk_prob", False)))
    w.add_expert_gating_func(ExpertGatingFuncType.SOFTMAX if config.model_type == "deepseek_v2" else ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(getattr(config, "n_group", None) or 1)
    w.add_expert_group_used_count(getattr(config, "topk_group", None) or 1)
    if getattr(config, "q_lora_rank", None):
        w.add_q_lora_rank(config.q_lora_rank)
    w.add_kv_lora_rank(config.kv_lora_rank)
    w.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    w.add_value_length(config.kv_lora_rank)
    w.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    w.add_value_length_mla(config.v_head_dim)
    w.add_rope_dimension_count(config.qk_rope_head_dim)


def write_tokenizer(w, tokenizer, pre: str, pad_to: int = 0) -> None:
    """A byte-level BPE tokenizer as llama.cpp stores it: tokens by id, token types (3 control, 4
    user-defined), merges, special ids, chat template; ``pad_to`` pads the vocabulary with
    ``[PADn]`` tokens as llama.cpp does for a model whose embedding has more rows."""
    import json

    tj = json.loads(tokenizer.backend_tokenizer.to_str())
    if tj["model"]["type"] != "BPE":
        raise ValueError(f"only byte-level BPE tokenizers are exported, not {tj['model']['type']}")
    added = {a["id"]: a for a in tj["added_tokens"]}
    vocab = tj["model"]["vocab"]
    n = max(max([*vocab.values(), *added]) + 1, pad_to)
    tokens, types = [f"[PAD{i}]" for i in range(n)], [1] * n
    for tok, i in vocab.items():
        tokens[i] = tok
    for i, a in added.items():
        tokens[i], types[i] = a["content"], 3 if a["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges:
        w.add_token_merges(merges)
    else:  # GGUFWriter drops an empty array; readers then derive merges from the scores
        w.add_token_scores([0.0] * n)
    for kind, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("pad", w.add_pad_token_id),
                      ("unk", w.add_unk_token_id)):
        token_id = getattr(tokenizer, f"{kind}_token_id", None)
        if token_id is not None:
            add(token_id)
    w.add_add_bos_token(False)
    if tokenizer.chat_template:
        w.add_chat_template(tokenizer.chat_template)


def export_gguf(model, path: Path, types: ExportTypes = ExportTypes(), tokenizer=None, *, name: str = "moespec",
                pre: str = "default", seed: int = 0, shexp_gate_3d: bool = False,
                split_max_tensors: int = 0) -> dict[str, torch.Tensor]:
    """Write ``model`` (a transformers MoE CausalLM) to ``path`` as llama.cpp would, tensor by tensor.

    Args:
        types: what to store each tensor as.
        tokenizer: a byte-level BPE fast tokenizer to embed (llama.cpp's "gpt2" model), or None.
        pre: tokenizer.ggml.pre (the pre-tokenizer name llama.cpp chose).
        seed: for random K-quant blocks.
        shexp_gate_3d: Qwen2-MoE's shared-expert gate as [1, 1, H] (seen in llama.cpp-converted files).
        split_max_tensors: > 0 writes a split set (``<stem>-00001-of-0000N.gguf``) of at most this many tensors per part.

    Returns:
        The model's state dict as the file holds it: every tensor decoded by gguf's numpy reference and
        put back where it came from (float32 CPU tensors); load it into the model to get the reference.
    """
    import gguf

    arch = ARCH_OF[model.config.model_type]
    rng = np.random.default_rng(seed)
    emits = _emits(model, arch, shexp_gate_3d)
    ref = {k: v.detach().float().cpu().numpy().copy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    write_metadata(w, model.config, arch, name)
    if tokenizer is not None:
        write_tokenizer(w, tokenizer, pre)
    encoded = []
    for gname, arr, expert, back in emits:
        tname = "F32" if arr.ndim < 2 or "norm" in gname else types.dense
        if expert is not None:
            tname = types.expert_type(*expert)
        data, used = encode(np.ascontiguousarray(arr, dtype=np.float32), tname, rng)
        if used == "F32" and tname != "F32" and types.fallback != "F32":
            data, used = encode(np.ascontiguousarray(arr, dtype=np.float32), types.fallback, rng)
        encoded.append((gname, data, used, arr.shape, back))
        w.add_tensor(gname, data, raw_dtype=None if used in ("F32", "F16") else _qtype(used))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for gname, data, used, shape, back in encoded:
        back(decode(data, used).reshape(shape), ref)
    return {k: torch.from_numpy(v) for k, v in ref.items()}
