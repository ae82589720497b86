"""The model side of the server: messages -> token ids, and a request's choices as events.

Rendering and stop ids come from ChatSession (the chat template, generation_config's end-of-turn
ids), detokenisation from IncrementalDecoder, so the server's text equals `moespec chat`'s for
the same prompt and settings. ``generate`` runs on the queue's worker thread only (the Engine
is not thread-safe); tokenizer calls take a lock because fast tokenizers may not be used from
two threads at once. Grammars (structured output, forced tool calls) compile through one
GrammarCompiler per model, cached per grammar.
"""

from __future__ import annotations

import threading

from moespec.chat.open_model import OpenedModel
from moespec.chat.render import render
from moespec.chat.session import ChatSession
from moespec.config import SamplingConfig
from moespec.errors import ChatTemplateError
from moespec.sampling.grammar import GrammarCompiler
from moespec.serve.errors import ApiError
from moespec.serve.generate import ChoiceSpec, FinishReason, Outcome, run_choice  # noqa: F401 (re-exported)
from moespec.serve.queue import Job
from moespec.serve.tools import ToolSupport


class ModelBackend:
    """One opened model, served under ``name``.

    Args:
        opened: the model (engine + tokenizer).
        name: the model id clients must ask for.
    """

    def __init__(self, opened: OpenedModel, name: str) -> None:
        self.opened = opened
        self.engine = opened.engine
        self.tokenizer = opened.tokenizer
        self.name = name
        self._session = ChatSession(opened.engine, opened.tokenizer, SamplingConfig())
        self._tok_lock = threading.Lock()
        self.stop_ids = frozenset(self._session.stop_ids())
        self.vocab_size = int(self.engine.om.config.get_text_config().vocab_size)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, set(self.stop_ids))
        self.tools = ToolSupport(self.tokenizer, str(getattr(self.engine.om.config, "model_type", "")),
                                 self._render_text)

    def context_tokens(self) -> int:
        """The model's context length in tokens."""
        return self.engine.om.max_context()

    def _render_text(self, messages: list[dict], tools: list[dict]) -> str:
        with self._tok_lock:
            return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False)

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` (and ``tools``) through the chat template (+ the assistant prefix).

        Raises:
            ApiError: 400 when the chat template refuses the messages (e.g. roles out of order).
        """
        try:
            with self._tok_lock:
                return render(self.tokenizer, messages, tools).ids
        except ChatTemplateError as exc:
            raise ApiError(400, f"the model's chat template refused the messages: {exc.message}",
                           param="messages") from None

    def text_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """Token ids of a raw prompt (a string, or ids checked against the vocabulary).

        Raises:
            ApiError: 400 for a token id outside the vocabulary.
        """
        if isinstance(prompt, list):
            vocab = len(self.tokenizer)
            bad = [i for i in prompt if not 0 <= i < vocab]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param=param)
            return list(prompt)
        with self._tok_lock:
            return list(self.tokenizer(prompt)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (special tokens dropped), as `moespec chat` shows it."""
        with self._tok_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """OpenAI's (token, bytes) of one token: its UTF-8 text, or "bytes:\\xNN..." for part of a character."""
        raw = self.grammars.token_bytes(token_id)
        try:
            return raw.decode("utf-8"), list(raw)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)

    def check(self, ids: list[int], param: str) -> None:
        """Refuse an empty prompt or one that does not fit the context.

        Raises:
            ApiError: 400, naming the prompt's length and the context limit.
        """
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param)
        limit = self.context_tokens()
        if len(ids) >= limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {limit} tokens "
                                f"(prompt + answer must fit)", param=param, code="context_length_exceeded")

    def generate(self, job: Job, specs: list[ChoiceSpec]) -> list[Outcome]:
        """Generate every choice of ``specs`` in order on this (worker) thread.

        Emits ("delta", Delta) while a choice runs and ("choice", Outcome) when it ends; stops
        early once ``job.cancelled`` is set.
        """
        outcomes = []
        for spec in specs:
            if job.cancelled.is_set():
                break

            def count() -> None:
                job.tokens += 1

            out = run_choice(self.engine, self.tokenizer, self._tok_lock, self.stop_ids, spec, job.cancelled,
                             lambda d: job.emit("delta", d), count)
            job.tokens_at_stop = job.tokens
            outcomes.append(out)
            job.emit("choice", out)
            if out.finish_reason == FinishReason.CANCELLED:
                break
        return outcomes
