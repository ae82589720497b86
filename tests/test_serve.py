"""`moespec serve` through the real `openai` client: same text as `moespec chat`, streaming,
raw completions, stop strings, KV prefix reuse across requests, and /metrics."""

from __future__ import annotations

import json

import httpx2 as httpx  # the HTTP client the openai package depends on
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import serve
from typer.testing import CliRunner

from moespec.cli.app import app as cli
from moespec.serve.app import ServeSettings

openai = pytest.importorskip("openai")

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_models):
    with serve(tiny_models["qwen3_moe"], ServeSettings(max_queue=4)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def _cli_chat(model_path, prompt: str) -> dict:
    r = CliRunner().invoke(cli, ["chat", str(model_path), "--prompt", prompt, "--json", "--max-new-tokens",
                                 str(MAX_TOKENS), "--cache-experts", "4", "--device", "cpu", "--predictor", "router"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])


def _ask(client, server, messages, **kw):
    return client.chat.completions.create(model=server.app.state.backend.name, messages=messages,
                                          max_tokens=MAX_TOKENS, temperature=0, **kw)


def _streamed(client, server, messages, **kw) -> tuple[str, list]:
    chunks = list(_ask(client, server, messages, stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["qwen3_moe"]
    health = httpx.get(server.url + "/health").json()
    assert health == {"status": "ok", "model": "qwen3_moe", "running": 0, "waiting": 0}


def test_chat_equals_moespec_chat_json(client, server, tiny_models):
    expected = _cli_chat(tiny_models["qwen3_moe"], "hello")
    msgs = [{"role": "user", "content": "hello"}]
    r = _ask(client, server, msgs)
    assert r.choices[0].message.content == expected["text"]
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == expected["stats"]["prompt_tokens"]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + MAX_TOKENS

    text, chunks = _streamed(client, server, msgs, stream_options={"include_usage": True})
    assert text == expected["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_stream_ends_with_done(server):
    body = {"model": "qwen3_moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])


def test_system_prompt_equals_chat_system(client, server, tiny_models):
    r = CliRunner().invoke(cli, ["chat", str(tiny_models["qwen3_moe"]), "--prompt", "abc", "--system", "be brief",
                                 "--json", "--max-new-tokens", str(MAX_TOKENS), "--cache-experts", "4"])
    expected = json.loads(r.stdout.strip().splitlines()[-1])["text"]
    got = _ask(client, server, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"}])
    assert got.choices[0].message.content == expected


def test_stop_string_cuts_the_answer(client, server):
    msgs = [{"role": "user", "content": "abc"}]
    full = _ask(client, server, msgs).choices[0].message.content
    stop = full[4:6]  # a stop string that occurs inside the known answer (maybe across tokens)
    want = full[:full.find(stop)]
    r = _ask(client, server, msgs, stop=[stop, "never-there"])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    text, _ = _streamed(client, server, msgs, stop=stop)
    assert text == want


def test_max_completion_tokens_and_seed(client, server):
    name = server.app.state.backend.name
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=name, messages=msgs, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    a, b = (client.chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=1.0, seed=7)
            for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content


def test_raw_completion(client, server):
    name = server.app.state.backend.name
    r = client.completions.create(model=name, prompt="once upon", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len("once upon")  # byte-level tokenizer: one token per byte
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=name, prompt="once upon", max_tokens=6, temperature=0, stream=True))
    assert streamed == r.choices[0].text
    by_ids = client.completions.create(model=name, prompt=server.app.state.backend.text_ids("once upon"),
                                       max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text


def test_extended_conversation_reuses_kv_prefix(client, server):
    name = server.app.state.backend.name
    first = [{"role": "user", "content": "abc"}]
    a = client.chat.completions.create(model=name, messages=first, max_tokens=4, temperature=0)
    answer = a.choices[0].message.content
    # Precondition: this answer re-tokenises to the ids that were generated (byte-level, valid UTF-8).
    assert "\ufffd" not in answer and len(answer.encode()) == a.usage.completion_tokens == 4, answer
    follow = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    b = client.chat.completions.create(model=name, messages=follow, max_tokens=4, temperature=0)
    # The KV of the first prompt and of every answer token but the last (never fed back) is reused.
    assert b.usage.prompt_tokens_details.cached_tokens == a.usage.prompt_tokens + 4 - 1
    other = _ask(client, server, [{"role": "user", "content": "unrelated"}])
    assert other.usage.prompt_tokens_details.cached_tokens < other.usage.prompt_tokens


def _metrics(server) -> dict[tuple, float]:
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sum(m: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in m.items() if n == name and want <= set(lab))


def test_metrics_parse_and_move(client, server):
    before = _metrics(server)
    r = _ask(client, server, [{"role": "user", "content": "metrics please"}])
    after = _metrics(server)
    chat = dict(endpoint="/v1/chat/completions", status="200")
    assert _sum(after, "moespec_requests_total", **chat) == _sum(before, "moespec_requests_total", **chat) + 1
    assert (_sum(after, "moespec_generation_tokens_total") - _sum(before, "moespec_generation_tokens_total")
            == r.usage.completion_tokens)
    assert (_sum(after, "moespec_prompt_tokens_total") - _sum(before, "moespec_prompt_tokens_total")
            == r.usage.prompt_tokens)
    ttft = "moespec_time_to_first_token_seconds_count"
    assert _sum(after, ttft) == _sum(before, ttft) + 1
    tpot = "moespec_time_per_output_token_seconds_count"
    assert _sum(after, tpot) - _sum(before, tpot) == MAX_TOKENS - 1  # every token after the first is a decode step
    layers = server.app.state.backend.engine.om.store.moe_layers
    for layer in map(str, layers):
        hits = _sum(after, "moespec_layer_expert_hits_total", layer=layer, phase="decode")
        misses = _sum(after, "moespec_layer_expert_misses_total", layer=layer, phase="decode")
        assert hits + misses > 0
        assert after[("moespec_layer_hit_rate", (("layer", layer),))] == pytest.approx(hits / (hits + misses))
    # The router predictor predicts every MoE layer after the first: recall@K is known there.
    recall = [after[("moespec_layer_recall_at_k", (("layer", str(layer)),))] for layer in layers[1:]]
    assert all(0 <= x <= 1 for x in recall)
    assert _sum(after, "moespec_layer_h2d_bytes_total") > _sum(before, "moespec_layer_h2d_bytes_total")
    expert_bytes = server.app.state.backend.engine.om.store.expert_bytes
    assert _sum(after, "moespec_layer_h2d_bytes_total") % expert_bytes == 0  # whole experts only
    assert after[("moespec_cache_slots", ())] == 4
    used = after[("moespec_cache_slots_used", ())]
    assert 0 < used <= 4 and _sum(after, "moespec_cache_resident_experts") == used
