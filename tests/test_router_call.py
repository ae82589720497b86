"""The softmax routers' native selection (runtime/router_call.py) against the routers' own forwards.

  - per router class (Qwen2-MoE, Qwen3-MoE, OLMoE with and without ``norm_topk_prob``, Mixtral), on
    many random one-token inputs: the same logits bit for bit, the same top-k ids, the weights within
    a few ulp; a prefill (several tokens) takes the own forward;
  - on tiny models, a decode run with the native selection gives the logits of its reference within
    1e-5 and the same greedy tokens, and equals transformers' greedy continuation.
"""

from __future__ import annotations

import pytest
import torch
from tiny import GREEDY_PROMPT, make_checkpoint, reference_greedy

from moespec.config import Predictor, RuntimeConfig, SamplingConfig
from moespec.kernels import native
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded
from moespec.runtime.router_call import install_routers

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native CPU kernels here")


def _router(family: str, norm: bool):
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

        return MixtralTopKRouter(MixtralConfig(hidden_size=64, num_local_experts=16, num_experts_per_tok=4))
    mod = {"qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "olmoe": "Olmoe"}[family]
    import importlib

    cfg_cls = getattr(importlib.import_module("transformers"), f"{mod}Config")
    router_cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), f"{mod}TopKRouter")
    return router_cls(cfg_cls(hidden_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_tied_probabilities_take_the_routers_own_choice(family):
    """torch.topk breaks ties by its own sort (an all-zero router picks e.g. experts 10, 11, 12, 9 of
    16), not by the lowest id: a tie inside the top-k or at its edge runs the own forward."""
    router = _router(family, True)
    gen = torch.Generator().manual_seed(7)
    own = type(router).forward
    path = install_routers(router)
    with torch.inference_mode():
        x = torch.randn(1, 64, generator=gen)
        router.weight.zero_()  # every logit 0: all 16 tie
        assert torch.equal(router(x)[2], own(router, x)[2])
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.weight[5] = router.weight[3]  # experts 3 and 5 tie; whether in the top-k or not
        for _ in range(50):
            x = torch.randn(1, 64, generator=gen)
            assert torch.equal(router(x)[2], own(router, x)[2])
    assert path.ties >= 1 and path.calls + path.ties == 51


@pytest.mark.parametrize("family,norm", [("qwen2_moe", True), ("qwen2_moe", False), ("qwen3_moe", True),
                                         ("olmoe", False), ("mixtral", True)])
def test_native_selection_equals_the_routers_own(family, norm):
    router = _router(family, norm)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    own = type(router).forward
    path = install_routers(router)
    assert path.routers == [router]
    with torch.inference_mode():
        for _ in range(200):
            x = torch.randn(1, 64, generator=gen) * 0.5
            logits, w, ids = router(x)
            want_logits, want_w, want_ids = own(router, x)
            assert torch.equal(logits, want_logits)
            assert torch.equal(ids, want_ids)
            assert w.dtype == want_w.dtype == torch.float32
            torch.testing.assert_close(w, want_w, rtol=4e-7, atol=0)
            assert not norm or family == "mixtral" or abs(float(w.sum()) - 1) < 1e-6
        assert path.calls == 200
        router(torch.randn(3, 64, generator=gen))  # a prefill: the own forward
        assert path.calls == 200
    path.uninstall()
    assert "forward" not in router.__dict__


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe"])
def test_decode_with_the_native_selection_equals_its_reference(tmp_path, family):
    folder = make_checkpoint(tmp_path / family, family, seed=31)
    om = load_offloaded(folder, RuntimeConfig(predictor=Predictor.NONE))
    try:
        eng = Engine(om)
        got = list(eng.generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=8)))
        assert om.routers.calls == 7 * len(om.store.moe_layers)
        fast = [eng.forward([t], "decode") for t in (3, 9, 27)]
        om.routers.reference = True
        eng.truncate(len(GREEDY_PROMPT) + 7)
        ref = [eng.forward([t], "decode") for t in (3, 9, 27)]
        want = list(eng.generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=8)))
    finally:
        om.close()
    torch.testing.assert_close(torch.stack(fast), torch.stack(ref), rtol=0, atol=1e-5)
    assert got == want == reference_greedy(folder, GREEDY_PROMPT, 8)
