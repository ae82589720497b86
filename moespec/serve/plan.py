"""A validated request body -> the choices the worker generates (ChoiceSpec), checked against the
server: ``--max-n``, the context length, the vocabulary, what the model's template supports.

Sampling: temperature 0 (or top_p 0, which keeps only the most likely token) is greedy; choice
``j`` of ``n`` samples with seed ``seed + j``, so ``n: 3`` equals three requests seeded
``seed``, ``seed + 1``, ``seed + 2``. Constraints: ``response_format`` json_object / json_schema,
or a forced tool call, become one grammar (compiled once per distinct grammar, cached); a
request cannot force both.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

from moespec.config import SamplingConfig
from moespec.sampling.controls import TokenControls
from moespec.sampling.grammar import GrammarError, json_schema_grammar, lark_grammar
from moespec.serve.backend import ChoiceSpec, ModelBackend
from moespec.serve.errors import ApiError
from moespec.serve.messages import template_messages
from moespec.serve.schemas import ChatCompletionRequest, CompletionRequest, JsonObjectFormat, JsonSchemaFormat, \
    SamplingFields
from moespec.serve.tools import CallStream, plan as tool_plan


@dataclass(frozen=True)
class Limits:
    """The server's own bounds on a request (``moespec serve`` options)."""

    max_n: int = 8
    default_max_tokens: int = 256
    default_seed: int = 0


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def check_common(body: SamplingFields, backend: ModelBackend, limits: Limits) -> None:
    """The checks both endpoints share (module docstring).

    Raises:
        ApiError: 400 naming the field.
    """
    for name, what in body.unsupported():
        raise _bad(name, f"'{name}': {what} is not supported by this server")
    if body.choices() > limits.max_n:
        raise _bad("n", f"'n' is {body.choices()}; this server generates at most {limits.max_n} choices "
                        f"per request (moespec serve --max-n)")
    limit = body.token_limit()
    if limit is not None and limit >= backend.context_tokens():
        field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise _bad(field, f"'{field}' is {limit}; this model's context is {backend.context_tokens()} tokens")
    if body.stream_options is not None and not body.stream:
        raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    for key in body.logit_bias or {}:
        if not (key.isdigit() and int(key) < backend.vocab_size):
            raise _bad("logit_bias", f"'logit_bias' key {key!r} is not a token id (0..{backend.vocab_size - 1})")


def sampling(body: SamplingFields, limits: Limits, j: int) -> SamplingConfig:
    """Choice ``j``'s sampling settings."""
    greedy = body.temperature == 0 or body.top_p == 0
    return SamplingConfig(
        max_new_tokens=body.token_limit() or limits.default_max_tokens,
        temperature=0.0 if greedy or body.temperature is None else body.temperature,  # unset: greedy
        top_p=1.0 if greedy or body.top_p is None else body.top_p,
        seed=(limits.default_seed if body.seed is None else body.seed) + j,
    )


def _controls(body: SamplingFields, backend: ModelBackend, grammar: Optional[str], k: Optional[int]):
    """A factory of TokenControls for one choice, or None when nothing is asked."""
    bias = {int(t): v for t, v in (body.logit_bias or {}).items()}
    presence, frequency = body.presence_penalty or 0.0, body.frequency_penalty or 0.0
    if not (bias or presence or frequency or grammar or k is not None):
        return None
    if k is not None:
        backend.grammars.tokenizer()  # the logprobs' token bytes: built once (~1 s at 49k tokens), off the loop

    def make() -> TokenControls:
        g = backend.grammars.constraint(grammar) if grammar else None
        return TokenControls(backend.vocab_size, presence, frequency, bias, g, k)

    return make


def _compile(backend: ModelBackend, grammar: str, param: str) -> str:
    try:
        backend.grammars.compile(grammar)
    except GrammarError as exc:
        raise _bad(param, f"'{param}' does not compile to a grammar: {exc.message}") from None
    return grammar


def format_grammar(body: ChatCompletionRequest, backend: ModelBackend) -> Optional[str]:
    """The grammar of ``response_format`` (None: free text), compiled (cached).

    Raises:
        ApiError: 400 when the schema does not compile.
    """
    fmt = body.response_format
    if isinstance(fmt, JsonObjectFormat):
        return _compile(backend, json_schema_grammar({"type": "object"}), "response_format")
    if isinstance(fmt, JsonSchemaFormat):
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {"type": "object"}
        try:
            grammar = json_schema_grammar(schema)
        except GrammarError as exc:
            raise _bad("response_format.json_schema.schema", exc.message) from None
        return _compile(backend, grammar, "response_format.json_schema.schema")
    return None


def chat_choices(body: ChatCompletionRequest, backend: ModelBackend, limits: Limits) -> list[ChoiceSpec]:
    """The choices of a chat request (runs on a thread: compiling a grammar may take a while).

    Raises:
        ApiError: 400 for any field the server cannot honour as asked.
    """
    check_common(body, backend, limits)
    if body.top_logprobs is not None and not body.logprobs:
        raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    tools = tool_plan(body)
    if tools.tools:
        backend.tools.check()
    grammar = format_grammar(body, backend)
    if tools.forced:
        if grammar is not None:
            raise _bad("response_format", "'response_format' and a forced 'tool_choice' cannot both be enforced")
        try:
            lark = backend.tools.grammar(tools.tools, tools.forced, tools.parallel)
        except (KeyError, TypeError, ValueError) as exc:
            raise _bad("tools", f"'tools' cannot be turned into a grammar: {exc}") from None
        grammar = _compile(backend, lark_grammar(lark), "tools")
    ids = backend.chat_ids(template_messages(body.messages), tools.tools)
    backend.check(ids, "messages")
    k = (body.top_logprobs or 0) if body.logprobs else None
    controls = _controls(body, backend, grammar, k)
    parser = partial(CallStream, backend.tools.response_template, tools.tools, None if tools.parallel else 1) \
        if tools.parse else None
    return [ChoiceSpec(j, ids, sampling(body, limits, j), body.stop_strings(), controls, parser)
            for j in range(body.choices())]


def completion_choices(body: CompletionRequest, backend: ModelBackend, limits: Limits) -> list[ChoiceSpec]:
    """The choices of a completions request: ``n`` per prompt, prompt after prompt.

    Raises:
        ApiError: 400 for any field the server cannot honour as asked.
    """
    check_common(body, backend, limits)
    controls = _controls(body, backend, None, body.logprobs)
    specs = []
    prompts = body.prompts()
    for p, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{p}"
        ids = backend.text_ids(prompt, param)
        backend.check(ids, param)
        echo = (prompt if isinstance(prompt, str) else backend.decode(ids)) if body.echo else ""
        for j in range(body.choices()):
            specs.append(ChoiceSpec(p * body.choices() + j, ids, sampling(body, limits, j), body.stop_strings(),
                                    controls, None, echo))
    return specs
