"""Every numeric request field against OpenAI's ranges (property-style: NaN, ±inf, 0, negative,
fractional, huge, wrong type), and hostile bodies (5000-deep JSON, lone surrogates, images,
unknown fields, a client that leaves mid-body): each a 400 in OpenAI's error shape naming the
field, the server keeps serving, and its log shows no traceback for a client's fault."""

from __future__ import annotations

import json
import logging
import math
import socket

import httpx2 as httpx
import pytest
from serve_harness import serve, wait_until

from moespec.serve.app import ServeSettings

openai = pytest.importorskip("openai")
MAX_N = 2
CONTEXT = 256  # the tiny models' max_position_embeddings

# OpenAI's documented ranges (API reference), written here independently of moespec's schemas.
# field -> (kind, low, high); "int" fields take integers only, "num" fields any finite number.
CHAT_FIELDS = {
    "temperature": ("num", 0, 2), "top_p": ("num", 0, 1), "presence_penalty": ("num", -2, 2),
    "frequency_penalty": ("num", -2, 2), "max_tokens": ("int", 1, CONTEXT - 1),
    "max_completion_tokens": ("int", 1, CONTEXT - 1), "n": ("int", 1, MAX_N), "top_logprobs": ("int", 0, 20),
    "seed": ("int", -2**63, 2**63 - 1), "logit_bias.65": ("num", -100, 100),
}
COMPLETION_FIELDS = {"logprobs": ("int", 0, 5), "max_tokens": ("int", 1, CONTEXT - 1), "n": ("int", 1, MAX_N),
                     "temperature": ("num", 0, 2), "seed": ("int", -2**63, 2**63 - 1)}
VALUES = [math.nan, math.inf, -math.inf, 0, -1, 1, 0.5, 2.5, 21, 1e30, 10**30, "1", True, [1], {"a": 1}]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def server(tiny_models):
    records = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn", "fastapi", "starlette")]
    with serve(tiny_models["mixtral"], ServeSettings(max_n=MAX_N)) as running:
        for lg in loggers:  # after uvicorn's start: its logging config replaces the handlers it names
            lg.addHandler(records)
        running.records = records.records
        yield running
        for lg in loggers:
            lg.removeHandler(records)


def _valid(value, kind: str, lo, hi) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind == "int" and not isinstance(value, int):
        return False
    return math.isfinite(value) and lo <= value <= hi


def _body(base: dict, field: str, value) -> bytes:
    body = dict(base)
    if field == "max_completion_tokens":
        body.pop("max_tokens")
    if field.startswith("logit_bias."):
        body["logit_bias"] = {field.split(".")[1]: value}
    else:
        body[field] = value
    if field == "top_logprobs":
        body["logprobs"] = True
    return json.dumps(body).encode()  # json writes NaN / Infinity literals, as Python clients can


@pytest.mark.parametrize("path,fields,base", [
    ("/chat/completions", CHAT_FIELDS, {"model": "mixtral", "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 1}),
    ("/completions", COMPLETION_FIELDS, {"model": "mixtral", "prompt": "hi", "max_tokens": 1})])
def test_every_numeric_field_is_checked(server, path, fields, base):
    for field, (kind, lo, hi) in fields.items():
        for value in VALUES:
            r = httpx.post(server.v1 + path, content=_body(base, field, value),
                           headers={"Content-Type": "application/json"}, timeout=120)
            if _valid(value, kind, lo, hi):
                assert r.status_code == 200, (field, value, r.text)
                continue
            assert r.status_code == 400, (field, value, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
            assert err["param"] == field and field in err["message"], (field, value, err)
    _still_serving(server)


def _still_serving(server) -> None:
    r = httpx.post(server.v1 + "/chat/completions", json={"model": "mixtral", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "x"}]}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert not [rec for rec in server.records if rec.exc_info or rec.levelno >= logging.ERROR], \
        [rec.getMessage() for rec in server.records]


def _hi(**kw) -> dict:
    return {"model": "mixtral", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **kw}


@pytest.mark.parametrize("raw,param,needle", [
    (b'{"model": "mixtral", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", None, "nested"),
    (b'{"model": "mixtral", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content",
     "lone surrogate (U+D800)"),
    (json.dumps(_hi(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])).encode(),
     "messages.0.content.1", "image input"),
    (json.dumps(_hi(frobnicate=1)).encode(), "frobnicate", "unrecognized"),
    (json.dumps(_hi(stream_options={"include_usage": True})).encode(), "stream_options", "stream"),
    (json.dumps(_hi(top_logprobs=3)).encode(), "top_logprobs", "logprobs"),
    (json.dumps(_hi(n=3)).encode(), "n", "--max-n"),
    (json.dumps(_hi(stop=["a", "b", "c", "d", "e"])).encode(), "stop", "at most 4"),
    (json.dumps(_hi(logit_bias={"9999": 1})).encode(), "logit_bias", "token id"),
    (json.dumps(_hi(audio={"voice": "x", "format": "mp3"})).encode(), "audio", "not supported"),
    (json.dumps(_hi(store=True)).encode(), "store", "not supported"),
    (json.dumps(_hi(messages=[{"role": "tool", "content": "r"}])).encode(), "messages.0.tool_call_id", "required"),
    (json.dumps(_hi(messages=[{"role": "user", "content": "x"}], max_tokens=300)).encode(), "max_tokens",
     "context"),
])
def test_hostile_bodies(server, raw, param, needle):
    r = httpx.post(server.v1 + "/chat/completions", content=raw, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    _still_serving(server)


def test_client_leaving_mid_body_logs_nothing(server):
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 5000\r\n\r\n" + b'{"model": "mixtral", "mess')
    _still_serving(server)


def test_internal_errors_are_counted(server, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("boom")

    def count() -> float:
        text = httpx.get(server.url + "/metrics").text
        line = [x for x in text.splitlines() if x.startswith("moespec_requests_total") and 'status="500"' in x]
        return float(line[0].split()[-1]) if line else 0.0

    before = count()
    monkeypatch.setattr(server.app.state.backend, "chat_ids", broken)
    r = httpx.post(server.v1 + "/chat/completions", json=_hi(), timeout=120)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    wait_until(lambda: count() == before + 1, "the 500 counted")
    # A server fault is logged with its traceback, as it should be (and this proves the log is watched).
    wait_until(lambda: any(rec.exc_info for rec in server.records), "the traceback logged")
    server.records.clear()
    monkeypatch.undo()
    _still_serving(server)
