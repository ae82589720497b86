"""The one-token whole-model step (runtime/decode_model.py) against transformers' model forward.

  - on every family's tiny model, a conversation (prefill, decode steps, a second turn reusing the
    cache and a crop back) gives the same logits bit for bit with the step and with its reference
    (``ModelStep.reference``: transformers' forward), and the same greedy tokens as transformers;
  - a hook on a module whose ``__call__`` the step bypasses (lm_head, a decoder layer, the model, a
    global hook) sends the step to transformers' forward, so the hook runs; removed, the step is back;
  - an output option set in the config sends it there too.
"""

from __future__ import annotations

import pytest
import torch
from tiny import GREEDY_PROMPT, make_checkpoint, reference_greedy, two_turn_conversation

from moespec.config import Predictor, RuntimeConfig, SamplingConfig
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_model")
    return {f: make_checkpoint(root / f, f, seed=70 + i) for i, f in enumerate(FAMILIES)}


@pytest.mark.parametrize("family", FAMILIES)
def test_step_equals_the_model_forward(folders, family):
    om = load_offloaded(folders[family], RuntimeConfig(predictor=Predictor.ROUTER, cache_experts=6))
    try:
        fast, fast_toks = two_turn_conversation(om)
        assert om.step.calls == 10  # every decode step
        om.step.reference = True
        ref, ref_toks = two_turn_conversation(om)
        assert om.step.calls == 10
    finally:
        om.close()
    assert torch.equal(fast, ref), (fast - ref).abs().max()
    assert fast_toks == ref_toks


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_step_greedy_equals_transformers(folders, family):
    om = load_offloaded(folders[family], RuntimeConfig(predictor=Predictor.NONE))
    try:
        got = list(Engine(om).generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=8)))
        assert om.step.calls == 7
    finally:
        om.close()
    assert got == reference_greedy(folders[family], GREEDY_PROMPT, 8)


@pytest.mark.parametrize("where", ["lm_head", "layer", "model", "global"])
def test_a_hook_sends_the_step_to_the_model_forward(folders, where):
    om = load_offloaded(folders["qwen3_moe"], RuntimeConfig(predictor=Predictor.NONE))
    fired = []
    try:
        if where == "global":
            handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: fired.append(1))
        else:
            target = {"lm_head": om.model.lm_head, "layer": om.model.model.layers[1], "model": om.model}[where]
            handle = target.register_forward_hook(lambda m, a, o: fired.append(1))
        eng = Engine(om)
        logits = eng.prefill(list(GREEDY_PROMPT))
        before = len(fired)
        eng.forward([int(logits.argmax())], "decode")
        assert len(fired) > before and om.step.calls == 0  # the hook ran: transformers' forward
        handle.remove()
        eng.forward([3], "decode")
        assert om.step.calls == 1
    finally:
        om.close()


def test_an_output_option_sends_the_step_to_the_model_forward(folders):
    om = load_offloaded(folders["qwen2_moe"], RuntimeConfig(predictor=Predictor.NONE))
    try:
        eng = Engine(om)
        logits = eng.prefill(list(GREEDY_PROMPT))
        om.config.output_router_logits = True
        eng.forward([int(logits.argmax())], "decode")
        assert om.step.calls == 0  # (transformers then leaves its capture hooks in: the step stays off)
    finally:
        om.close()
