"""A whole conversation: each turn's greedy tokens equal transformers `generate` on the whole
rendered conversation (system message included), float32, every architecture.

The chat template here re-renders differently from what was generated, as real ones do: earlier
answers are shortened (Qwen3 drops earlier thinking: divergence in the middle), a marker comes and
goes at the very start (divergence at the first token), and the random answers re-tokenise
differently (special ids skipped when decoding, invalid UTF-8 replaced). GPT-OSS runs past its
sliding window (4 tokens) from the first turn.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import CHAT_TEMPLATE, reference_model

from moespec.chat.render import merge_system, render
from moespec.chat.session import ChatSession
from moespec.config import Predictor, RuntimeConfig, SamplingConfig
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder

DIVERGING_TEMPLATE = (
    "{% if messages|length == 8 %}#{% endif %}"  # only on turn 4 (with a system message)
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' and loop.index0 + 2 < messages|length %}{{ m['content'][:3] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NO_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    + CHAT_TEMPLATE
)
QUESTIONS = ["Hello there", "And now?", "Tell me more about it.", "Why?", "Thanks, bye"]
SYSTEM = "You are brief."
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe_lite"]


def _tokenizer(folder: Path, template: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = template
    return tok


def _want(ref, ids: list[int], n: int) -> list[int]:
    """transformers `generate` with its defaults (greedy, the checkpoint's generation config)."""
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def run_conversation(folder: Path, template: str, questions: list[str], system: str | None,
                     max_new: int = 6, cache_experts: int = 6) -> list[tuple[int, int]]:
    """Chat ``questions``; assert each turn equals transformers. Returns (cached, reused) per turn."""
    ref = reference_model(folder)
    tok = _tokenizer(folder, template)
    om = load_offloaded(folder, RuntimeConfig(cache_experts=cache_experts, predictor=Predictor.ROUTER),
                        StatsRecorder())
    reuse = []
    try:
        session = ChatSession(Engine(om), tok, SamplingConfig(max_new_tokens=max_new), system=system)
        for q in questions:
            ids = render(tok, session.messages(q)).ids  # the whole conversation, system included
            cached = len(session.engine.cached_ids)
            "".join(session.send(q))
            turn = session.last
            want = _want(ref, ids, max_new)
            stopped = want[-1:] and want[-1] in session.stop_ids()
            assert turn.token_ids == (want[:-1] if stopped else want), (q, turn.token_ids, want)
            assert turn.summary.new_tokens == len(want)
            assert turn.summary.prompt_tokens + turn.summary.reused_tokens == len(ids)
            reuse.append((cached, turn.summary.reused_tokens))
    finally:
        om.close()
    return reuse


@pytest.fixture
def folder_of(tiny_models, adapter_models):
    return lambda family: {**tiny_models, **adapter_models}[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_five_turns_with_diverging_rerenders_equal_transformers(folder_of, family):
    reuse = run_conversation(folder_of(family), DIVERGING_TEMPLATE, QUESTIONS, SYSTEM)
    assert reuse[0] == (0, 0)
    assert reuse[3][1] == 0 and reuse[4][1] == 0  # the leading marker came (turn 4) and went (turn 5)
    assert 0 < reuse[2][1] < reuse[2][0]  # turn 3 re-renders answer 1 shortened: a cut in the middle


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_plain_template_reuses_the_history(folder_of, family):
    reuse = run_conversation(folder_of(family), CHAT_TEMPLATE, QUESTIONS[:3], SYSTEM)
    assert all(r > 0 for _, r in reuse[1:])  # the system message and the history come from the cache


def test_template_without_system_role_prefixes_the_first_user_message(folder_of):
    folder = folder_of("qwen3_moe")
    run_conversation(folder, NO_SYSTEM_TEMPLATE, QUESTIONS[:3], SYSTEM)
    tok = _tokenizer(folder, NO_SYSTEM_TEMPLATE)
    om = load_offloaded(folder, RuntimeConfig())
    try:
        session = ChatSession(Engine(om), tok, SamplingConfig(max_new_tokens=2), system=SYSTEM)
        messages = session.messages("Hi")
        assert session.prompt_ids(messages) == render(_tokenizer(folder, CHAT_TEMPLATE), merge_system(messages)).ids
        assert session.system_merged
        assert tok.decode(session.prompt_ids(messages)).startswith(f"<|user|>{SYSTEM}\n\nHi")
    finally:
        om.close()


@pytest.mark.slow
def test_default_model_five_turns_equal_transformers(default_model):
    """The embedded default model (reused or built once, conftest.default_model), its own chat template."""
    from transformers import AutoTokenizer

    folder = default_model
    template = AutoTokenizer.from_pretrained(folder).chat_template
    questions = ["What is the capital of France?", "And of Italy?", "Name a river there.", "Thanks!", "Bye"]
    reuse = run_conversation(folder, template, questions, SYSTEM, max_new=12, cache_experts=64)
    assert all(r > 0 for _, r in reuse[1:])
