"""One choice of a request, generated on the worker thread: tokens -> text, logprobs, tool calls.

A request asks for one or more choices (``n``, a list-valued ``prompt``); the worker runs them
one after the other, so every choice after the first reuses the prompt's KV prefix. Each choice
emits ``Delta`` events while it runs and ends with an ``Outcome``.

Text passes the stop strings first, then (when tools are parsed) transformers' response parser
(tools.CallStream); logprobs recorded by the TokenControls ride on the next delta, so the
streamed deltas concatenate to exactly the non-streamed choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from moespec.chat.detok import IncrementalDecoder
from moespec.config import SamplingConfig
from moespec.runtime.stats import StepStats
from moespec.sampling.controls import TokenControls
from moespec.sampling.logprobs import TokenLogprob
from moespec.serve.stops import StopMatcher


class FinishReason:
    """OpenAI's finish_reason values (plus "cancelled", never sent: nobody listens)."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class ChoiceSpec:
    """What the worker needs for one choice.

    Attributes:
        index: the choice's index in the answer.
        ids: prompt token ids.
        sampling: length, temperature, top-p, seed.
        stops: stop strings.
        controls: builds this choice's TokenControls (None: the Engine gets no processor).
        tool_parser: builds this choice's tools.CallStream (None: the text is the answer).
        echo: text answered before the generated text (completions' ``echo``).
    """

    index: int
    ids: list[int]
    sampling: SamplingConfig
    stops: tuple[str, ...] = ()
    controls: Optional[Callable[[], TokenControls]] = None
    tool_parser: Optional[Callable[[], object]] = None
    echo: str = ""


@dataclass(frozen=True)
class Delta:
    """New output of choice ``index``: text, reasoning text, finished tool calls, logprobs."""

    index: int
    text: str = ""
    reasoning: str = ""
    tool_calls: tuple[dict, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.text or self.reasoning or self.tool_calls or self.logprobs)


@dataclass
class Outcome:
    """A finished choice.

    Attributes:
        index: the choice's index.
        text: the answer's content (stop string excluded; tool-call markup excluded when parsed).
        reasoning: text the model's format marks as reasoning ("" when none).
        tool_calls: OpenAI tool-call dicts (empty: none).
        logprobs: per generated token (None: not asked).
        prompt_tokens: tokens of the prompt; cached_tokens of them reused from the KV cache.
        completion_tokens: tokens generated (end-of-turn token excluded).
        finish_reason: "stop", "length", "tool_calls" or "cancelled".
        first_token_s: perf_counter seconds when the first token was ready (None: none came).
        steps: the recorder's steps of this choice (prefill + decode), for /metrics.
    """

    index: int
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    first_token_s: Optional[float] = None
    steps: tuple[StepStats, ...] = ()
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprob]] = None
    echo_chars: int = 0  # characters of echoed prompt at the start of ``text``


class _Output:
    """Collects a choice's deltas (what the stream sends) into its Outcome's fields."""

    def __init__(self, spec: ChoiceSpec, emit: Callable[[Delta], None], controls: Optional[TokenControls]) -> None:
        self.spec, self._emit, self.controls = spec, emit, controls
        self.parser = spec.tool_parser() if spec.tool_parser else None
        self.text, self.reasoning, self.calls = [], [], []
        self._sent_lp = 0

    def push(self, raw: str, final: bool = False) -> None:
        text, reasoning, calls = raw, "", []
        if self.parser is not None:
            text, reasoning, calls = self.parser.feed(raw) if raw else ("", "", [])
            if final:
                t, r, c = self.parser.finish()
                text, reasoning, calls = text + t, reasoning + r, calls + c
                if self.parser.failed:  # a call that does not parse: the whole raw text is the answer
                    shown = "".join(self.text) + text
                    text += self.parser.raw[len(shown):] if self.parser.raw.startswith(shown) else ""
                    calls = []
        lps = ()
        if self.controls is not None and self.controls.top_logprobs is not None:
            lps = tuple(self.controls.logprobs[self._sent_lp:])
            if not (text or reasoning or calls or final):
                lps = ()  # logprobs travel with the text they produced
        self._sent_lp += len(lps)
        delta = Delta(self.spec.index, text, reasoning, tuple(calls), lps)
        self.text.append(text)
        self.reasoning.append(reasoning)
        self.calls += calls
        if delta:
            self._emit(delta)


def run_choice(engine, tokenizer, tok_lock, stop_ids: frozenset, spec: ChoiceSpec, cancelled,
               emit: Callable[[Delta], None], count: Callable[[], None]) -> Outcome:
    """Generate ``spec`` on this (worker) thread, emitting Deltas; returns its Outcome.

    Stops at an end-of-turn token, a stop string, ``max_new_tokens``, the context end, or
    between tokens once ``cancelled`` (a threading.Event) is set; then drops the prefetches left
    behind. ``count`` is called once per generated token (the queue's progress counter).
    """
    om = engine.om
    om.recorder.reset()
    controls = spec.controls() if spec.controls else None
    out = _Output(spec, emit, controls)
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=out.parser is None)
    stopper = StopMatcher(spec.stops)
    finish, first_s, matched, n = FinishReason.LENGTH, None, False, 0
    if spec.echo:
        out.push(spec.echo)
    processor = controls if controls is not None and controls.active else None
    tokens = engine.generate(spec.ids, spec.sampling, stop_ids, processor)
    try:
        for tok in tokens:
            if first_s is None:
                first_s = time.perf_counter()
            if cancelled.is_set():
                finish = FinishReason.CANCELLED
                break
            if tok in stop_ids:
                finish = FinishReason.STOP
                break
            if controls is not None:
                controls.accept(tok)
            n += 1
            count()
            with tok_lock:
                piece = decoder.push(tok)
            text, matched = stopper.push(piece)
            out.push(text)
            if matched:
                finish = FinishReason.STOP
                break
    finally:
        tokens.close()
        om.drop_prefetches()
    tail = ""
    if finish != FinishReason.CANCELLED and not matched:
        with tok_lock:
            tail, matched = stopper.push(decoder.flush())
        if not matched:
            tail += stopper.flush()
    out.push(tail, final=True)
    if out.calls and finish == FinishReason.STOP:
        finish = FinishReason.TOOL_CALLS
    steps = tuple(om.recorder.steps)
    prefilled = sum(s.tokens for s in steps if s.kind == "prefill")
    logprobs = list(controls.logprobs) if controls is not None and controls.top_logprobs is not None else None
    return Outcome(spec.index, "".join(out.text), len(spec.ids), len(spec.ids) - prefilled, n, finish, first_s,
                   steps, "".join(out.reasoning), out.calls, logprobs, len(spec.echo))
