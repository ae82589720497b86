"""Stop ids: the union of generation_config.json's, config.json's and the tokenizer's eos; an
answer's token count equals transformers `generate` with the checkpoint's defaults."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from tiny import reference_model

from moespec.chat.render import render, stop_ids
from moespec.chat.session import ChatSession
from moespec.config import RuntimeConfig, SamplingConfig
from moespec.errors import CheckpointError
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder


def test_union_of_the_three_sources(tmp_path):
    config = SimpleNamespace(eos_token_id=257, get_text_config=lambda: SimpleNamespace(eos_token_id=258))
    tok = SimpleNamespace(eos_token_id=256)
    assert stop_ids(tmp_path, config, tok) == {256, 257, 258}  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, 300, 301]}))
    assert stop_ids(tmp_path, config, tok) == {256, 257, 258, 300, 301}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 299}))
    assert stop_ids(tmp_path, SimpleNamespace(eos_token_id=None), SimpleNamespace(eos_token_id=None)) == {299}
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="generation_config.json"):
        stop_ids(tmp_path, config, tok)


def test_extra_eos_in_generation_config_stops_like_transformers(tmp_path, tiny_models):
    from transformers import AutoTokenizer

    folder = tmp_path / "m"
    shutil.copytree(tiny_models["qwen2_moe"], folder)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = render(tok, [{"role": "user", "content": "Hello there"}]).ids
    n = 10

    def generate(path):
        with torch.no_grad():
            out = reference_model(path).generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        return out[0, len(ids):].tolist()

    free = generate(folder)
    assert len(free) == n and 256 not in free  # the random model never ends by itself here
    stop = free[3]  # an end-of-turn id only generation_config.json knows (like Qwen3's <|im_end|>)
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [256, stop]
    gen_path.write_text(json.dumps(gen))
    want = generate(folder)
    assert want == free[: free.index(stop) + 1]  # transformers stops at (and counts) the extra id

    om = load_offloaded(folder, RuntimeConfig(cache_experts=6), StatsRecorder())
    try:
        session = ChatSession(Engine(om), tok, SamplingConfig(max_new_tokens=n))
        "".join(session.send("Hello there"))
    finally:
        om.close()
    assert session.last.token_ids == want[:-1]  # the stop id is not part of the answer
    assert session.last.summary.new_tokens == len(want)  # ... but counts as generated, as in transformers
    assert session.history[-1]["content"] == tok.decode(want[:-1], skip_special_tokens=True)
