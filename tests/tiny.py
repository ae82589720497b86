"""Tiny random-weight checkpoints of each supported family, written with save_pretrained.

Each comes with a locally made byte-level tokenizer that has a chat template, so every command
can run on it without network.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


def make_tokenizer(folder: Path):
    """A byte-level BPE tokenizer (256 byte tokens + specials, no merges) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def make_config(family: str, hidden: int = 32, inter: int = 16, layers: int = 3, experts: int = 8,
                top_k: int = 2, vocab: int = 260, **extra):
    """A tiny config of ``family`` (qwen3_moe, qwen2_moe, mixtral, olmoe)."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=top_k, max_position_embeddings=256,
                  eos_token_id=256, pad_token_id=256, bos_token_id=None, tie_word_embeddings=False)
    common.update(extra)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=2 * inter, moe_intermediate_size=inter, num_experts=experts,
                              head_dim=hidden // 4, norm_topk_prob=True, **common)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(intermediate_size=2 * inter, moe_intermediate_size=inter, num_experts=experts,
                              shared_expert_intermediate_size=2 * inter, **common)
    if family == "mixtral":
        return MixtralConfig(intermediate_size=inter, num_local_experts=experts, **common)
    if family == "olmoe":
        return OlmoeConfig(intermediate_size=inter, num_experts=experts, norm_topk_prob=False, **common)
    raise ValueError(family)


def make_checkpoint(folder: Path, family: str, seed: int = 0, shard_size: str | None = None, **cfg) -> Path:
    """Write a tiny random model of ``family`` + tokenizer into ``folder``; returns ``folder``.

    Routers get a larger init so that routing differs clearly between tokens.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = make_config(family, **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if name.endswith("gate.weight") else 0.08)
            if "norm" in name:
                p.fill_(1.0)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(folder, **kwargs)
    make_tokenizer(folder)
    return folder


def reference_model(folder: Path):
    """The plain transformers model (float32, eval) for exactness comparisons."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
