"""Native RMSNorm (kernels/norm.py, csrc/norm.c) and the model's norms through it (runtime/norm_call.py).

  - the kernel equals transformers' formula within a few ulp for row counts and widths that are and
    are not multiples of 8, per-head shapes included;
  - it applies only to float32 CPU tensors with a matching [H] weight;
  - on every family's tiny model the norms run natively at decode and prefill, and the logits equal
    the norms' own forwards within 1e-5 with the same greedy tokens, with a predictor that reads r_l;
  - r_l is recorded by the post-attention norm itself: no forward pre-hook is left on any norm, and
    the recorded tensor is that norm's input.
"""

from __future__ import annotations

import pytest
import torch
from tiny import GREEDY_PROMPT, engine_steps, make_checkpoint

from moespec.config import Predictor, RuntimeConfig
from moespec.kernels import native
from moespec.kernels import norm as kn
from moespec.runtime.load import load_offloaded

needs_kernels = pytest.mark.skipif(native.library() is None, reason="no native CPU kernels here")
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("norms")
    return {f: make_checkpoint(root / f, f, seed=70 + i) for i, f in enumerate(FAMILIES)}


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 576), (1, 1, 37), (3, 4, 64), (17, 8)])
def test_kernel_equals_reference(shape):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=gen) * 3
    w = torch.randn(shape[-1], generator=gen)
    got = kn.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape
    torch.testing.assert_close(got, kn.rms_norm_reference(x, w, 1e-6), rtol=2e-6, atol=1e-6)


@needs_kernels
def test_applies_only_to_float32_cpu():
    x, w = torch.randn(1, 8), torch.randn(8)
    assert kn.applies(x, w)
    assert not kn.applies(x.bfloat16(), w.bfloat16())
    assert not kn.applies(x, torch.randn(9))
    assert not kn.applies(x, torch.randn(16)[::2])



@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_native_norms_equal_own_forward(folders, family):
    om = load_offloaded(folders[family], RuntimeConfig(predictor=Predictor.ROUTER, cache_experts=6))
    try:
        assert om.norms.norms
        fast, fast_toks = engine_steps(om, GREEDY_PROMPT, 6)
        assert om.norms.calls > 0
        om.norms.reference = True
        calls = om.norms.calls
        ref, ref_toks = engine_steps(om, GREEDY_PROMPT, 6)
        assert om.norms.calls == calls
    finally:
        om.close()
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-5)
    assert fast_toks == ref_toks


def test_residual_recorded_without_hooks(folders):
    om = load_offloaded(folders["qwen2_moe"], RuntimeConfig(predictor=Predictor.NONE))
    try:
        layers = om.model.model.layers
        assert all(not m._forward_pre_hooks for layer in layers for m in layer.modules())
        norm = layers[1].post_attention_layernorm
        x = torch.randn(1, 1, norm.weight.shape[0])
        norm(x)
        assert om.runner.residual[1] is x
    finally:
        om.close()
