"""The lean decode step of a decoder layer (runtime/decode_layer.py) against the layers' own forwards.

  - on Qwen3-MoE (per-head q/k norms), Qwen2-MoE (q/k/v biases) and Mixtral tiny models, every
    decode step runs the lean step, and the logits over a prefill, decode steps, a second turn that
    reuses the cache and a crop back equal the own forwards' bit for bit, tokens alike, with native
    dense linears (fused q/k/v) and with torch's;
  - families whose attention is not lean (OLMoE, GPT-OSS, DeepSeek) keep their own forwards;
  - a masked call, a prefill or an unknown keyword argument goes to the layer's own forward.
"""

from __future__ import annotations

import pytest
import torch
from tiny import GREEDY_PROMPT, make_checkpoint, two_turn_conversation

from moespec.config import Predictor, RuntimeConfig
from moespec.runtime import dense
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded

LEAN = ["qwen3_moe", "qwen2_moe", "mixtral"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_layer")
    fams = LEAN + ["olmoe", "gpt_oss", "deepseek_v3"]
    return {f: make_checkpoint(root / f, f, seed=90 + i) for i, f in enumerate(fams)}


@pytest.mark.parametrize("family", LEAN)
@pytest.mark.parametrize("native_dense", [True, False])
def test_lean_equals_own_forward(folders, family, native_dense, monkeypatch):
    if native_dense:
        monkeypatch.setattr(dense, "MIN_NATIVE_BYTES", 0)  # every linear through the native GEMV
    om = load_offloaded(folders[family], RuntimeConfig(predictor=Predictor.ROUTER, cache_experts=6))
    try:
        assert len(om.decode.layers) == len(om.model.model.layers)
        fast, fast_toks = two_turn_conversation(om)
        assert om.decode.calls == 10 * len(om.decode.layers)  # every decode step of every layer
        om.decode.reference = True
        ref, ref_toks = two_turn_conversation(om)
        assert om.decode.calls == 10 * len(om.decode.layers)
    finally:
        om.close()
    assert torch.equal(fast, ref)
    assert fast_toks == ref_toks


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss", "deepseek_v3"])
def test_other_families_keep_their_forwards(folders, family):
    om = load_offloaded(folders[family], RuntimeConfig(predictor=Predictor.NONE))
    try:
        assert om.decode.layers == []
        assert all("forward" not in layer.__dict__ for layer in om.model.model.layers)
    finally:
        om.close()


def test_unusual_calls_go_to_own_forward(folders, monkeypatch):
    from moespec.runtime import decode_layer

    om = load_offloaded(folders["qwen3_moe"], RuntimeConfig(predictor=Predictor.NONE))
    try:
        eng = Engine(om)
        eng.prefill(list(GREEDY_PROMPT))  # a prefill: the own forwards
        assert om.decode.calls == 0
        layer = om.model.model.layers[0]
        seen = []
        own = type(layer).forward

        def spy(self, *args, **kwargs):
            seen.append(sorted(kwargs))
            return own(self, *args, **kwargs)

        om.decode.uninstall()
        monkeypatch.setattr(type(layer), "forward", spy)
        path = decode_layer.install_decode_layers(om.model)  # over the spy
        h = torch.randn(1, 1, om.config.hidden_size)
        n = len(GREEDY_PROMPT)
        pe = om.model.model.rotary_emb(h, torch.tensor([[n]]))
        with torch.inference_mode():
            layer(h, attention_mask=torch.zeros(1, 1, 1, n + 1), position_embeddings=pe, cache=eng._kv)
            layer(h, position_embeddings=pe, cache=eng._kv, output_attentions=True)
            layer(h, position_embeddings=pe, cache=None)
            assert path.calls == 0 and len(seen) == 3
            layer(h, position_embeddings=pe, cache=eng._kv, output_router_logits=False)  # a plain decode call: the lean step
        assert path.calls == 1 and len(seen) == 3
        path.uninstall()
    finally:
        om.close()


@pytest.mark.parametrize("where", ["mlp", "q_proj", "global"])
def test_a_forward_hook_sends_the_step_to_the_own_forward(folders, where):
    """A hook on a module the lean step would call past nn.Module.__call__ (here the MoE block or a
    projection; or a global module hook) still runs: the step takes the layer's own forward."""
    om = load_offloaded(folders["qwen3_moe"], RuntimeConfig(predictor=Predictor.ROUTER, cache_experts=6))
    fired = []
    layer = om.model.model.layers[1]
    try:
        if where == "global":
            handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: fired.append(1))
        else:
            target = layer.mlp if where == "mlp" else layer.self_attn.q_proj
            handle = target.register_forward_pre_hook(lambda m, a: fired.append(1))
        eng = Engine(om)
        logits = eng.prefill(list(GREEDY_PROMPT))
        before, calls = len(fired), om.decode.calls
        eng.forward([int(logits.argmax())], "decode")
        assert len(fired) > before  # the hook ran on the decode step
        hooked_layers = len(om.decode.layers) if where == "global" else 1
        assert om.decode.calls == calls + len(om.decode.layers) - hooked_layers  # the others stay lean
        handle.remove()
        eng.forward([3], "decode")
        assert om.decode.calls == calls + 2 * len(om.decode.layers) - hooked_layers  # lean again
    finally:
        om.close()
