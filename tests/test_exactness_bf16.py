"""bf16 `exact` mode equals transformers' DEFAULT experts implementation (not the eager loop).

transformers 5 loads MoE models with ``experts_implementation="grouped_mm"`` unless told otherwise;
it sums the K weighted expert outputs of a token in float32 and rounds once (runtime/layer/experts.py). The
reference here is ``from_pretrained(dtype=bfloat16)`` with no experts_implementation, run with the
same prefill/decode schedule as moespec. Stated tolerance: logits within BF16_ATOL (one bf16 ulp
near the largest tiny-model logits; measured: bit-equal on CPU), greedy tokens equal over 64
tokens, for every architecture adapter (top-4 models, on which the eager loop, rounding after each
expert, is measurably further away: the test tells the two sums apart).
"""

from __future__ import annotations

import pytest
import torch
from test_exactness import _incremental_logits
from tiny import make_checkpoint

from moespec.config import Predictor, RuntimeConfig, SamplingConfig
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded

BF16_ATOL = 1 / 64  # bf16 spacing at |logit| in [2, 4): one ulp
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
ADAPTERS = ["gpt_oss", "gpt_oss_mxfp4", "deepseek_v2", "deepseek_v3", "glm4_moe_lite"]


@pytest.fixture(scope="module")
def bf16_models(tmp_path_factory) -> dict:
    """Every family's tiny checkpoint with top-4 routing (8 experts): with bf16 gate weights a top-2
    sum rounds once either way, so only K > 2 tells the default sum from the eager one everywhere."""
    from tiny import make_mxfp4_checkpoint

    root = tmp_path_factory.mktemp("bf16")
    out = {f: make_checkpoint(root / f, f, seed=30 + i, top_k=4) for i, f in enumerate(FAMILIES + ADAPTERS)
           if f != "gpt_oss_mxfp4"}
    out["gpt_oss_mxfp4"] = make_mxfp4_checkpoint(root / "gpt_oss_mxfp4", seed=40, top_k=4)
    return out


def _reference(folder, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **kw).eval()


def _reference_incremental(ref, ids: torch.Tensor) -> torch.Tensor:
    """The reference's logits [1, T, V] with moespec's schedule: prefill 5 tokens, then one at a time."""
    from transformers import DynamicCache

    kv = DynamicCache(config=ref.config)
    with torch.no_grad():
        outs = [ref(ids[:, :5], cache=kv, use_cache=True).logits]
        for t in range(5, ids.shape[1]):
            outs.append(ref(ids[:, t : t + 1], cache=kv, use_cache=True).logits)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("family", FAMILIES + ADAPTERS)
def test_bf16_logits_and_64_greedy_tokens_equal_default_implementation(bf16_models, family):
    folder = bf16_models[family]
    ref = _reference(folder)
    assert ref.config._experts_implementation == "grouped_mm"  # transformers' default
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_full = ref(ids).logits.float()
    want_inc = _reference_incremental(ref, ids).float()
    with torch.no_grad():
        eager = _reference(folder, experts_implementation="eager")(ids).logits.float()
    gap = (eager - want_full).abs().max()
    assert gap > 0  # the test can tell the two sums apart on this model
    prompt = [5, 17, 99, 3, 200, 41]
    with torch.no_grad():
        want_tokens = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()
    k = ref.config.num_experts_per_tok
    om = load_offloaded(folder, RuntimeConfig(dtype="bfloat16", cache_experts=2 * k + 1, predictor=Predictor.ROUTER))
    try:
        with torch.inference_mode():
            full = om.model(ids).logits.float()
        inc = _incremental_logits(om, ids).float()
        tokens = list(Engine(om).generate(prompt, SamplingConfig(max_new_tokens=64)))
    finally:
        om.close()
    assert (full - want_full).abs().max() <= min(BF16_ATOL, gap / 2), (family, (full - want_full).abs().max(), gap)
    assert (inc - want_inc).abs().max() <= BF16_ATOL, (family, (inc - want_inc).abs().max())
    assert tokens == want_tokens
