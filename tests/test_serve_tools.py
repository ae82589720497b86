"""Tool calling through the real `openai` client: a two-step tool loop on a tiny model whose chat
template renders tools, the call forced by constrained decoding (tool_choice), streamed calls
equal to non-streamed ones, and every family's call grammar parsed back by its response template."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from serve_harness import serve
from tiny import TOOLS_TEMPLATE, make_checkpoint, make_tokenizer, with_chat_template

from moespec.sampling.grammar import GrammarCompiler, lark_grammar
from moespec.serve.app import ServeSettings
from moespec.serve.tool_formats import FORMATS, call_grammar, detect
from moespec.serve.tools import CallStream

openai = pytest.importorskip("openai")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                           "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    base = make_checkpoint(root / "base", "qwen3_moe", seed=3, max_position_embeddings=2048)
    return with_chat_template(base, root / "toolmodel", TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def server(tools_model):
    with serve(tools_model, ServeSettings()) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="-", max_retries=0, timeout=120)


def _ask(client, messages, **kw):
    kw = {"max_tokens": 300, "temperature": 0, **kw}
    return client.chat.completions.create(model="toolmodel", messages=messages, tools=TOOLS, **kw)


def test_two_step_tool_loop(client, server):
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = _ask(client, ASK, tool_choice=forced)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    # Step 2: the call and its result go back; the template renders both, the answer is text.
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    final = _ask(client, follow, tool_choice="none", max_tokens=6)
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason == "length"
    assert final.usage.completion_tokens == 6
    rendered = server.app.state.backend.tokenizer.decode(server.app.state.backend.engine.cached_ids)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    assert json.dumps({"name": "get_weather", "arguments": json.loads(call.function.arguments)}) in rendered
    # The first turn's KV is reused: the template appends the call, the result and the new turn.
    assert final.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens


def test_required_and_streamed_calls_equal(client):
    plain = _ask(client, ASK, tool_choice="required", parallel_tool_calls=False)
    chunks = list(_ask(client, ASK, tool_choice="required", parallel_tool_calls=False, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(i, c.function.name, c.function.arguments) for i, c in enumerate(plain.choices[0].message.tool_calls)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert plain.choices[0].message.tool_calls[0].function.name in {"get_weather", "get_time"}


def test_tool_errors_are_400_naming_the_field(client, server, tiny_models):
    bad = [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in 'tools'"),
           ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "pattern"),
           ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools.0.function.parameters", "dictionary"),
           ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", "function"),
           ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "both")]
    for extra, param, needle in bad:
        body = {"tools": TOOLS, **extra}
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="toolmodel", messages=ASK, max_tokens=4,
                                           extra_body={k: v for k, v in body.items()})
        e = err.value.body
        assert e["param"] == param and needle in e["message"], e
    assert _ask(client, ASK, tool_choice="required", parallel_tool_calls=False).choices[0].finish_reason == \
        "tool_calls"  # still serving


def test_template_without_tools_is_refused(tiny_models):
    with serve(tiny_models["qwen3_moe"], ServeSettings()) as srv:
        c = openai.OpenAI(base_url=srv.v1, api_key="-", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="qwen3_moe", messages=ASK, tools=TOOLS, max_tokens=2)
        assert "does not support tools" in err.value.body["message"] and err.value.body["param"] == "tools"


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_each_family_grammar_parses_back(family, tmp_path):
    """A call forced by the family's grammar (greedy over random logits) parses back to that call."""
    tok = make_tokenizer(tmp_path)
    grammars = GrammarCompiler(tok, len(tok), {tok.eos_token_id})
    fmt = FORMATS[family]
    constraint = grammars.constraint(lark_grammar(call_grammar(fmt, json.dumps, TOOLS, ("get_weather",), True)))
    gen, ids = torch.Generator().manual_seed(sum(map(ord, family))), []
    while len(ids) < 400:
        allowed = constraint.allowed()
        assert torch.equal(allowed, constraint.allowed_reference())  # the fast unpacking against bit by bit
        t = int(torch.argmax(constraint.mask(torch.randn(len(tok), generator=gen))))
        if t == tok.eos_token_id:
            break
        constraint.accept(t)
        ids.append(t)
    assert constraint.finished
    stream = CallStream(fmt.response_template, TOOLS)
    text = tok.decode(ids)
    for i in range(0, len(text), 5):  # streamed in pieces, as the server feeds it
        stream.feed(text[i:i + 5])
    stream.finish()
    assert not stream.failed and stream.calls, text
    for call in stream.calls:
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)


@pytest.mark.parametrize("marker,model_type,family", [
    ("{{ '<tool_call>' }}", "qwen3_moe", "hermes"), ("<|channel|>commentary", "gpt_oss", "gpt_oss"),
    ("[TOOL_CALLS]", "mixtral", "mistral"), ("[TOOL_CALLS]{{ name }}[ARGS]", "mixtral", "mistral_v11"),
    ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>", "deepseek_v3", "deepseek_v3"),
    ("<｜tool▁call▁begin｜>{{ name }}<｜tool▁sep｜>", "deepseek_v3", "deepseek_v31"),
    ("<arg_key>", "glm4_moe_lite", "glm"), ("", "olmoe", None)])
def test_format_detection(marker, model_type, family):
    found = detect(marker, model_type)
    assert (found.name if found else None) == family


def test_parallel_tool_calls_false_keeps_the_first_call():
    one = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    text = "ok\n" + one + "\n" + one.replace("get_time", "get_weather")
    for limit, names in ((None, ["get_time", "get_weather"]), (1, ["get_time"])):
        stream = CallStream(FORMATS["hermes"].response_template, TOOLS, limit)
        content, _, _ = stream.feed(text)
        stream.finish()
        assert [c["function"]["name"] for c in stream.calls] == names and content.startswith("ok")
