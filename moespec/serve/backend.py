"""The model side of the server: messages -> token ids, and one generation as text events.

Rendering and stop ids come from ChatSession (the chat template, generation_config's end-of-turn
ids), detokenisation from IncrementalDecoder, so the server's text equals `moespec chat`'s for
the same prompt and settings. ``generate`` runs on the queue's worker thread only (the Engine
is not thread-safe); tokenizer calls take a lock because fast tokenizers may not be used from
two threads at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from moespec.chat.detok import IncrementalDecoder
from moespec.chat.open_model import OpenedModel
from moespec.chat.session import ChatSession
from moespec.config import SamplingConfig
from moespec.runtime.stats import StepStats
from moespec.serve.errors import ApiError
from moespec.serve.queue import Job
from moespec.serve.stops import StopMatcher


class FinishReason:
    """OpenAI's finish_reason values (plus "cancelled", never sent: nobody listens)."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class GenerationRequest:
    """What the worker needs: prompt ids, sampling, stop strings."""

    ids: list[int]
    sampling: SamplingConfig
    stops: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """A finished generation.

    Attributes:
        text: the whole answer (stop string excluded).
        prompt_tokens: tokens of the prompt; cached_tokens of them reused from the KV cache.
        completion_tokens: tokens generated (end-of-turn token excluded).
        finish_reason: "stop", "length" or "cancelled".
        first_token_s: perf_counter seconds when the first token was ready (None: none came).
        steps: the recorder's steps of this generation (prefill + decode), for /metrics.
    """

    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    first_token_s: float | None
    steps: tuple[StepStats, ...]


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

    def context_tokens(self) -> int:
        """The model's context length in tokens."""
        return self.engine.om.max_context()

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` through the chat template (+ the assistant prefix).

        Raises:
            ApiError: 400 when the chat template refuses the messages (e.g. roles out of order).
        """
        from jinja2 import TemplateError

        try:
            with self._tok_lock:
                return self._session.prompt_ids(messages)
        except TemplateError as exc:
            raise ApiError(400, f"the model's chat template refused the messages: {exc}", param="messages") from None

    def text_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a raw prompt (a string, or ids checked against the vocabulary).

        Raises:
            ApiError: 400 for a token id outside the vocabulary.
        """
        if isinstance(prompt, list):
            vocab = len(self.tokenizer)
            bad = [i for i in prompt if not 0 <= i < vocab]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt")
            return list(prompt)
        with self._tok_lock:
            return list(self.tokenizer(prompt)["input_ids"])

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

    def generate(self, job: Job, req: GenerationRequest) -> Outcome:
        """Generate for ``req`` on this (worker) thread, emitting ("text", piece) events on ``job``.

        Stops at an end-of-turn token, a stop string, ``max_new_tokens``, the context end, or
        between tokens once ``job.cancelled`` is set; then drops the prefetches left behind.
        """
        om = self.engine.om
        om.recorder.reset()
        decoder, stopper = IncrementalDecoder(self.tokenizer), StopMatcher(req.stops)
        parts: list[str] = []
        finish, first_s, matched = FinishReason.LENGTH, None, False

        def emit(text: str) -> None:
            if text:
                parts.append(text)
                job.emit("text", text)

        tokens = self.engine.generate(req.ids, req.sampling, self.stop_ids)
        try:
            for tok in tokens:
                if first_s is None:
                    first_s = time.perf_counter()
                if job.cancelled.is_set():
                    finish = FinishReason.CANCELLED
                    break
                if tok in self.stop_ids:
                    finish = FinishReason.STOP
                    break
                job.tokens += 1
                with self._tok_lock:
                    piece = decoder.push(tok)
                text, matched = stopper.push(piece)
                emit(text)
                if matched:
                    finish = FinishReason.STOP
                    break
        finally:
            tokens.close()
            job.tokens_at_stop = job.tokens
            om.drop_prefetches()
        if finish != FinishReason.CANCELLED and not matched:
            with self._tok_lock:
                tail = decoder.flush()
            text, matched = stopper.push(tail)
            emit(text)
            if not matched:
                emit(stopper.flush())
        steps = tuple(om.recorder.steps)
        prefilled = sum(s.tokens for s in steps if s.kind == "prefill")
        return Outcome("".join(parts), len(req.ids), len(req.ids) - prefilled, job.tokens, finish, first_s, steps)
