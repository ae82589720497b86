"""Request bodies of the OpenAI-compatible endpoints (pydantic), with OpenAI's ranges.

Every field OpenAI documents for the endpoint is known here; one it does not document gets 400
("unrecognized field"), as OpenAI answers. Numbers are strict (a string "10" or ``true`` is not a
number) and finite; each range below is OpenAI's (moespec's own bounds, ``--max-n`` and the
context length, are checked by the app). Fields moespec cannot honour (audio output, predicted
outputs, web search, stored completions, ...) are refused by ``unsupported`` when set, never
silently ignored; pure metadata (``user``, ``metadata``, ``safety_identifier``) is accepted.

Body-level checks that pydantic cannot make (nesting depth, lone surrogates, JSON errors) are in
body.py; message content in messages.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr


def _num(lo: float, hi: float) -> Any:
    return Annotated[float, Field(ge=lo, le=hi, strict=True, allow_inf_nan=False)]


def _int(lo: int, hi: int) -> Any:
    return Annotated[int, Field(ge=lo, le=hi, strict=True)]


INT32_MAX = 2**31 - 1
Temperature = _num(0, 2)
TopP = _num(0, 1)
Penalty = _num(-2, 2)
Bias = _num(-100, 100)
MaxTokens = _int(1, INT32_MAX)  # also at most the model's context (app.py)
Seed = _int(-2**63, 2**63 - 1)
Choices = _int(1, 128)  # also at most --max-n (app.py)
TopLogprobs = _int(0, 20)
CompletionLogprobs = _int(0, 5)
Stop = Union[StrictStr, Annotated[list[StrictStr], Field(max_length=4)], None]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    """``stream_options``: include a last chunk with ``usage``."""

    include_usage: StrictBool = False
    include_obfuscation: Optional[StrictBool] = None  # padding against side channels: nothing to pad here


class FunctionDef(_Body):
    """A tool's function: name (OpenAI's pattern), description, JSON-schema parameters."""

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class Tool(_Body):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDef


class _Name(_Body):
    name: StrictStr


class NamedToolChoice(_Body):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: _Name


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchemaSpec(_Body):
    """``response_format.json_schema``: the schema (``strict``: only its properties, all of them required)."""

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Optional[StrictStr] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[StrictBool] = None


class JsonSchemaFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]


class ToolCallFunction(_Body):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    """A tool call of an earlier assistant message."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    """One message. Which fields a role may carry is checked in messages.py (OpenAI's per-role shapes)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[StrictStr, list[_Open], None] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[StrictStr] = None
    refusal: Optional[StrictStr] = None
    function_call: Optional[dict[str, Any]] = None  # legacy; refused in messages.py
    audio: Optional[dict[str, Any]] = None  # refused in messages.py
    annotations: Optional[list[Any]] = None  # in OpenAI's answers, so clients send it back; not rendered
    reasoning_content: Optional[StrictStr] = None  # moespec's answers carry it; not rendered


class SamplingFields(_Body):
    """What both endpoints share: model, length, sampling, penalties, stop strings, streaming, n."""

    model: StrictStr
    max_tokens: Optional[MaxTokens] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    seed: Optional[Seed] = None
    n: Optional[Choices] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    logit_bias: Optional[dict[str, Bias]] = None
    stop: Stop = None
    stream: Optional[StrictBool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple of non-empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)

    def token_limit(self) -> Optional[int]:
        """The most new tokens asked for (None: the server's default)."""
        return self.max_tokens

    def choices(self) -> int:
        """Generations per prompt."""
        return self.n or 1

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, what it asks for) of every set field the server cannot honour."""
        return []


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[MaxTokens] = None
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[TopLogprobs] = None
    tools: Optional[Annotated[list[Tool], Field(max_length=128)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    functions: Optional[list[FunctionDef]] = None  # legacy spelling of tools
    function_call: Union[Literal["none", "auto"], _Name, None] = None  # legacy spelling of tool_choice
    response_format: Optional[ResponseFormat] = None
    metadata: Optional[dict[str, StrictStr]] = None
    safety_identifier: Optional[StrictStr] = None
    prompt_cache_key: Optional[StrictStr] = None
    store: Optional[StrictBool] = None
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority"]] = None
    modalities: Optional[list[StrictStr]] = None
    audio: Optional[dict[str, Any]] = None
    prediction: Optional[dict[str, Any]] = None
    web_search_options: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[StrictStr] = None
    verbosity: Optional[StrictStr] = None

    def token_limit(self) -> Optional[int]:
        """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    def unsupported(self) -> list[tuple[str, str]]:
        """Set fields the server cannot honour (module docstring)."""
        out = []
        if self.store:
            out.append(("store", "stored completions"))
        if self.service_tier in ("flex", "scale", "priority"):
            out.append(("service_tier", f"service tier {self.service_tier!r}"))
        if self.modalities is not None and self.modalities != ["text"]:
            out.append(("modalities", "output other than text"))
        for name, what in (("audio", "audio output"), ("prediction", "predicted outputs"),
                           ("web_search_options", "web search"), ("reasoning_effort", "a reasoning effort"),
                           ("verbosity", "a verbosity level")):
            if getattr(self, name) is not None:
                out.append((name, what))
        if self.functions is not None and self.tools is not None:
            out.append(("functions", "both functions and tools (send tools only)"))
        return out


class CompletionRequest(SamplingFields):
    """POST /v1/completions: one prompt or several (strings or token-id lists)."""

    prompt: Union[StrictStr, Annotated[list[StrictStr], Field(min_length=1)],
                  Annotated[list[Annotated[int, Field(strict=True)]], Field(min_length=1)],
                  Annotated[list[Annotated[list[Annotated[int, Field(strict=True)]], Field(min_length=1)]],
                            Field(min_length=1)]]
    logprobs: Optional[CompletionLogprobs] = None
    echo: Optional[StrictBool] = None
    best_of: Optional[_int(1, 20)] = None
    suffix: Optional[StrictStr] = None

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts, one per entry of a list-valued ``prompt``."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def unsupported(self) -> list[tuple[str, str]]:
        """Set fields the server cannot honour."""
        out = []
        if self.best_of is not None and self.best_of != self.choices():
            out.append(("best_of", "best_of other than n (ranking candidates by likelihood)"))
        if self.suffix:
            out.append(("suffix", "a suffix (insertion)"))
        if self.echo and self.logprobs is not None:
            out.append(("echo", "echo together with logprobs (prompt logprobs)"))
        return out
