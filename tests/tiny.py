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
# A Hermes-style template with tools (the shape of Qwen2.5's), for the tool-calling tests.
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}<|assistant|>{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] %}<tool_call>\n{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}\n</tool_call>{% endfor %}<|end|>"
    "{% elif m['role'] == 'tool' %}<|user|><tool_response>\n{{ m['content'] }}\n</tool_response><|end|>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


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
    """A tiny config of ``family`` (qwen3_moe, qwen2_moe, mixtral, olmoe, gpt_oss, deepseek_v2, deepseek_v3,
    glm4_moe_lite). DeepSeek/GLM: layer 0 is dense, 4 groups of 2 experts (V3: top-2 groups)."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=top_k, max_position_embeddings=256,
                  eos_token_id=256, pad_token_id=256, bos_token_id=None, tie_word_embeddings=False)
    common.update(extra)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=2 * inter, moe_intermediate_size=inter, num_experts=experts,
                              head_dim=hidden // 4, norm_topk_prob=True, **common)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**{"intermediate_size": 2 * inter, "moe_intermediate_size": inter, "num_experts": experts,
                                 "shared_expert_intermediate_size": 2 * inter, **common})
    if family == "mixtral":
        return MixtralConfig(intermediate_size=inter, num_local_experts=experts, **common)
    if family == "olmoe":
        return OlmoeConfig(intermediate_size=inter, num_experts=experts, norm_topk_prob=False, **common)
    if family == "gpt_oss":
        from transformers import GptOssConfig

        common.setdefault("sliding_window", 4)  # short, so decoding crosses the window
        return GptOssConfig(intermediate_size=inter, num_local_experts=experts, head_dim=hidden // 4, **common)
    return _make_deepseek_config(family, hidden, inter, experts, common)


def _make_deepseek_config(family: str, hidden: int, inter: int, experts: int, common: dict):
    from transformers import DeepseekV2Config, DeepseekV3Config, Glm4MoeLiteConfig

    mla = dict(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, intermediate_size=2 * inter,
               moe_intermediate_size=inter, n_routed_experts=experts, n_shared_experts=1, rope_interleave=True)
    common = {**common, "num_key_value_heads": common["num_attention_heads"]}
    if family == "deepseek_v3":
        return DeepseekV3Config(**{**dict(q_lora_rank=16, n_group=4, topk_group=2, first_k_dense_replace=1,
                                          routed_scaling_factor=2.5, norm_topk_prob=True), **mla, **common})
    if family == "glm4_moe_lite":
        layers = common["num_hidden_layers"]
        return Glm4MoeLiteConfig(**{**dict(q_lora_rank=16, n_group=1, topk_group=1, routed_scaling_factor=1.8,
                                           mlp_layer_types=["dense"] + ["sparse"] * (layers - 1)), **mla, **common})
    if family == "deepseek_v2":
        return DeepseekV2Config(**{**dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
                                          topk_group=2, first_k_dense_replace=1, routed_scaling_factor=1.5),
                                   **mla, **common})
    raise ValueError(family)


def random_model(family: str, seed: int = 0, **cfg):
    """A tiny random transformers model of ``family`` (float32); routers get a larger init so that
    routing differs clearly between tokens."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family, **cfg), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if name.endswith(("gate.weight", "router.weight")) else 0.08)
            if "norm" in name:
                p.fill_(1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3/GLM: selection-only bias
                b.normal_(0, 0.3)
    return model


def make_checkpoint(folder: Path, family: str, seed: int = 0, shard_size: str | None = None, **cfg) -> Path:
    """Write a tiny random model of ``family`` + tokenizer into ``folder``; returns ``folder``.

    Routers get a larger init so that routing differs clearly between tokens.
    """
    model = random_model(family, seed, **cfg)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(folder, **kwargs)
    make_tokenizer(folder)
    return folder


def reference_model(folder: Path):
    """The plain transformers model (float32, eval) for exactness comparisons."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


GREEDY_PROMPT = [5, 17, 99, 3, 200, 41]


def reference_greedy(folder: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (no EOS stop): the new token ids."""
    with torch.no_grad():
        out = reference_model(folder).generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                               do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def offloaded_greedy(folder: Path, cfg, prompt: list[int], max_new_tokens: int) -> list[int]:
    """moespec's greedy continuation of ``prompt`` with RuntimeConfig ``cfg``: the new token ids."""
    from moespec.config import SamplingConfig
    from moespec.runtime.engine import Engine
    from moespec.runtime.load import load_offloaded

    om = load_offloaded(folder, cfg)
    try:
        return list(Engine(om).generate(prompt, SamplingConfig(max_new_tokens=max_new_tokens)))
    finally:
        om.close()


def engine_steps(om, ids: list[int], decode: int) -> tuple[torch.Tensor, list[int]]:
    """Last-position logits [1 + decode, V] of a prefill of ``ids`` and ``decode`` greedy steps on the
    loaded model ``om``, and the greedy tokens: what the fast-vs-reference tests compare."""
    from moespec.runtime.engine import Engine

    eng = Engine(om)
    eng.reset()
    outs = [eng.forward(ids, "prefill")]
    toks = []
    for _ in range(decode):
        toks.append(int(outs[-1].reshape(-1, outs[-1].shape[-1])[-1].argmax()))
        outs.append(eng.forward([toks[-1]], "decode"))
    return torch.cat([o.reshape(-1, o.shape[-1])[-1:] for o in outs]), toks


def two_turn_conversation(om) -> tuple[torch.Tensor, list[int]]:
    """Logits [steps, V] and greedy tokens of two turns on ``om``: the second reuses the first's
    cache, cropped back to a shorter prefix and re-prefilled (5 decode steps a turn)."""
    from moespec.runtime.engine import Engine

    eng, outs, toks = Engine(om), [], []
    ids = list(GREEDY_PROMPT)
    for _ in range(2):
        logits = eng.prefill(ids)
        for _ in range(5):
            outs.append(logits)
            toks.append(int(logits.argmax()))
            logits = eng.forward([toks[-1]], "decode")
        outs.append(logits)
        ids = eng.cached_ids[: len(ids) + 2] + [7, 11, 13]  # keeps a prefix: a crop, then a prefill
    return torch.stack(outs), toks


def profile_on_disk(folder: Path, out: Path, strategies: str, repeats: int, columns: int = 80):
    """`moespec profile` of ``folder`` on the disk tier (a 40 KiB RAM tier), 8 prompt tokens and 4
    decode steps: (report dict, trace dict, printed output); asserts it exits 0."""
    import json

    from typer.testing import CliRunner

    from moespec.cli.app import app

    res = CliRunner().invoke(app, ["profile", str(folder), "--device", "cpu", "--threads", "1",
                                   "--host-memory", "40KiB", "--strategies", strategies, "--prompt-len", "8",
                                   "--gen", "4", "--repeats", str(repeats), "--warmup", "1",
                                   "--out", str(out / "r.json"), "--trace", str(out / "t.json")],
                             env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    return json.loads((out / "r.json").read_text()), json.loads((out / "t.json").read_text()), res.output


def load_script(name: str):
    """The module of ``scripts/<name>.py`` (scripts are not a package), for tests of its functions."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_mxfp4_checkpoint(folder: Path, seed: int = 0, **cfg) -> Path:
    """A tiny GPT-OSS checkpoint whose experts are stored as MXFP4 blocks + scales (as on the Hub).

    Random FP4 codes and exponents near 2^-5; biases stay float. H and I must be multiples of 32.
    """
    import json

    from safetensors.torch import load_file, save_file

    cfg = {"hidden": 32, "inter": 32, **cfg}
    make_checkpoint(folder, "gpt_oss", seed=seed, **cfg)
    g = torch.Generator().manual_seed(seed + 100)
    sd = load_file(folder / "model.safetensors")
    for name in [n for n in sd if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, cols, rows = sd.pop(name).shape  # transformers' [E, H, 2I] / [E, I, H]: rows are the outputs
        sd[f"{name}_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        sd[f"{name}_scales"] = torch.randint(121, 125, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def with_chat_template(src: Path, dest: Path, template: str) -> Path:
    """A copy of checkpoint ``src`` at ``dest`` whose tokenizer uses chat ``template``."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(src, dest)
    tok = AutoTokenizer.from_pretrained(dest)
    tok.chat_template = template
    tok.save_pretrained(dest)
    return dest
