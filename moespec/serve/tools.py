"""Tool calling: rendering ``tools``, forcing a call (tool_choice), parsing calls out of the answer.

The tools go to the chat template as ``apply_chat_template(..., tools=...)`` (OpenAI's tool
dicts are transformers' documented shape). Whether a template supports tools is asked once by
rendering a probe tool: a template that ignores ``tools`` gets 400 naming that. ``tool_choice``
"required" or a named function constrains decoding to the family's call syntax (tool_formats);
"auto" lets the model choose; "none" renders the tools but parses nothing. The answer is parsed
with transformers' ResponseParser, streamed: text regions become ``delta.content`` at once, each
call becomes one ``delta.tool_calls`` entry when it closes, so a streamed answer carries the same
calls as a non-streamed one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Optional

from moespec.serve.errors import ApiError
from moespec.serve.schemas import ChatCompletionRequest, NamedToolChoice
from moespec.serve.tool_formats import ToolFormat, call_grammar, detect

_PROBE = "moespec_probe_tool"


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools.

    Attributes:
        tools: OpenAI tool dicts for the chat template (None: no tools).
        parse: parse tool calls out of the answer (tools given and tool_choice is not "none").
        forced: the function names a call must use (tool_choice "required": all; named: one);
            empty when the model chooses.
        parallel: several calls may be made (parallel_tool_calls).
    """

    tools: Optional[list[dict]] = None
    parse: bool = False
    forced: tuple[str, ...] = ()
    parallel: bool = True


def plan(body: ChatCompletionRequest) -> ToolPlan:
    """The ToolPlan of ``body`` (the legacy functions/function_call become tools/tool_choice).

    Raises:
        ApiError: 400 for a tool_choice without tools or naming a function not in ``tools``.
    """
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if body.functions:
        tools = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in body.functions]
        fc = body.function_call
        choice = fc if isinstance(fc, str) or fc is None else NamedToolChoice(type="function", function=fc)
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice not in ("none", "auto"):
            raise ApiError(400, "'tool_choice' needs 'tools': no tools were given", param="tool_choice",
                           code="invalid_value")
        return ToolPlan()
    names = tuple(t["function"]["name"] for t in tools)
    if len(set(names)) != len(names):
        raise ApiError(400, "'tools': two functions have the same name", param="tools", code="invalid_value")
    parallel = body.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan(tools, parse=False, parallel=parallel)
    if choice == "auto":
        return ToolPlan(tools, parse=True, parallel=parallel)
    if choice == "required":
        return ToolPlan(tools, parse=True, forced=names, parallel=parallel)
    name = choice.function.name
    if name not in names:
        raise ApiError(400, f"'tool_choice' names the function {name!r}, which is not in 'tools' "
                            f"({', '.join(names)})", param="tool_choice", code="invalid_value")
    return ToolPlan(tools, parse=True, forced=(name,), parallel=False)


class ToolSupport:
    """One model's tool handling: its family's format, and whether its template renders tools.

    Args:
        tokenizer: the checkpoint's tokenizer (chat_template, special tokens, response_template).
        model_type: config.model_type.
        render: renders (messages, tools) to text, for the probe.
    """

    def __init__(self, tokenizer, model_type: str, render) -> None:
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else \
            json.dumps(tokenizer.chat_template or "")
        self.format: Optional[ToolFormat] = detect(template, model_type)
        own = getattr(tokenizer, "response_template", None)
        self.response_template = own or (self.format.response_template if self.format else None)
        self._render = render
        self._supported: Optional[bool] = None
        # Special tokens by text: a marker that is one of these is written as its id in a grammar.
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.specials = {str(a): int(i) for i, a in added.items() if getattr(a, "special", False)}
        for t in tokenizer.all_special_tokens:
            self.specials.setdefault(t, tokenizer.convert_tokens_to_ids(t))

    def check(self) -> None:
        """Raises ApiError 400 when the chat template does not render tools or no parser fits."""
        if self._supported is None:
            probe = [{"type": "function", "function": {"name": _PROBE, "description": "probe",
                                                        "parameters": {"type": "object", "properties": {}}}}]
            try:
                self._supported = _PROBE in self._render([{"role": "user", "content": "hi"}], probe)
            except Exception:  # the template is code from the checkpoint: any failure means no tools
                self._supported = False
        if not self._supported:
            raise ApiError(400, "this model's chat template does not support tools (it ignores 'tools')",
                           param="tools", code="tools_not_supported")
        if self.response_template is None:
            raise ApiError(400, "this model's chat template renders tools, but moespec knows no parser for its "
                                "tool-call format (Hermes, GPT-OSS, Mistral, DeepSeek, GLM)", param="tools",
                           code="tools_not_supported")

    def lit(self, text: str) -> str:
        """``text`` as a Lark expression; special tokens of the tokenizer become ``<[id]>``."""
        if text in self.specials:
            return f"<[{self.specials[text]}]>"
        return json.dumps(text)

    def grammar(self, tools: list[dict], forced: tuple[str, ...], parallel: bool) -> str:
        """The Lark grammar forcing a call of the ``forced`` functions (tool_formats.call_grammar)."""
        return call_grammar(self.format, self.lit, tools, forced, parallel)


@dataclass
class CallStream:
    """Parses one answer's raw text (special tokens kept) as it streams.

    ``feed`` returns (content text, reasoning text, finished calls) for what the new text
    completed; ``finish`` returns the same for the rest. Calls are OpenAI dicts
    ({"id", "type", "function": {"name", "arguments": JSON text}}). A call that does not parse
    (the model wrote the marker, then no valid JSON) sets ``failed``: the caller answers the
    whole raw text as content, as vLLM does.
    """

    response_template: dict
    tools: list[dict]
    max_calls: Optional[int] = None  # parallel_tool_calls false: the first call only
    calls: list[dict] = field(default_factory=list)
    failed: bool = False
    raw: str = ""
    _parser: object = None

    def __post_init__(self) -> None:
        from transformers.utils.chat_parsing import ResponseParser

        self._parser = ResponseParser(self.response_template, prefix="", tools=self.tools)

    def feed(self, text: str) -> tuple[str, str, list[dict]]:
        """Events of ``text``: (content, reasoning, new calls)."""
        self.raw += text
        if self.failed:
            return "", "", []
        try:
            return self._collect(self._parser.feed(text))
        except (ValueError, KeyError):  # the parser's errors for a region that does not parse
            self.failed = True
            return "", "", []

    def finish(self) -> tuple[str, str, list[dict]]:
        """The rest at the end of the answer."""
        if self.failed:
            return "", "", []
        try:
            _, events = self._parser.finalize()
        except (ValueError, KeyError):
            self.failed = True
            return "", "", []
        return self._collect(events)

    def _collect(self, events: list[dict]) -> tuple[str, str, list[dict]]:
        content, reasoning, new = [], [], []
        for ev in events:
            if ev["type"] == "region_chunk" and ev["field"] == "content":
                content.append(ev["text"])
            elif ev["type"] == "region_chunk" and ev["field"] == "thinking":
                reasoning.append(ev["text"])
            elif ev["type"] == "region_close" and ev["field"] == "tool_calls":
                for call in ev["value"] if isinstance(ev["value"], list) else [ev["value"]]:
                    if self.max_calls is None or len(self.calls) + len(new) < self.max_calls:
                        new.append(_openai_call(call))
        self.calls += new
        return "".join(content), "".join(reasoning), new


def _openai_call(call: dict) -> dict:
    fn = call.get("function", call) if isinstance(call, dict) else {}
    args = fn.get("arguments", {})
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": str(fn.get("name", "")),
                         "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}
