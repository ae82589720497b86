"""ChatSession: multi-turn history rendered with the tokenizer's chat template, streamed text.

The engine knows only token ids; this layer owns text: the chat template, incremental
detokenisation (never emitting half a UTF-8 character), and the conversation history.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from moespec.config import SamplingConfig
from moespec.errors import PromptError
from moespec.runtime.engine import Engine
from moespec.runtime.stats import Summary, summarize


@dataclass
class Turn:
    """One finished answer: its text, token ids and statistics."""

    text: str
    token_ids: list[int]
    summary: Summary


@dataclass
class ChatSession:
    """A conversation through the offloading runtime.

    Args:
        engine: the token-id engine.
        tokenizer: a transformers tokenizer with a chat template.
        sampling: sampling settings (the seed advances per turn so turns differ but stay reproducible).
        system: optional system prompt.
    """

    engine: Engine
    tokenizer: object
    sampling: SamplingConfig
    system: str | None = None
    history: list[dict] = field(default_factory=list)
    last: Turn | None = None

    def reset(self) -> None:
        """Forget the history and the KV cache."""
        self.history.clear()
        self.engine.reset()
        self.last = None

    def stop_ids(self) -> set[int]:
        """End-of-turn token ids (tokenizer eos + generation_config eos)."""
        ids = set()
        eos = self.tokenizer.eos_token_id
        if eos is not None:
            ids.add(int(eos))
        gen_eos = getattr(getattr(self.engine.om.model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
        return ids

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template plus the assistant prefix."""
        if getattr(self.tokenizer, "chat_template", None):
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return list(ids)
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
        return self.tokenizer(text)["input_ids"]

    def send(self, text: str) -> Iterator[str]:
        """Stream the answer to ``text`` as text pieces; afterwards ``self.last`` holds the Turn.

        Raises:
            PromptError: empty text, or a conversation longer than the model's context.
        """
        if not text.strip():
            raise PromptError("the prompt is empty", "type some text (or pass --prompt TEXT)")
        messages = ([{"role": "system", "content": self.system}] if self.system and not self.history else [])
        messages = messages + self.history + [{"role": "user", "content": text}]
        ids = self.prompt_ids(messages)
        om = self.engine.om
        om.recorder.reset()
        sampling = SamplingConfig(self.sampling.max_new_tokens, self.sampling.temperature,
                                  self.sampling.top_p, self.sampling.seed + len(self.history) // 2)
        stops = self.stop_ids()
        new: list[int] = []
        shown = ""
        for tok in self.engine.generate(ids, sampling, stops):
            if tok in stops:
                break
            new.append(tok)
            full = self.tokenizer.decode(new, skip_special_tokens=True)
            if full.endswith("\ufffd"):
                continue  # an incomplete UTF-8 sequence: wait for the next token
            yield full[len(shown):]
            shown = full
        answer = self.tokenizer.decode(new, skip_special_tokens=True)
        if len(answer) > len(shown):
            yield answer[len(shown):]
        self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        self.last = Turn(answer, new, summarize(om.recorder.steps))
