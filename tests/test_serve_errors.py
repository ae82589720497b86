"""Bad input to `moespec serve` gets OpenAI-shaped errors (400/401/404/413) and the server keeps
serving; the CLI refuses a reachable host without --api-key; the parts that need no model."""

from __future__ import annotations

import httpx2 as httpx  # the HTTP client the openai package depends on
import pytest
from serve_harness import serve
from typer.testing import CliRunner

from moespec.chat.detok import IncrementalDecoder
from moespec.cli.app import app as cli
from moespec.serve.app import ServeSettings
from moespec.serve.security import is_loopback
from moespec.serve.stops import StopMatcher

openai = pytest.importorskip("openai")
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(tiny_models):
    with serve(tiny_models["mixtral"], ServeSettings(api_key=KEY, max_body_bytes=4096)) as running:
        yield running


def _post(server, path: str, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.v1 + path, headers=headers, timeout=120, **kw)


def _chat_body(**kw) -> dict:
    return {"model": "mixtral", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _still_serving(server) -> None:
    r = _post(server, "/chat/completions", json=_chat_body())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("content,status,needle,param", [
    (b"{not json", 400, "not valid JSON", None),
    (b"[1, 2]", 400, "JSON object", None),
    (b'{"model": "mixtral"}', 400, "'messages' is a required field", "messages"),
    (b'{"model": "mixtral", "messages": []}', 400, "messages", "messages"),
    (b'{"model": "mixtral", "messages": [{"role": "robot", "content": "x"}]}', 400, "role", "messages.0.role"),
    (b'{"model": "mixtral", "messages": [{"role": "user", "content": "x"}], "temperature": -0.5}', 400,
     "greater than or equal to 0", "temperature"),
    (b'{"model": "mixtral", "messages": [{"role": "user", "content": "x"}], "n": 9}', 400, "--max-n", "n"),
    (b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}', 404, "'gpt-4o' does not exist", "model"),
])
def test_bad_requests(server, content, status, needle, param):
    err = _error(_post(server, "/chat/completions", content=content), status)
    assert needle in err["message"] and err["param"] == param
    _still_serving(server)


def test_prompt_beyond_context_names_the_limit(server):
    long = _chat_body(messages=[{"role": "user", "content": "x" * 300}])
    err = _error(_post(server, "/chat/completions", json=long), 400)
    assert "context is 256 tokens" in err["message"] and err["code"] == "context_length_exceeded"
    err = _error(_post(server, "/completions", json={"model": "mixtral", "prompt": "y" * 256}), 400)
    assert "256 tokens" in err["message"] and err["param"] == "prompt"
    _still_serving(server)


def test_api_key_is_required(server):
    for key in (None, "wrong", KEY + "x"):
        err = _error(_post(server, "/chat/completions", key=key, json=_chat_body()), 401)
        assert err["code"] == "invalid_api_key"
    assert httpx.get(server.v1 + "/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # health checks need no key
    client = openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    ok = openai.OpenAI(base_url=server.v1, api_key=KEY, max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError):
        ok.chat.completions.create(model="mixtral", messages=[{"role": "user", "content": "x"}], temperature=-1)
    with pytest.raises(openai.NotFoundError):
        ok.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert ok.chat.completions.create(model="mixtral", messages=[{"role": "user", "content": "x"}],
                                      max_tokens=2).usage.completion_tokens == 2


def test_body_size_limit(server):
    big = _chat_body(messages=[{"role": "user", "content": "x" * 5000}])
    err = _error(_post(server, "/chat/completions", json=big), 413)
    assert "4096 bytes" in err["message"]

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"model": "mixtral", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}]}'

    _error(_post(server, "/chat/completions", content=chunks()), 413)
    _error(httpx.get(server.url + "/no/such/path", headers={"Authorization": f"Bearer {KEY}"}), 404)
    _still_serving(server)


def test_cli_refuses_reachable_host_without_key(tiny_models):
    r = CliRunner().invoke(cli, ["serve", str(tiny_models["mixtral"]), "--host", "0.0.0.0"],
                           env={"MOESPEC_API_KEY": ""})
    assert r.exit_code == 2 and "--api-key" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(cli, ["serve", "--max-queue", "-1"])
    assert r.exit_code == 2 and "--max-queue -1" in r.output
    for n in ("0", "129"):
        r = CliRunner().invoke(cli, ["serve", "--max-n", n])
        assert r.exit_code == 2 and f"--max-n {n}" in r.output and "Traceback" not in r.output


def test_help_shows_the_openai_client_example():
    r = CliRunner().invoke(cli, ["serve", "--help"], env={"COLUMNS": "80"})
    assert r.exit_code == 0
    assert "from openai import OpenAI" in r.output and "chat.completions.create" in r.output
    assert max(len(line) for line in r.output.splitlines()) <= 80


@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True),
                                       ("0.0.0.0", False), ("192.168.1.5", False), ("::", False),
                                       ("example.com", False)])
def test_is_loopback(host, loop):
    assert is_loopback(host) is loop


@pytest.mark.parametrize("pieces,stops,want,matched", [
    (["ab", "c", "STO", "P", "tail"], ("STOP",), "abc", True),
    (["abST", "x"], ("STOP",), "abSTx", False),
    (["S", "T", "O"], ("STOP",), "STO", False),  # held back, released at the end
    (["xx", "yEN", "Dzz"], ("END", "yE"), "xx", True),  # the earliest match wins
    (["plain"], (), "plain", False),
])
def test_stop_matcher(pieces, stops, want, matched):
    m, out, hit = StopMatcher(stops), [], False
    for p in pieces:
        text, hit = m.push(p)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    assert "".join(out) == want and hit is matched


def test_incremental_decoder_holds_split_characters(tmp_path):
    from tiny import make_tokenizer

    tok = make_tokenizer(tmp_path)
    ids = tok("h\u00e9\U0001F600!")["input_ids"]  # 1 + 2 + 4 + 1 byte tokens
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    assert pieces == ["h", "", "\u00e9", "", "", "", "\U0001F600", "!"] and dec.flush() == ""
    assert "".join(pieces) == tok.decode(ids)
