"""Request bodies of the OpenAI-compatible endpoints (pydantic), parsed into ApiErrors on failure.

Fields moespec does not use (``user``, ``logit_bias``, ...) are accepted and ignored, as OpenAI
clients send some by default; fields it cannot honour (``n`` > 1) are refused with 400.
"""

from __future__ import annotations

import json
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moespec.serve.errors import ApiError


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    """One part of a list-valued message content; only text parts are supported."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One message: role and text content ("developer" is treated as "system")."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Body):
    """``stream_options``: include a last chunk with ``usage``."""

    include_usage: bool = False


class SamplingFields(_Body):
    """What both endpoints share: model, length, sampling, stop strings, streaming."""

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=1)

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple of non-empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)

    def token_limit(self) -> Optional[int]:
        """The most new tokens asked for (None: the server's default)."""
        return self.max_tokens


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)

    def token_limit(self) -> Optional[int]:
        """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    def rendered_messages(self) -> list[dict]:
        """Messages as the chat template expects them (role, content string)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a raw prompt (a string, or a list of token ids)."""

    prompt: Union[str, list[int]]


def parse_body(raw: bytes, kind: type[SamplingFields]) -> SamplingFields:
    """Parse and validate a request body.

    Raises:
        ApiError: 400 for malformed JSON or an invalid field (names the field and the rule).
    """
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "missing":
            message = f"'{param}' is a required field"
        elif param == "n":
            message = "only n=1 is supported (one generation at a time)"
        else:
            message = f"'{param}': {first['msg']} (got {first.get('input')!r})"
        raise ApiError(400, message, param=param, code="invalid_value") from None
