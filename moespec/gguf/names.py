"""GGUF tensor names -> the transformers model's names, through gguf's own tables.

Shapes: E experts, I expert intermediate, H hidden; n heads, r kv_lora_rank (DeepSeek's MLA).

The dense map is built as transformers builds it for the families it loads: every name of the
model's (empty) state dict is sent through ``gguf.get_tensor_name_map(arch, layers)``, the table
llama.cpp's converter uses, and the result is inverted. What the converter changes besides the
name is undone (``Plan.kind``): Mixtral's q/k rows were permuted for ggml's rope ("unpermute");
DeepSeek's kv_b was split into k_b (transposed) and v_b ("kv_b"); a tensor stored with extra unit
dimensions, as Qwen2-MoE's shared-expert gate [1, 1, H], takes the model's shape ("reshape").
Expert tensors are named by gguf's constants (MODEL_TENSOR.FFN_{GATE,UP,DOWN}_EXP).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, replace

from moespec.errors import CheckpointError

EXPERT_PARTS = ("gate", "up", "down")


@dataclass(frozen=True)
class Plan:
    """How one dense tensor of the model is made from the file.

    Attributes:
        name: the transformers name ("model.layers.0.self_attn.q_proj.weight").
        sources: the GGUF tensors it is made from (two for "kv_b": k_b, then v_b).
        kind: "plain", "reshape", "unpermute" (argument: heads) or "kv_b" (argument: n, nope, v).
        args: the kind's integers.
        shape: the model's shape of the tensor.
    """

    name: str
    sources: tuple[str, ...]
    kind: str = "plain"
    args: tuple[int, ...] = ()
    shape: tuple[int, ...] = ()


def _arch_enum(arch: str):
    import gguf

    return next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)


def expert_names(layers: int) -> dict[str, tuple[int, str, str]]:
    """GGUF name -> (layer, part, "weight" | "bias") of every expert tensor a model of ``layers`` may
    have, from gguf's constants (``blk.{bid}.ffn_gate_exps`` ...)."""
    import gguf

    parts = {gguf.MODEL_TENSOR.FFN_GATE_EXP: "gate", gguf.MODEL_TENSOR.FFN_UP_EXP: "up",
             gguf.MODEL_TENSOR.FFN_DOWN_EXP: "down"}
    return {f"{gguf.TENSOR_NAMES[t].format(bid=layer)}.{suffix}": (layer, part, suffix)
            for t, part in parts.items() for layer in range(layers) for suffix in ("weight", "bias")}


def dense_plans(config, arch: str, gguf_names: set[str]) -> list[Plan]:
    """A Plan for every dense tensor of the transformers model ``config`` describes.

    Raises:
        CheckpointError: a tensor the model needs is not in the file (names both names).
    """
    import gguf
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    tmap = gguf.get_tensor_name_map(_arch_enum(arch), config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    plans, missing = [], []
    for name, t in skeleton.state_dict().items():
        if ".mlp.experts." in name or (tied and name == "lm_head.weight"):
            continue
        plan = _plan(name, tuple(t.shape), tmap, arch, heads, kv_heads, config, gguf_names)
        if plan is None or not set(plan.sources) <= gguf_names:
            missing.append(f"{name} ({' + '.join(plan.sources) if plan else 'no GGUF name'})")
            continue
        plans.append(replace(plan, shape=tuple(t.shape)))
    if missing:
        raise CheckpointError(f"the GGUF lacks {len(missing)} tensor(s) the {config.model_type} model needs, e.g. "
                              f"{', '.join(missing[:3])}", "the file is incomplete or not converted by llama.cpp")
    return plans


def _plan(name: str, shape: tuple[int, ...], tmap, arch: str, heads: int, kv_heads, config,
          gguf_names: set[str]) -> Plan | None:
    base, _, suffix = name.rpartition(".")
    if name.endswith("e_score_correction_bias"):  # llama.cpp: ...e_score_correction.bias -> exp_probs_b.bias
        found = tmap.get_name(name.removesuffix("_bias"))
        return Plan(name, (f"{found}.bias",)) if found else None
    if name.endswith("self_attn.sinks"):  # GPT-OSS: a parameter without a suffix, stored as .weight
        found = tmap.get_name(name)
        return Plan(name, (f"{found}.weight",)) if found else None
    found = tmap.get_name(base)
    if found is None:
        return None
    gname = f"{found}.{suffix}"
    if name.endswith("kv_b_proj.weight") and gname not in gguf_names:  # split by llama.cpp's MLA conversion
        k_b, v_b = (gname.replace("attn_kv_b", part) for part in ("attn_k_b", "attn_v_b"))
        return Plan(name, (k_b, v_b), "kv_b", (heads, config.qk_nope_head_dim, config.v_head_dim))
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        return Plan(name, (gname,), "unpermute", (heads if "q_proj" in name else kv_heads or heads,))
    return Plan(name, (gname,), "reshape", shape)


def apply(plan: Plan, values: list):
    """The model's tensor from the plan's dequantised sources (torch tensors, float)."""
    import torch

    if plan.kind == "reshape":
        v = values[0]
        if tuple(v.shape) != plan.args and v.numel() == math.prod(plan.args) and \
                [d for d in v.shape if d != 1] == [d for d in plan.args if d != 1]:
            return v.reshape(plan.args)  # only unit dimensions differ ([1, 1, H] -> [1, H])
        return v
    if plan.kind == "unpermute":
        (n,), w = plan.args, values[0]  # [out, in]: rows (n, d/2, 2) back to (n, 2, d/2)
        return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    if plan.kind == "kv_b":
        (n, nope, vd), (k_b, v_b) = plan.args, values  # k_b [n, r, nope], v_b [n, v, r]
        return torch.cat([k_b.reshape(n, -1, nope).transpose(1, 2), v_b.reshape(n, vd, -1)], dim=1).reshape(n * (nope + vd), -1)
    return values[0]

