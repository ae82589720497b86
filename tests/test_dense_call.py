"""Fused dense units (runtime/dense_call.py) and the weights they free (runtime/dense.py).

  - q/k/v fused: q_proj's forward returns what q_proj alone computes, bit for bit, and k_proj / v_proj
    called next with the same x return their own products bit for bit; with another x they compute
    their own;
  - a fused SiLU MLP equals the module's own forward within 1e-6 (libm's expf against torch's);
  - decode logits with fused units equal the reference (each module's own forward, F.linear) within
    1e-5 and give the same greedy tokens, on families with and without shared experts, with
    ``--dense-dtype auto|bf16|int8``, at one thread and by the thread plan at two;
  - the float weights a fused or low-bit copy replaced are on the meta device (host memory holds
    each weight once), the tied embedding keeps its table, and uninstall puts the values back.
"""

from __future__ import annotations

import pytest
import torch
from tiny import GREEDY_PROMPT, engine_steps, make_checkpoint

import moespec.runtime.dense as dense
from moespec.config import Predictor, RuntimeConfig
from moespec.kernels import native
from moespec.runtime import dense_call
from moespec.runtime.load import load_offloaded

needs_kernels = pytest.mark.skipif(native.library() is None, reason="no native CPU kernels here")
FAMILIES = ["qwen2_moe", "qwen3_moe", "deepseek_v3"]


@pytest.fixture
def every_weight(monkeypatch):
    monkeypatch.setattr(dense, "MIN_NATIVE_BYTES", 0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense_call")
    return {f: make_checkpoint(root / f, f, seed=50 + i) for i, f in enumerate(FAMILIES)}



@needs_kernels
def test_qkv_fused_bit_equal(folders, every_weight):
    om = load_offloaded(folders["qwen2_moe"], RuntimeConfig(predictor=Predictor.NONE))
    try:
        attn = om.model.model.layers[0].self_attn
        x = torch.randn(1, 1, attn.q_proj.in_features)
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        path = om.dense
        for mod, got in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v)):
            w = path.weights[mod]
            assert w.data_ptr() != 0 and mod.weight.device.type == "meta"  # a slice of the fused weight
            want = dense.spin.BoundWeight(w).linear(x.view(1, -1))
            if mod.bias is not None:
                want = want + mod.bias
            assert torch.equal(got.view(1, -1), want)
        other = torch.randn(1, 1, attn.q_proj.in_features)
        attn.q_proj(x)
        k2 = attn.k_proj(other)  # not the x q_proj saw: its own product
        torch.testing.assert_close(k2, torch.nn.functional.linear(other, path.weights[attn.k_proj],
                                                                  attn.k_proj.bias), rtol=0, atol=1e-5)
    finally:
        om.close()


@needs_kernels
def test_mlp_fused_close_to_own_forward(folders, every_weight):
    om = load_offloaded(folders["deepseek_v3"], RuntimeConfig(predictor=Predictor.NONE))
    try:
        mlps = dense_call.mlp_groups(om.model, set(om.dense.weights))
        assert mlps and om.dense.fused >= len(mlps)
        mlp = mlps[0][0]
        x = torch.randn(1, 1, mlp.gate_proj.in_features)
        calls = om.dense.calls
        fast = mlp(x)
        assert om.dense.calls == calls + 2  # the fused gate/up and down
        om.dense.reference = True
        ref = mlp(x)
    finally:
        om.close()
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dense_dtype", ["auto", "bf16", "int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_decode_equals_reference(folders, every_weight, family, dense_dtype, threads):
    om = load_offloaded(folders[family], RuntimeConfig(predictor=Predictor.NONE, dense_dtype=dense_dtype))
    before = torch.get_num_threads()
    try:
        assert om.dense.fused > 0
        torch.set_num_threads(threads)
        fast, fast_toks = engine_steps(om, GREEDY_PROMPT, 6)
        om.dense.reference = True
        torch.set_num_threads(1)
        ref, ref_toks = engine_steps(om, GREEDY_PROMPT, 6)
    finally:
        torch.set_num_threads(before)
        om.close()
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-5)
    assert fast_toks == ref_toks


@needs_kernels
@pytest.mark.parametrize("dense_dtype", ["auto", "int8"])
def test_replaced_weights_freed_and_restored(tmp_path, every_weight, dense_dtype):
    folder = make_checkpoint(tmp_path / "tied", "qwen2_moe", tie_word_embeddings=True)
    om = load_offloaded(folder, RuntimeConfig(predictor=Predictor.NONE, dense_dtype=dense_dtype))
    try:
        path, model = om.dense, om.model
        emb = model.get_input_embeddings().weight
        assert model.lm_head.weight.data_ptr() == emb.data_ptr() and emb.device.type == "cpu"
        attn = model.model.layers[0].self_attn
        assert attn.q_proj.weight.device.type == "meta"  # fused (and int8: quantised) copy holds it
        o_meta = attn.o_proj.weight.device.type == "meta"
        assert o_meta == (dense_dtype == "int8")  # auto, not fused: the loaded weight is the stored one
        want = dense.as_dense(path.weights[attn.q_proj], torch.float32).clone()
        path.uninstall()
        assert torch.equal(attn.q_proj.weight, want)
        assert all(p.device.type == "cpu" for p in model.parameters())
    finally:
        om.close()
