"""How each model family writes a tool call: a response template to parse it, a grammar to force it.

Parsing goes through transformers' response templates (``tokenizer.parse_response`` /
``ResponseParser``, transformers >= 5.2x): a checkpoint that ships its own ``response_template``
is parsed with it; otherwise the family's template below, chosen from the chat template's text
(the markers it renders tool calls with) or the model type. The same markers, written as a Lark
grammar for llguidance, force a call when ``tool_choice`` is "required" or names a function;
the arguments are the function's JSON schema (``%json``). Markers that are special tokens of the
tokenizer are written as token ids (``<[id]>``), so the grammar emits the very token.

Families: Hermes / Qwen2.5 / Qwen3 / SmolLM3 (``<tool_call>{json}</tool_call>``), GPT-OSS
(harmony ``commentary to=functions.NAME``), Mistral / Mixtral (``[TOOL_CALLS]``, the v3 JSON
list and the v11 ``NAME[ARGS]{json}``), DeepSeek V3 / R1 and V3.1 (``<｜tool▁call▁begin｜>``),
GLM-4.5 / 4.7 (``<arg_key>`` / ``<arg_value>`` pairs).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_FN = {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}
_THINK = {"open": "<think>", "close": "</think>", "content": "text"}
_CONTENT = {"content": "text", "content_args": {"strip": False}}
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
NAME, QNAME, ARGS, KV_ARGS = "{name}", "{qname}", "{args}", "{kv_args}"  # placeholders of ToolFormat.call


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call syntax.

    Attributes:
        name: the family ("hermes", "gpt_oss", "mistral", "mistral_v11", "deepseek_v3", "deepseek_v31", "glm").
        response_template: transformers' response template (content, thinking, tool_calls fields).
        call: one call as written: literal parts (a special token when the tokenizer has it) and the
            placeholders NAME (the function name), QNAME (it as a JSON string), ARGS (the
            arguments, JSON per the parameters schema), KV_ARGS (GLM's key/value pairs).
        begin, sep, end: written before the first call, between calls, after the last.
        parallel: the format can carry several calls in one answer.
    """

    name: str
    response_template: dict
    call: tuple[str, ...] = ()
    begin: str = ""
    sep: str = ""
    end: str = ""
    parallel: bool = True

    def call_rule(self, name: str, schema_rule: str, params: dict, lit) -> str:
        """The Lark expression of one call of function ``name`` (``schema_rule``: its arguments' rule)."""
        parts = {NAME: json.dumps(name), QNAME: json.dumps(json.dumps(name)), ARGS: schema_rule}
        return " ".join(_glm_args(params, lit) if p == KV_ARGS else parts.get(p) or lit(p) for p in self.call)


def _glm_args(params: dict, lit) -> str:
    props = (params or {}).get("properties") or {}
    required = [k for k in (params or {}).get("required", []) if k in props]
    parts = []
    for key in required:
        spec = props[key]
        if spec.get("type") == "string":  # GLM writes strings bare, other values as JSON
            value = "(" + " | ".join(json.dumps(str(v)) for v in spec["enum"]) + ")" if "enum" in spec else "/[^<]*/"
        else:
            value = f"%json {json.dumps(spec)}"
        parts.append(f'{lit("<arg_key>")} {json.dumps(key)} {lit("</arg_key>")} "\\n" {lit("<arg_value>")} '
                     f'{value} {lit("</arg_value>")} "\\n"')
    return " ".join(parts) or '""'


HERMES = ToolFormat("hermes", {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {"thinking": _THINK,
               "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json",
                              "transform": {"type": "function", "function": "{content}"}},
               "content": _CONTENT}},
    call=("<tool_call>", '\n{"name": ', QNAME, ', "arguments": ', ARGS, "}\n", "</tool_call>"), sep="\n")
GPT_OSS = ToolFormat("gpt_oss", {
    "start_anchor": "<|start|>assistant",
    "fields": {"thinking": {"open": "<|channel|>analysis<|message|>", "close": "<|end|>", "content": "text"},
               "content": {"open": "<|channel|>final<|message|>", "close": "<|end|>", "content": "text",
                           "content_args": {"strip": False}},
               "tool_calls": {"open_pattern": r"<\|channel\|>commentary to=functions\.(?P<name>[\w-]+)[^<]*"
                                              r"(?:<\|constrain\|>\w*)?<\|message\|>",
                              "close": "<|call|>", "repeats": True, "content": "json", "transform": _FN},
               "_header": {"open": "<|start|>assistant", "close_pattern": r"(?=<\|channel\|>)", "content": "text"}}},
    call=("<|channel|>", "commentary to=functions.", NAME, " ", "<|constrain|>", "json", "<|message|>", ARGS),
    parallel=False)
MISTRAL = ToolFormat("mistral", {
    "start_anchor": "[/INST]",
    "fields": {"tool_calls": {"open": "[TOOL_CALLS]", "content": "json", "transform_each": True,
                              "transform": {"type": "function",
                                            "function": {"name": "{name}", "arguments": "{arguments}"}}},
               "content": _CONTENT}},
    call=('{"name": ', QNAME, ', "arguments": ', ARGS, "}"), begin="[TOOL_CALLS][", sep=", ", end="]")
MISTRAL_V11 = ToolFormat("mistral_v11", {
    "start_anchor": "[/INST]",
    # A call ends where the next one's [TOOL_CALLS] starts (or at the end): the close takes the
    # marker, so the next open matches the name without it.
    "fields": {"tool_calls": {"open_pattern": r"(?:\[TOOL_CALLS\])?(?P<name>[\w-]+)(?:\[CALL_ID\]\w+)?\[ARGS\]",
                              "close": "[TOOL_CALLS]", "repeats": True, "content": "json",
                              "transform": _FN},
               "content": _CONTENT}},
    call=("[TOOL_CALLS]", NAME, "[ARGS]", ARGS))
DEEPSEEK_V3 = ToolFormat("deepseek_v3", {
    "start_anchor": "<｜Assistant｜>",
    "fields": {"thinking": _THINK,
               "tool_calls": {"open_pattern": re.escape(DS_CALL) + "function" + re.escape(DS_SEP)
                              + r"(?P<name>[^\n]+)\n```json\n",
                              "close_pattern": r"\n```" + re.escape(DS_CALL_END) + r"\n?",
                              "repeats": True, "content": "json", "transform": _FN},
               "_calls": {"open": [DS_BEGIN, DS_END], "close_pattern": r"(?=<)|$", "content": "text"},
               "content": _CONTENT}},
    call=(DS_CALL, "function", DS_SEP, NAME, "\n```json\n", ARGS, "\n```", DS_CALL_END), begin=DS_BEGIN,
    sep="\n", end=DS_END)
DEEPSEEK_V31 = ToolFormat("deepseek_v31", {
    "start_anchor": "<｜Assistant｜>",
    "fields": {"thinking": _THINK,
               "tool_calls": {"open_pattern": re.escape(DS_CALL) + r"(?P<name>[^<]+)" + re.escape(DS_SEP),
                              "close": DS_CALL_END, "repeats": True, "content": "json", "transform": _FN},
               "_calls": {"open": [DS_BEGIN, DS_END], "close_pattern": r"(?=<)|$", "content": "text"},
               "content": _CONTENT}},
    call=(DS_CALL, NAME, DS_SEP, ARGS, DS_CALL_END), begin=DS_BEGIN, end=DS_END)
GLM = ToolFormat("glm", {
    "start_anchor": "<|assistant|>",
    "fields": {"thinking": _THINK,
               "tool_calls": {"open_pattern": r"<tool_call>(?P<name>[^\n<]+)\s*", "close": "</tool_call>",
                              "repeats": True, "content": "xml-inline",
                              "content_args": {"tag_pattern": r"<arg_key>(?P<key>.*?)</arg_key>\s*"
                                                              r"<arg_value>(?P<value>.*?)</arg_value>",
                                               "value_parser": {"name": "json", "args": {"allow_non_json": True}}},
                              "transform": _FN},
               "content": _CONTENT}},
    call=("<tool_call>", NAME, "\n", KV_ARGS, "</tool_call>"), sep="\n")
FORMATS = {f.name: f for f in (HERMES, GPT_OSS, MISTRAL, MISTRAL_V11, DEEPSEEK_V3, DEEPSEEK_V31, GLM)}


def call_grammar(fmt: ToolFormat, lit, tools: list[dict], forced: tuple[str, ...], parallel: bool) -> str:
    """The Lark grammar (llguidance) forcing one call of one of the ``forced`` functions, or several
    when ``parallel`` and the format allows; ``lit(text)`` writes a marker (a special token: ``<[id]>``)."""
    from moespec.sampling.grammar import JSON_OPTIONS

    rules, alts = [], []
    for i, t in enumerate(t for t in tools if t["function"]["name"] in forced):
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object"}
        rules.append(f"args{i}: %json {json.dumps({**params, 'x-guidance': JSON_OPTIONS})}")
        alts.append(f"call{i}")
        rules.append(f"call{i}: {fmt.call_rule(fn['name'], f'args{i}', params, lit)}")
    sep = f" {lit(fmt.sep)}" if fmt.sep else ""
    body = f"call ({sep} call)*" if parallel and fmt.parallel else "call"
    begin = f"{lit(fmt.begin)} " if fmt.begin else ""
    end = f" {lit(fmt.end)}" if fmt.end else ""
    return "\n".join([f"start: {begin}{body}{end}", "call: " + " | ".join(alts), *rules])


def detect(chat_template: str, model_type: str) -> ToolFormat | None:
    """The family whose tool-call markers ``chat_template`` renders (else the model type's), or None."""
    t = chat_template or ""
    if "<|channel|>" in t or model_type == "gpt_oss":
        return GPT_OSS
    if "[TOOL_CALLS]" in t or model_type == "mixtral":
        return MISTRAL_V11 if "[ARGS]" in t else MISTRAL
    if "tool▁call▁begin" in t or model_type in ("deepseek_v3", "deepseek_v2"):
        return DEEPSEEK_V3 if "```json" in t or "function<｜tool▁sep｜>" in t else DEEPSEEK_V31
    if "<arg_key>" in t or model_type.startswith("glm4_moe"):
        return GLM
    if "<tool_call>" in t:
        return HERMES
    return None
