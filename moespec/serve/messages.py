"""Chat messages as the chat template expects them, with OpenAI's per-role rules checked.

"developer" is rendered as "system"; an assistant message's ``tool_calls`` go to the template
with their arguments parsed into a dict (transformers' documented shape: templates differ in
whether they accept a JSON string, every one accepts a dict); a "tool" message carries its
``tool_call_id`` and the name of the call it answers; the legacy "function" role becomes a
"tool" message. Content parts other than text are refused naming what they are ("image
input", "audio input", "file input"): the models moespec runs read text only.
"""

from __future__ import annotations

import json

from moespec.serve.errors import ApiError
from moespec.serve.schemas import ChatMessage

_PART_KINDS = {"image_url": "image input", "input_image": "image input", "input_audio": "audio input",
               "file": "file input"}


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def content_text(m: ChatMessage, i: int) -> str:
    """The content of message ``i`` as one string (text parts joined).

    Raises:
        ApiError: 400 for a non-text part (naming its kind) or a malformed text part.
    """
    if not isinstance(m.content, list):
        return m.content or ""
    out = []
    for j, part in enumerate(m.content):
        where = f"messages.{i}.content.{j}"
        kind = getattr(part, "type", None)
        if kind in _PART_KINDS:
            raise _bad(where, f"'{where}': {_PART_KINDS[kind]} is not supported: this model reads text only")
        text = getattr(part, "text", None)
        if kind != "text" or not isinstance(text, str):
            raise _bad(where, f"'{where}': a content part must be {{\"type\": \"text\", \"text\": ...}} "
                              f"(got type {kind!r})")
        out.append(text)
    return "".join(out)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """``messages`` as chat-template dicts (module docstring).

    Raises:
        ApiError: 400 naming the message field that breaks OpenAI's rules for its role.
    """
    out: list[dict] = []
    call_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        text = content_text(m, i)
        if m.audio is not None:
            raise _bad(f"messages.{i}.audio", f"'messages.{i}.audio': audio input is not supported")
        if m.function_call is not None:
            raise _bad(f"messages.{i}.function_call",
                       f"'messages.{i}.function_call' is the legacy spelling: send tool_calls")
        if m.tool_calls and m.role != "assistant":
            raise _bad(f"messages.{i}.tool_calls", f"'messages.{i}.tool_calls': only assistant messages carry them")
        if m.role in ("system", "developer", "user"):
            out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
        elif m.role == "assistant":
            out.append(_assistant(m, i, text, call_names))
        elif m.role == "tool":
            if not m.tool_call_id:
                raise _bad(f"messages.{i}.tool_call_id", f"'messages.{i}.tool_call_id' is required for role 'tool'")
            msg = {"role": "tool", "content": text, "tool_call_id": m.tool_call_id}
            name = call_names.get(m.tool_call_id) or m.name
            out.append({**msg, "name": name} if name else msg)
        else:  # legacy "function": the result of a function call, named
            if not m.name:
                raise _bad(f"messages.{i}.name", f"'messages.{i}.name' is required for role 'function'")
            out.append({"role": "tool", "content": text, "name": m.name})
    return out


def _assistant(m: ChatMessage, i: int, text: str, call_names: dict[str, str]) -> dict:
    msg: dict = {"role": "assistant", "content": text}
    if not m.tool_calls:
        return msg
    calls = []
    for j, call in enumerate(m.tool_calls):
        where = f"messages.{i}.tool_calls.{j}.function.arguments"
        try:
            args = json.loads(call.function.arguments or "{}")
        except (json.JSONDecodeError, RecursionError):
            raise _bad(where, f"'{where}' is not valid JSON (got {call.function.arguments[:60]!r})") from None
        if not isinstance(args, dict):
            raise _bad(where, f"'{where}' must be a JSON object")
        call_names[call.id] = call.function.name
        calls.append({"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}})
    return {**msg, "tool_calls": calls}
