"""The embedded default model with its experts on disk (`--host-memory` below the experts' size).

Issue 27: it answers the README question as from RAM (the same greedy text), and its REPL, Ctrl-C and
serve work as from RAM. 64 MiB holds 121 of its 480 expert rows (265 MB of experts, a row's stride 540 KiB);
the store file is written once into the moespec home and then only read with O_DIRECT.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moespec.cli.app import app as cli

QUESTION = "What is the capital of France?"
HOST = "64MiB"
TOKENS = "16"


def _chat(*args, input=None):
    r = CliRunner().invoke(cli, ["chat", *args, "--device", "cpu", "--max-new-tokens", TOKENS], input=input)
    assert r.exit_code == 0, r.output
    return r


@pytest.fixture(scope="module")
def from_ram(default_model):
    """The one-shot JSON answer with every expert in RAM (the reference)."""
    return json.loads(_chat("--prompt", QUESTION, "--json").stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_readme_question_from_disk_is_answered_as_from_ram(from_ram):
    got = json.loads(_chat("--prompt", QUESTION, "--json", "--host-memory", HOST).stdout.strip().splitlines()[-1])
    disk = got["stats"]["disk"]
    assert disk["o_direct"] and disk["ram_tier_rows"] == 121 and disk["disk_reads"] > 0  # 64 MiB // 540 KiB rows
    assert disk["disk_mb_per_token"] > 0 and disk["disk_read_gbps"] > 0
    assert "paris" in got["text"].lower()
    assert got["text"] == from_ram["text"]
    assert from_ram["stats"].get("disk") is None  # the reference did not read from disk


@pytest.mark.slow
def test_the_repl_from_disk_answers_and_shows_its_stats(from_ram):
    r = _chat("--host-memory", HOST, input=f"{QUESTION}\n/stats\n/exit\n")
    assert from_ram["text"].strip() in r.output
    assert "per layer" in r.output and r.output.count("TPOT") == 1


@pytest.mark.slow
def test_ctrl_c_from_disk_then_the_next_turn_equals_a_fresh_session(default_model):
    from test_chat_interrupt import InterruptAt
    from transformers import AutoTokenizer

    from moespec.chat.session import ChatSession
    from moespec.config import Predictor, RuntimeConfig, SamplingConfig, parse_bytes
    from moespec.runtime.engine import Engine
    from moespec.runtime.load import load_offloaded

    tok = AutoTokenizer.from_pretrained(default_model)

    def session(**kw):
        om = load_offloaded(default_model, RuntimeConfig(predictor=Predictor.ROUTER, **kw))
        return ChatSession(Engine(om), tok, SamplingConfig(max_new_tokens=8))

    disk, ram = session(host_memory_bytes=parse_bytes(HOST)), session(cache_experts=120)
    try:
        engine = disk.engine.om.cache.engine
        with disk.engine.om.observing(InterruptAt(5, 4 * 3)), pytest.raises(KeyboardInterrupt):
            "".join(disk.send(QUESTION))  # the interrupt: layer 5's experts, the third forward (decode)
        assert disk.last.interrupted and engine._pending == 0
        assert disk.engine.om.cache.evictable() == disk.engine.om.cache.num_slots  # no pin left
        ram.history = [dict(m) for m in disk.history]
        assert "".join(disk.send("And Spain?")) == "".join(ram.send("And Spain?"))
        assert disk.last.token_ids == ram.last.token_ids
    finally:
        disk.engine.om.close()
        ram.engine.om.close()


@pytest.mark.slow
def test_serve_from_disk_answers_as_chat_from_ram(default_model, from_ram):
    import httpx2 as httpx
    from serve_harness import serve

    from moespec.config import RuntimeConfig, parse_bytes
    from moespec.serve.app import ServeSettings

    cfg = RuntimeConfig(device="cpu", host_memory_bytes=parse_bytes(HOST))
    with serve(default_model, ServeSettings(max_queue=2), cfg) as s:
        body = {"model": s.app.state.backend.name, "max_tokens": int(TOKENS), "temperature": 0,
                "messages": [{"role": "user", "content": QUESTION}]}
        got = httpx.post(s.v1 + "/chat/completions", json=body, timeout=300).json()
        metrics = httpx.get(s.url + "/metrics", timeout=30).text
    assert got["choices"][0]["message"]["content"] == from_ram["text"]
    line = next(ln for ln in metrics.splitlines() if ln.startswith("moespec_disk_read_bytes "))
    assert float(line.split()[1]) > 0
