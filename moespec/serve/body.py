"""A request body from raw bytes to a validated schema, every fault a 400 naming the field.

Before pydantic sees the data: JSON errors, nesting deeper than MAX_DEPTH (a 5000-deep body
would otherwise end in RecursionError), and strings that are not valid Unicode (a lone
surrogate such as ``"\\ud800"`` parses in Python but no tokenizer can encode it). The walk is
iterative, so no body can exhaust the stack. NaN and ±Infinity literals (Python's json accepts
them) reach pydantic as floats and are refused there, naming the field.
"""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from moespec.serve.errors import ApiError

MAX_DEPTH = 64  # deepest nesting of arrays/objects accepted (JSON schemas in real requests: < 20)
T = TypeVar("T", bound=BaseModel)


def _path(parts) -> str:
    return ".".join(str(p) for p in parts)


def check_tree(data: object) -> None:
    """Refuse nesting beyond MAX_DEPTH and strings with lone surrogates (keys too).

    Raises:
        ApiError: 400 naming the path of the first offending value.
    """
    stack: list[tuple[object, tuple, int]] = [(data, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                field = str(path[0])
                raise ApiError(400, f"'{field}' is nested more than {MAX_DEPTH} levels deep", param=field,
                               code="invalid_value")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, path + (key,))
                stack.append((item, path + (key,), depth + 1))


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        where = _path(path) or "body"
        raise ApiError(400, f"'{where}' contains a lone surrogate (U+{code:04X}): text must be valid Unicode",
                       param=_path(path) or None, code="invalid_value") from None


def load_json(raw: bytes) -> dict:
    """The body as a JSON object (checked by ``check_tree``).

    Raises:
        ApiError: 400 for malformed or too deeply nested JSON, a non-object, a lone surrogate.
    """
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep",
                       code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    check_tree(data)
    return data


def parse_body(raw: bytes, kind: type[T]) -> T:
    """Parse and validate a request body as ``kind``.

    Raises:
        ApiError: 400 naming the first invalid field and the rule it breaks.
    """
    data = load_json(raw)
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> ApiError:
    """The 400 for pydantic's most telling error (a union's "wrong type" alternatives come last)."""
    errors = exc.errors()
    telling = [e for e in errors if e["type"] not in _TYPE_ERRORS]
    first = telling[0] if telling else max(errors, key=lambda e: len(e["loc"]))  # the deepest wrong type
    param = _field_path(first["loc"])
    if first["type"] == "missing":
        message = f"'{param}' is a required field"
    elif first["type"] == "extra_forbidden":
        message = f"unrecognized request field '{param}'"
    else:
        shown = repr(first.get("input"))
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        message = f"'{param}': {first['msg']} (got {shown})"
    return ApiError(400, message, param=param or None, code="invalid_value")


_TYPE_ERRORS = {"string_type", "list_type", "model_type", "int_type", "float_type", "dict_type", "bool_type",
                "literal_error", "model_attributes_type"}
_TAGGED = {"response_format"}  # discriminated unions: pydantic puts the tag in the location


def _field_path(loc: tuple) -> str:
    # pydantic adds a union member's type to the location ("prompt.str", "stop.list[str]",
    # "tool_choice.NamedToolChoice"), and a tagged union's tag: the client's path has neither.
    parts: list = []
    skip_tag = False
    for p in loc:
        if skip_tag:
            skip_tag = False
            continue
        if isinstance(p, str) and (any(c in p for c in "[]()'") or p[:1].isupper() or p in _TYPE_NAMES):
            continue
        parts.append(p)
        skip_tag = p in _TAGGED and len(parts) == 1
    return ".".join(str(p) for p in parts)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "function-after", "constrained-str"}
