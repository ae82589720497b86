"""Rendering a conversation into prompt token ids, and the ids that end an answer.

The tokenizer's chat template renders the whole conversation every turn (system message, every
earlier question and answer, the new question, the assistant prefix). A template is arbitrary
Jinja code from the checkpoint: any failure inside it becomes a ChatTemplateError (one line, no
traceback). Templates without a system role (they raise, e.g. "roles must alternate" or "system
role not supported") get the system text prefixed to the first user message instead, separated by
a blank line: the fallback that several of those templates apply themselves (Gemma's, for one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moespec.errors import ChatTemplateError, CheckpointError


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation.

    Attributes:
        ids: prompt token ids, ending with the assistant prefix.
        system_merged: the template has no system role; the system text went into the first user message.
    """

    ids: list[int]
    system_merged: bool = False


def _apply(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    extra = {"tools": tools} if tools else {}  # only when given: some templates test `tools is defined`
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(i) for i in ids]


def merge_system(messages: list[dict]) -> list[dict]:
    """``messages`` without the leading system message, its text prefixed to the first user message."""
    system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
    for m in rest:
        if m["role"] == "user":
            m["content"] = f"{system}\n\n{m['content']}"
            break
    return rest


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> Rendered:
    """Token ids of ``messages`` (role/content dicts) plus the assistant prefix.

    ``tools`` (OpenAI/transformers tool dicts) go to the template as its ``tools`` variable.

    Without a chat template: "role: content" lines and "assistant:".

    Raises:
        ChatTemplateError: the template fails, with and without the system-role fallback.
    """
    if not getattr(tokenizer, "chat_template", None):
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
        return Rendered(list(tokenizer(text)["input_ids"]))
    try:
        return Rendered(_apply(tokenizer, messages, tools))
    # Why so broad: the template is code from the checkpoint; whatever it raises (jinja2's
    # TemplateError, or a TypeError/KeyError inside a filter) is a template failure.
    except Exception as exc:
        first = exc
    if messages and messages[0]["role"] == "system":
        try:
            return Rendered(_apply(tokenizer, merge_system(messages), tools), system_merged=True)
        except Exception:
            pass
    raise ChatTemplateError(f"the model's chat template failed: {_one_line(first)}",
                            "check the conversation's roles, or drop --system; /reset starts over")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value if v is not None}


def stop_ids(path: Path, config, tokenizer) -> set[int]:
    """Ids that end an answer: the union of generation_config.json's ``eos_token_id`` (int or
    list), config.json's (or its text config's) and the tokenizer's eos.

    Real checkpoints (Qwen3, GPT-OSS) list their end-of-turn ids only in generation_config.json.

    Raises:
        CheckpointError: generation_config.json exists but is not valid JSON.
    """
    ids: set[int] = set()
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        try:
            ids |= _ids(json.loads(gen.read_text()).get("eos_token_id"))
        except (ValueError, AttributeError) as exc:
            raise CheckpointError(f"{gen} is not a valid generation config ({exc})",
                                  "re-download the model (`moespec download MODEL`)") from None
    ids |= _ids(getattr(config, "eos_token_id", None))
    get_text = getattr(config, "get_text_config", None)
    if get_text is not None:
        ids |= _ids(getattr(get_text(), "eos_token_id", None))
    ids |= _ids(getattr(tokenizer, "eos_token_id", None))
    return ids
