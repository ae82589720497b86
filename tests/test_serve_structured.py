"""Structured output through the real `openai` client: json_schema answers validate (jsonschema) on
20 seeds in exact and speculative modes, json_object answers parse, a grammar compiles once per
schema, and a schema that does not compile is a 400 naming it."""

from __future__ import annotations

import json

import jsonschema
import pytest
from serve_harness import serve, tiny_runtime

from moespec.config import ExecuteMode, Predictor, RuntimeConfig
from moespec.serve.app import ServeSettings

openai = pytest.importorskip("openai")

# Small answers (~30 tokens on the byte-level tokenizer) keep 2 x 20 generations quick.
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 3},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "maxItems": 1, "items": {"enum": ["a", "b"]}}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "who?"}]


def _speculative() -> RuntimeConfig:
    return RuntimeConfig(device="cpu", cache_experts=4, predictor=Predictor.ROUTER, execute=ExecuteMode.SPECULATIVE)


@pytest.mark.parametrize("cfg", [tiny_runtime(), _speculative()], ids=["exact", "speculative"])
def test_json_schema_validates_on_20_seeds(tiny_models, cfg):
    with serve(tiny_models["qwen3_moe"], ServeSettings(max_n=20), cfg) as srv:
        c = openai.OpenAI(base_url=srv.v1, api_key="-", max_retries=0, timeout=120)
        # n=20: choice j is sampled with seed j (plan.py), one request instead of twenty.
        r = c.chat.completions.create(model="qwen3_moe", messages=ASK, response_format=FORMAT, temperature=1.0,
                                      seed=0, max_tokens=120, n=20)
        texts = [ch.message.content for ch in r.choices]
        for ch in r.choices:
            assert ch.finish_reason == "stop", ch.message.content
            jsonschema.validate(json.loads(ch.message.content), PERSON)
        assert len(set(texts)) > 10  # sampled, not one answer forced 20 times
        again = c.chat.completions.create(model="qwen3_moe", messages=ASK, response_format=FORMAT, temperature=1.0,
                                          seed=5, max_tokens=120)
        assert again.choices[0].message.content == texts[5]  # seed 5 alone = choice 5
        assert srv.app.state.backend.grammars.compiled == 1  # compiled once per schema, then cached

        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="qwen3_moe", messages=ASK, response_format=FORMAT, temperature=1.0, seed=0, max_tokens=120,
            stream=True) if ch.choices)
        assert streamed == texts[0]


def test_json_object_and_bad_schemas(tiny_models):
    with serve(tiny_models["olmoe"], ServeSettings()) as srv:
        c = openai.OpenAI(base_url=srv.v1, api_key="-", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="olmoe", messages=ASK, response_format={"type": "json_object"},
                                      temperature=0, max_tokens=200)
        if r.choices[0].finish_reason == "stop":  # greedy on random weights may write a long object
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:
            assert r.choices[0].message.content.startswith("{")
        plain = c.chat.completions.create(model="olmoe", messages=ASK, temperature=0, max_tokens=5)
        typed = c.chat.completions.create(model="olmoe", messages=ASK, temperature=0, max_tokens=5,
                                          response_format={"type": "text"})
        assert typed.choices[0].message.content == plain.choices[0].message.content
        for fmt, param in [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
                            "response_format.json_schema.schema"),
                           ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
                            "response_format.json_schema.schema"),
                           ({"type": "xml"}, "response_format")]:
            with pytest.raises(openai.BadRequestError) as err:
                c.chat.completions.create(model="olmoe", messages=ASK, response_format=fmt, max_tokens=2)
            assert err.value.body["param"] == param, err.value.body
        assert c.chat.completions.create(model="olmoe", messages=ASK, max_tokens=2).usage.completion_tokens == 2
