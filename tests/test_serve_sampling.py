"""logprobs, n, list prompts, logit_bias and penalties through the real `openai` client, plus
GET /v1/models/{id} and CORS: logprobs equal a float32 log-softmax of transformers' own logits,
n choices equal sequential seeded requests, the penalty formula equals OpenAI's."""

from __future__ import annotations

import httpx2 as httpx
import pytest
import torch
from serve_harness import serve
from tiny import reference_model

from moespec.sampling.controls import TokenControls, penalized_reference
from moespec.sampling.logprobs import token_logprob
from moespec.serve.app import ServeSettings

openai = pytest.importorskip("openai")
KEY = "k3y"
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def server(tiny_models):
    with serve(tiny_models["qwen2_moe"], ServeSettings(api_key=KEY, cors_origins=(ORIGIN,))) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key=KEY, max_retries=0, timeout=120)


def _reference_logprobs(folder, ids: list[int], new: list[int]) -> torch.Tensor:
    """log_softmax (float32) of transformers' logits at each generated position: [len(new), V]."""
    with torch.no_grad():
        logits = reference_model(folder)(torch.tensor([ids + new])).logits[0].float()  # [T, V]
    return torch.log_softmax(logits[len(ids) - 1:len(ids) - 1 + len(new)], dim=-1)


def _ids_of(server, entries) -> list[int]:
    backend = server.app.state.backend
    by_bytes = {bytes(backend.grammars.token_bytes(i)): i for i in range(backend.vocab_size)}
    return [by_bytes[bytes(e.bytes)] for e in entries]


def test_chat_logprobs_equal_transformers(client, server, tiny_models):
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="qwen2_moe", messages=msgs, max_tokens=6, temperature=0.7, seed=3,
                                       logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(e.top_logprobs) == 5 for e in content)
    new = _ids_of(server, content)
    ref = _reference_logprobs(tiny_models["qwen2_moe"], server.app.state.backend.chat_ids(
        [{"role": "user", "content": "hello"}]), new)
    for step, (e, tok) in enumerate(zip(content, new)):
        assert abs(e.logprob - float(ref[step, tok])) <= 1e-5
        top = torch.topk(ref[step], 5)
        assert [round(t.logprob, 4) for t in e.top_logprobs] == [round(v, 4) for v in top.values.tolist()]
        assert abs(e.top_logprobs[0].logprob - float(top.values[0])) <= 1e-5
    streamed = [e for ch in client.chat.completions.create(
        model="qwen2_moe", messages=msgs, max_tokens=6, temperature=0.7, seed=3, logprobs=True, top_logprobs=5,
        stream=True) if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    # Same tokens; the streamed request reused the prompt's KV (a one-token prefill): equal within 1e-5.
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) <= 1e-5 for a, b in zip(streamed, content))


def test_completion_logprobs_and_list_prompt(client, server, tiny_models):
    prompt = [5, 17, 99, 3]
    r = client.completions.create(model="qwen2_moe", prompt=prompt, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(t) == 3 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    rows = _greedy_rows(tiny_models["qwen2_moe"], prompt, 4)  # transformers' greedy steps, float32
    for got, top, row in zip(lp.token_logprobs, lp.top_logprobs, rows):
        ref = torch.log_softmax(row, dim=-1)
        assert abs(got - float(ref.max())) <= 1e-5  # greedy: the most likely token
        assert max(top.values()) == pytest.approx(float(ref.max()), abs=1e-5)
    both = client.completions.create(model="qwen2_moe", prompt=["once", "upon"], max_tokens=3, temperature=0, n=2)
    alone = [client.completions.create(model="qwen2_moe", prompt=p, max_tokens=3, temperature=0).choices[0].text
             for p in ("once", "upon")]
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert both.usage.prompt_tokens == len("once") + len("upon") and both.usage.completion_tokens == 12


def _greedy_rows(folder, prompt: list[int], n: int) -> list[torch.Tensor]:
    ids, rows = list(prompt), []
    model = reference_model(folder)
    with torch.no_grad():
        for _ in range(n):
            row = model(torch.tensor([ids])).logits[0, -1].float()
            rows.append(row)
            ids.append(int(torch.argmax(row)))
    return rows


def test_n_equals_sequential_seeded_requests(client):
    msgs = [{"role": "user", "content": "story"}]
    kw = dict(model="qwen2_moe", messages=msgs, max_tokens=8, temperature=1.0)
    three = client.chat.completions.create(n=3, seed=11, **kw)
    alone = [client.chat.completions.create(seed=11 + j, **kw).choices[0].message.content for j in range(3)]
    assert [c.message.content for c in three.choices] == alone and len(set(alone)) == 3
    assert three.usage.completion_tokens == 24
    chunks = list(client.chat.completions.create(n=3, seed=11, stream=True, **kw))
    for j in range(3):
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == j) \
            == alone[j]


def test_logit_bias_and_penalties(client, server):
    msgs = [{"role": "user", "content": "x"}]
    forced = client.chat.completions.create(model="qwen2_moe", messages=msgs, max_tokens=5, temperature=0,
                                            logit_bias={"65": 100})
    assert forced.choices[0].message.content == server.app.state.backend.decode([65] * 5)
    plain = client.chat.completions.create(model="qwen2_moe", messages=msgs, max_tokens=5, temperature=0,
                                           logprobs=True)
    first = _ids_of(server, plain.choices[0].logprobs.content)[0]
    banned = client.chat.completions.create(model="qwen2_moe", messages=msgs, max_tokens=5, temperature=0,
                                            logprobs=True, logit_bias={str(first): -100})
    assert _ids_of(server, banned.choices[0].logprobs.content)[0] != first


def test_penalties_follow_openai_formula():
    gen = torch.Generator().manual_seed(0)
    controls = TokenControls(12, presence_penalty=0.5, frequency_penalty=-0.7, logit_bias={3: 2.5, 7: -100.0},
                             top_logprobs=2)
    history: list[int] = []
    for tok in [4, 4, 9, 3, 4]:
        logits = torch.randn(12, generator=gen)
        want = penalized_reference(logits.tolist(), history, 0.5, -0.7, {3: 2.5, 7: -100.0})
        got = controls(logits)
        assert torch.allclose(got, torch.tensor(want), atol=1e-6)
        controls.accept(tok)
        history.append(tok)
        assert controls.logprobs[-1] == token_logprob(got, tok, 2)


def test_model_by_id_and_cors(client, server):
    assert client.models.retrieve("qwen2_moe").id == "qwen2_moe"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    pre = httpx.options(server.v1 + "/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200  # answered before the key check (a preflight carries no key)
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    r = httpx.get(server.v1 + "/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(server.v1 + "/models", headers={"Origin": "http://evil.example",
                                                          "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in other.headers
    assert httpx.get(server.v1 + "/models").status_code == 401  # the key is still required
