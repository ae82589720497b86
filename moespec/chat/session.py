"""ChatSession: multi-turn history rendered with the tokenizer's chat template, streamed text.

The engine knows only token ids; this layer owns text: the chat template (moespec/chat/render.py),
incremental detokenisation (never emitting half a UTF-8 character), and the conversation history.

Every turn renders the whole conversation again: the system message (``--system``) first, then
every earlier question and answer, then the new question. The engine reuses the KV cache as far
as the new ids equal the cached ones, so a re-render that differs (an answer that re-tokenises
differently, a template that drops earlier content) costs a partial prefill, never a wrong answer.

An answer interrupted (Ctrl-C) after some tokens stays in the history as far as it was shown; an
answer interrupted before its first token is dropped together with its question.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

from moespec.chat.detok import IncrementalDecoder
from moespec.chat.render import Rendered, render, stop_ids
from moespec.config import SamplingConfig
from moespec.errors import PromptError
from moespec.runtime.disk_tier import disk_numbers
from moespec.runtime.engine import Engine
from moespec.runtime.stats import Summary, summarize


@dataclass
class Turn:
    """One answer: its text, generated token ids (without the stop id) and statistics.

    interrupted: the answer was cut short (Ctrl-C or an error) before its end.
    """

    text: str
    token_ids: list[int]
    summary: Summary
    interrupted: bool = False


@dataclass
class ChatSession:
    """A conversation through the offloading runtime.

    Args:
        engine: the token-id engine.
        tokenizer: a transformers tokenizer (a chat template, or plain "role: text" lines without one).
        sampling: sampling settings (the seed advances per turn so turns differ but stay reproducible).
        system: optional system prompt, rendered first on every turn.
    """

    engine: Engine
    tokenizer: object
    sampling: SamplingConfig
    system: str | None = None
    history: list[dict] = field(default_factory=list)
    last: Turn | None = None
    system_merged: bool = False  # the template has no system role: render.py's fallback is in use
    _stops: set[int] | None = field(default=None, init=False, repr=False)

    def reset(self) -> None:
        """Forget the history and the KV cache."""
        self.history.clear()
        self.engine.reset()
        self.last = None

    def stop_ids(self) -> set[int]:
        """End-of-answer ids: generation_config.json's, config.json's and the tokenizer's eos (render.stop_ids)."""
        if self._stops is None:
            om = self.engine.om
            self._stops = stop_ids(om.path, om.config, self.tokenizer)
        return self._stops

    def messages(self, text: str) -> list[dict]:
        """The conversation to render for a new question ``text``: system, history, question."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history + [{"role": "user", "content": text}]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template plus the assistant prefix.

        Raises:
            ChatTemplateError: the template fails (render.render).
        """
        rendered: Rendered = render(self.tokenizer, messages)
        self.system_merged = rendered.system_merged
        return rendered.ids

    def send(self, text: str) -> Iterator[str]:
        """Stream the answer to ``text`` as text pieces; afterwards ``self.last`` holds the Turn.

        Raises:
            PromptError: empty text, or a conversation longer than the model's context.
            ChatTemplateError: the chat template fails on this conversation.
        """
        self.last = None
        if not text.strip():
            raise PromptError("the prompt is empty", "type some text (or pass --prompt TEXT)")
        ids = self.prompt_ids(self.messages(text))
        self.engine.check_prompt(ids)
        om = self.engine.om
        om.recorder.reset()
        sampling = SamplingConfig(self.sampling.max_new_tokens, self.sampling.temperature,
                                  self.sampling.top_p, self.sampling.seed + len(self.history) // 2)
        stops = self.stop_ids()
        decoder = IncrementalDecoder(self.tokenizer)  # holds back an incomplete UTF-8 character
        try:
            for tok in self.engine.generate(ids, sampling, stops):
                if tok in stops:
                    break
                piece = decoder.push(tok)  # decoder.shown is set before yielding: the caller may stop here
                if piece:
                    yield piece
        except BaseException:  # Ctrl-C (also GeneratorExit when the caller stops reading)
            self._record(text, decoder.ids, decoder.shown, interrupted=True)
            raise
        answer = self._record(text, decoder.ids, decoder.shown, interrupted=False)
        if len(answer) > len(decoder.shown):
            yield answer[len(decoder.shown):]

    def _record(self, text: str, new: list[int], shown: str, interrupted: bool) -> str:
        """Add the turn to the history (module docstring says what an interrupted one keeps)."""
        answer = shown if interrupted else self.tokenizer.decode(new, skip_special_tokens=True)
        if not interrupted or answer:
            self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        summary = summarize(self.engine.om.recorder.steps)
        summary = replace(summary, disk=disk_numbers(summary, self.engine.om.cache))  # None unless on disk
        self.last = Turn(answer, list(new), summary, interrupted)
        return answer
