"""Response bodies and server-sent-event chunks of the two generation endpoints.

Chat answers are ``chat.completion`` objects (streamed as ``chat.completion.chunk``: a first
chunk per choice with the role, one per delta, one per choice with its ``finish_reason``,
optionally one with ``usage``); raw completions are ``text_completion`` objects. A stream ends
with ``data: [DONE]``. Logprobs follow OpenAI's two shapes: chat's ``logprobs.content`` list of
{token, logprob, bytes, top_logprobs}, completions' parallel lists (tokens, token_logprobs,
top_logprobs, text_offset). A choice's tool calls are a message's ``tool_calls`` (content null
when nothing else was said) and, streamed, one ``delta.tool_calls`` entry per call.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable, Optional

from moespec.sampling.logprobs import TokenLogprob
from moespec.serve.generate import Delta, Outcome

DONE = "data: [DONE]\n\n"
TokenText = Callable[[int], tuple[str, list[int]]]


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(outs: list[Outcome], n: int) -> dict:
    """OpenAI's usage object: each prompt counted once (not once per choice), every choice's tokens.

    cached_tokens: prompt tokens whose KV was reused, on each prompt's first choice.
    """
    firsts = [o for o in outs if o.index % n == 0]
    prompt = sum(o.prompt_tokens for o in firsts)
    completion = sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in firsts)}}


class ResponseFormat:
    """Builds the bodies of one request (one id and creation time for all of its chunks).

    Args:
        model: the served model id.
        chat: True for /v1/chat/completions, False for /v1/completions.
        token_text: token id -> (text, bytes), for logprobs.
        n: choices per prompt.
    """

    def __init__(self, model: str, chat: bool, token_text: Optional[TokenText] = None, n: int = 1) -> None:
        self.model = model
        self.chat = chat
        self.n = n
        self.token_text = token_text
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._calls: dict[int, int] = {}  # choice -> tool calls streamed so far
        self._offset: dict[int, int] = {}  # choice -> characters streamed so far (completions' text_offset)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _entry(self, t: int, lp: float) -> dict:
        token, raw = self.token_text(t)
        return {"token": token, "logprob": lp, "bytes": raw}

    def chat_logprobs(self, lps: Optional[list[TokenLogprob]]) -> Optional[dict]:
        """Chat's ``logprobs`` object (None when none were asked)."""
        if lps is None:
            return None
        content = [{**self._entry(x.token_id, x.logprob), "top_logprobs": [self._entry(t, v) for t, v in x.top]}
                   for x in lps]
        return {"content": content, "refusal": None}

    def text_logprobs(self, lps: Optional[list[TokenLogprob]], offset: int) -> Optional[dict]:
        """Completions' ``logprobs`` object; ``offset``: characters before the first token."""
        if lps is None:
            return None
        tokens, offsets = [], []
        for x in lps:
            offsets.append(offset)
            token, raw = self.token_text(x.token_id)
            tokens.append(token)
            offset += len(bytes(raw).decode("utf-8", "ignore"))  # part of a character: no character yet
        return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps], "text_offset": offsets,
                "top_logprobs": [{self.token_text(t)[0]: v for t, v in x.top} for x in lps]}

    def full(self, outs: list[Outcome]) -> dict:
        """The non-streamed answer with every choice."""
        choices = []
        for o in outs:
            if self.chat:
                msg: dict = {"role": "assistant", "content": o.text if o.text.strip() or not o.tool_calls else None}
                if o.tool_calls:
                    msg["tool_calls"] = o.tool_calls
                if o.reasoning:
                    msg["reasoning_content"] = o.reasoning
                choices.append({"index": o.index, "message": msg, "finish_reason": o.finish_reason,
                                "logprobs": self.chat_logprobs(o.logprobs)})
            else:
                choices.append({"index": o.index, "text": o.text, "finish_reason": o.finish_reason,
                                "logprobs": self.text_logprobs(o.logprobs, o.echo_chars)})
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": usage(outs, self.n)}

    def _chunk(self, choices: list[dict], extra: dict | None = None) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(obj), "choices": choices, **(extra or {})})

    def first(self, indices: range) -> str:
        """The opening chunks (chat: the assistant role of each choice), or ""."""
        if not self.chat:
            return ""
        return "".join(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]) for i in indices)

    def piece(self, d: Delta) -> str:
        """A chunk carrying one Delta."""
        if not self.chat:
            offset = self._offset.get(d.index, 0)
            self._offset[d.index] = offset + len(d.text)
            lps = self.text_logprobs(list(d.logprobs), offset) if d.logprobs else None
            return self._chunk([{"index": d.index, "text": d.text, "logprobs": lps, "finish_reason": None}])
        delta: dict = {}
        if d.text:
            delta["content"] = d.text
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.tool_calls:
            first = self._calls.get(d.index, 0)
            self._calls[d.index] = first + len(d.tool_calls)
            delta["tool_calls"] = [{"index": first + k, **call} for k, call in enumerate(d.tool_calls)]
        lps = self.chat_logprobs(list(d.logprobs)) if d.logprobs else None
        return self._chunk([{"index": d.index, "delta": delta, "logprobs": lps, "finish_reason": None}])

    def last(self, out: Outcome) -> str:
        """The chunk with a choice's finish reason."""
        if self.chat:
            return self._chunk([{"index": out.index, "delta": {}, "logprobs": None,
                                 "finish_reason": out.finish_reason}])
        return self._chunk([{"index": out.index, "text": "", "finish_reason": out.finish_reason, "logprobs": None}])

    def usage_chunk(self, outs: list[Outcome]) -> str:
        """The chunk with ``usage`` (stream_options.include_usage) and no choices."""
        return self._chunk([], {"usage": usage(outs, self.n)})
