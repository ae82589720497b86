"""Response bodies and server-sent-event chunks of the two generation endpoints.

Chat answers are ``chat.completion`` objects (streamed as ``chat.completion.chunk``: a first
chunk with the role, one per text piece, a last one with ``finish_reason``, optionally one
with ``usage``); raw completions are ``text_completion`` objects. A stream ends with
``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid

from moespec.serve.backend import Outcome

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(out: Outcome) -> dict:
    """OpenAI's usage object (cached_tokens: prompt tokens whose KV was reused)."""
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


class ResponseFormat:
    """Builds the bodies of one request (one id and creation time for all of its chunks).

    Args:
        model: the served model id.
        chat: True for /v1/chat/completions, False for /v1/completions.
    """

    def __init__(self, model: str, chat: bool) -> None:
        self.model = model
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, out: Outcome) -> dict:
        """The non-streamed answer."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "finish_reason": out.finish_reason, "logprobs": None}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage(out)}
        choice = {"index": 0, "text": out.text, "finish_reason": out.finish_reason, "logprobs": None}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage(out)}

    def _chunk(self, choices: list[dict], extra: dict | None = None) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(obj), "choices": choices, **(extra or {})})

    def first(self) -> str | None:
        """The opening chunk (chat: the assistant role), or None."""
        if not self.chat:
            return None
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])

    def piece(self, text: str) -> str:
        """A chunk carrying ``text``."""
        if self.chat:
            return self._chunk([{"index": 0, "delta": {"content": text}, "finish_reason": None}])
        return self._chunk([{"index": 0, "text": text, "finish_reason": None, "logprobs": None}])

    def last(self, out: Outcome) -> str:
        """The chunk with the finish reason."""
        if self.chat:
            return self._chunk([{"index": 0, "delta": {}, "finish_reason": out.finish_reason}])
        return self._chunk([{"index": 0, "text": "", "finish_reason": out.finish_reason, "logprobs": None}])

    def usage_chunk(self, out: Outcome) -> str:
        """The chunk with ``usage`` (stream_options.include_usage) and no choices."""
        return self._chunk([], {"usage": usage(out)})
