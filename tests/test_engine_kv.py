"""KV-cache prefix reuse: a prefill after an earlier one equals transformers on the whole new prompt.

Divergence at the first token, in the middle, and past a sliding window, on every architecture
(full attention, MLA, GPT-OSS / Mixtral sliding windows), with past recording (the fast crop) and
without it (transformers 5.17's sliding layers: the engine must re-prefill).
"""

from __future__ import annotations

import pytest
import torch
from tiny import make_checkpoint, reference_model

from moespec.config import Predictor, RuntimeConfig
from moespec.runtime import kv as kvcache
from moespec.runtime.engine import Engine, _cache_kwarg
from moespec.runtime.load import load_offloaded

FULL = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
ADAPTERS = ["gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe_lite"]


@pytest.fixture(scope="module")
def sliding_models(tmp_path_factory):
    """Sliding-window checkpoints: Mixtral (window 6) and GPT-OSS with a window of 16."""
    root = tmp_path_factory.mktemp("sliding")
    return {"mixtral_sw6": make_checkpoint(root / "mixtral_sw6", "mixtral", seed=3, sliding_window=6),
            "gpt_oss_sw16": make_checkpoint(root / "gpt_oss_sw16", "gpt_oss", seed=4, sliding_window=16)}


@pytest.fixture
def folder_of(tiny_models, adapter_models, sliding_models):
    return lambda family: {**tiny_models, **adapter_models, **sliding_models}[family]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


BASE = _ids(20, 1)
DECODE = _ids(3, 9)  # the "answer" decoded after BASE
# (name, second prompt, tokens that may be reused = the common prefix with BASE + DECODE)
CASES = [
    ("extends_cache", BASE + DECODE + _ids(4, 6), 23),
    ("extends", BASE + _ids(5, 2), 20),
    ("first_token", [(BASE[0] + 1) % 256] + BASE[1:] + _ids(3, 3), 0),
    ("middle", BASE[:9] + _ids(8, 4), 9),
    ("near_end", BASE[:18] + _ids(4, 5), 18),
    ("same_prompt", list(BASE), 19),  # one token must run again to produce logits
    ("shorter", BASE[:12], 11),
]


def _reuse_after_each_case(folder) -> dict[str, int]:
    """For each case: prefill BASE, decode DECODE, prefill the case's prompt, decode one token;
    both logits must equal transformers on the whole sequence. Returns case -> reused tokens."""
    ref = reference_model(folder)
    om = load_offloaded(folder, RuntimeConfig(cache_experts=6, predictor=Predictor.ROUTER))
    reused = {}
    try:
        engine = Engine(om)
        for name, second, _ in CASES:
            engine.reset()
            engine.prefill(BASE)
            for t in DECODE:  # a short answer: decode steps extend the cache
                engine.forward([t], "decode")
            got = engine.prefill(second)
            reused[name] = engine.reused_tokens
            # The cache now holds exactly ``second``: the next step equals transformers too.
            nxt = engine.forward([7], "decode")
            with torch.no_grad():
                want = ref(torch.tensor([second + [7]])).logits[0, -2:]  # [2, V]
            assert torch.allclose(got, want[0], atol=1e-5, rtol=0), (name, (got - want[0]).abs().max())
            assert torch.allclose(nxt, want[1], atol=1e-5, rtol=0), (name, (nxt - want[1]).abs().max())
    finally:
        om.close()
    return reused


@pytest.mark.parametrize("family", FULL + ADAPTERS + ["mixtral_sw6", "gpt_oss_sw16"])
def test_second_prefill_equals_transformers(folder_of, family):
    """With past recording (transformers 5.24) every cache layer class here is cut to the common prefix."""
    reused = _reuse_after_each_case(folder_of(family))
    assert reused == {name: common for name, _, common in CASES}


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral_sw6", "gpt_oss_sw16"])
def test_without_past_recording_sliding_layers_reprefill(folder_of, monkeypatch, family):
    """transformers 5.17's sliding layers cannot record the past: past the window the engine must
    prefill from scratch, and stay exact."""
    monkeypatch.setattr(kvcache, "record_past", lambda kv: None)
    window = {"gpt_oss": 4, "mixtral_sw6": 6, "gpt_oss_sw16": 16}[family]
    seen = len(BASE) + len(DECODE)
    assert seen >= window
    reused = _reuse_after_each_case(folder_of(family))
    # A plain extension works on every layer class; any cut past the window starts from scratch.
    assert reused == {name: common if common == seen else 0 for name, _, common in CASES}


def test_can_cut_by_layer_class():
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    def filled(layer, n):
        layer.update(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2))
        return layer

    full = filled(DynamicLayer(), 10)
    assert kvcache.can_cut(full, 10) and kvcache.truncate(type("KV", (), {"layers": [full]})(), 3)
    assert full.get_seq_length() == 3
    young = filled(DynamicSlidingWindowLayer(sliding_window=8), 5)
    assert kvcache.can_cut(young, 4)
    old = filled(DynamicSlidingWindowLayer(sliding_window=8), 12)
    assert not kvcache.can_cut(old, 1) and kvcache.can_cut(old, 0)
    rec = DynamicSlidingWindowLayer(sliding_window=8)
    rec.activate_past_recording()
    filled(rec, 12)  # holds all 12
    assert kvcache.can_cut(rec, 12 - 3)  # holds all 12: any cut
    rec.crop(-2)  # to 10: restricted to the last 7 positions [3, 10)
    assert kvcache.can_cut(rec, 0) and not kvcache.can_cut(rec, 1)
    filled(rec, 4)  # 14 seen, holds [3, 14)
    assert kvcache.can_cut(rec, 4) and not kvcache.can_cut(rec, 5)

    class Other(DynamicLayer):  # an unknown subclass may keep more state: never cut
        pass

    assert not kvcache.can_cut(filled(Other(), 4), 1)
    mixed = type("KV", (), {"layers": [filled(DynamicLayer(), 12), old]})()
    assert not kvcache.truncate(mixed, 6)
    assert mixed.layers[0].get_seq_length() == 12  # nothing half-cut


def test_cache_kwarg_follows_the_forward_signature():
    class New:
        def forward(self, input_ids=None, cache=None):
            pass

    class Old:
        def forward(self, input_ids=None, past_key_values=None):
            pass

    assert _cache_kwarg(New()) == "cache"
    assert _cache_kwarg(Old()) == "past_key_values"


def test_reset_and_nothing_shared_drop_the_cache(tiny_models):
    om = load_offloaded(tiny_models["qwen3_moe"], RuntimeConfig())
    try:
        engine = Engine(om)
        engine.prefill(BASE)
        old = engine._kv
        engine.prefill([(BASE[0] + 1) % 256] + BASE[1:])
        assert engine._kv is not old and engine.reused_tokens == 0
        assert engine._kv.get_seq_length() == len(BASE) == len(engine.cached_ids)
    finally:
        om.close()
