"""The dense linears' native decode path (runtime/dense.py) equals F.linear on the same weights:
logits within 1e-5 and the same greedy tokens, on every architecture's tiny model, for the checkpoint's
float32 weights and for ``--dense-dtype bf16|int8`` (exact for the quantised model); float32 also
equals plain transformers; a tied embedding keeps its float table; bad values are one-line errors.
"""

from __future__ import annotations

import pytest
import torch
from tiny import GREEDY_PROMPT, engine_steps, make_checkpoint, reference_greedy, reference_model

import moespec.runtime.dense as dense
from moespec.config import Predictor, RuntimeConfig, SamplingConfig
from moespec.errors import OptionError
from moespec.kernels import native
from moespec.kernels.lowbit import LowBitWeight
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3"]
needs_kernels = pytest.mark.skipif(native.library() is None, reason="no native CPU kernels here")


@pytest.fixture
def every_weight(monkeypatch):
    """Tiny models' weights are a few KB: wrap every one of them."""
    monkeypatch.setattr(dense, "MIN_NATIVE_BYTES", 0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    return {f: make_checkpoint(root / f, f, seed=30 + i) for i, f in enumerate(FAMILIES)}



@needs_kernels
@pytest.mark.parametrize("dense_dtype", ["auto", "bf16", "int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_native_equals_reference(folders, every_weight, family, dense_dtype):
    om = load_offloaded(folders[family], RuntimeConfig(predictor=Predictor.ROUTER, cache_experts=6,
                                                       dense_dtype=dense_dtype))
    try:
        assert om.dense.native and "lm_head" in om.dense.native
        fast, fast_toks = engine_steps(om, GREEDY_PROMPT, 8)
        assert om.dense.calls > 0  # the native GEMV ran
        om.dense.reference = True
        calls = om.dense.calls
        ref, ref_toks = engine_steps(om, GREEDY_PROMPT, 8)
        assert om.dense.calls == calls  # and the reference did not
    finally:
        om.close()
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-5)
    assert fast_toks == ref_toks
    for w in om.dense.weights.values():
        if isinstance(w, LowBitWeight):
            assert dense_dtype == "int8"
        else:  # int8 leaves float only a weight whose C is not a multiple of 16 (DeepSeek's MLA)
            assert w.dtype == (torch.bfloat16 if dense_dtype == "bf16" else torch.float32)
            assert dense_dtype != "int8" or w.shape[1] % 16


@needs_kernels
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_float32_native_equals_transformers(folders, every_weight, family):
    cfg = RuntimeConfig(predictor=Predictor.NONE)
    om = load_offloaded(folders[family], cfg)
    try:
        got = list(Engine(om).generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=10)))
        assert om.dense.calls > 0
        ids = torch.tensor([GREEDY_PROMPT + got])
        logits, _ = engine_steps(om, GREEDY_PROMPT, 0)
    finally:
        om.close()
    with torch.no_grad():
        want = reference_model(folders[family])(ids).logits[0, len(GREEDY_PROMPT) - 1]
    torch.testing.assert_close(logits[0], want, rtol=0, atol=1e-5)
    assert got == reference_greedy(folders[family], GREEDY_PROMPT, 10)


@needs_kernels
def test_tied_embedding_keeps_its_float_table(tmp_path, every_weight):
    folder = make_checkpoint(tmp_path / "tied", "qwen3_moe", tie_word_embeddings=True)
    om = load_offloaded(folder, RuntimeConfig(predictor=Predictor.NONE, dense_dtype="int8"))
    try:
        emb = om.model.get_input_embeddings().weight
        assert emb.dtype == torch.float32 and om.model.lm_head.weight.data_ptr() == emb.data_ptr()
        head = om.dense.weights[om.model.lm_head]
        assert isinstance(head, LowBitWeight)
        assert om.dense.bytes_read(om.model.lm_head) < emb.numel() * 4 * 0.3  # int8 codes + scales + zeros
        fast, _ = engine_steps(om, GREEDY_PROMPT, 3)
        om.dense.reference = True
        ref, _ = engine_steps(om, GREEDY_PROMPT, 3)
    finally:
        om.close()
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dense_dtype", ["auto", "int8"])
def test_compiled_native_equals_eager(folders, every_weight, dense_dtype, monkeypatch):
    """--compile on with the native dense path (a custom op inside the compiled segments): the
    five-turn conversation of tests/test_compile.py, logits within 1e-5, greedy equal, no failure."""
    import test_compile

    def load(folder, mode):
        return load_offloaded(folder, RuntimeConfig(predictor=Predictor.ROUTER, cache_experts=6, compile=mode,
                                                    dense_dtype=dense_dtype))

    monkeypatch.setattr(test_compile, "_load", load)
    assert test_compile._conversation(folders["qwen2_moe"]) > 0


@needs_kernels
def test_bf16_weights_at_two_threads(folders, every_weight):
    """Several intra-op threads send float weights back to F.linear (kernels.linear.plan): a bf16
    weight under float32 compute must then be converted, and the logits stay the reference's."""
    om = load_offloaded(folders["qwen2_moe"], RuntimeConfig(predictor=Predictor.NONE, dense_dtype="bf16"))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fast, _ = engine_steps(om, GREEDY_PROMPT, 3)
        om.dense.reference = True
        ref, _ = engine_steps(om, GREEDY_PROMPT, 3)
    finally:
        torch.set_num_threads(before)
        om.close()
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-5)


def test_small_weights_stay_as_they_are(folders):
    """At the default threshold a tiny model's weights keep their own forward (F.linear, float)."""
    om = load_offloaded(folders["qwen2_moe"], RuntimeConfig(predictor=Predictor.NONE, dense_dtype="int8"))
    try:
        assert not om.dense.native and all("forward" not in vars(m) for m in om.model.modules()
                                           if isinstance(m, torch.nn.Linear))
    finally:
        om.close()


def test_uninstall_restores_the_forwards(folders, every_weight):
    om = load_offloaded(folders["qwen2_moe"], RuntimeConfig(predictor=Predictor.NONE))
    try:
        assert "forward" in vars(om.model.lm_head)
        om.dense.uninstall()
        assert "forward" not in vars(om.model.lm_head)
    finally:
        om.close()


def test_bad_values_are_one_line_errors():
    with pytest.raises(OptionError, match="--dense-dtype 'fp8' is not valid"):
        RuntimeConfig(dense_dtype="fp8")
    with pytest.raises(OptionError, match="wider than the compute dtype bfloat16"):
        dense.resolve_dense_dtype("float32", torch.bfloat16, torch.device("cpu"))
    with pytest.raises(OptionError, match="runs on the CPU kernels, not on cuda"):
        dense.resolve_dense_dtype("int8", torch.float32, torch.device("cuda"))
    assert dense.resolve_dense_dtype("bf16", torch.bfloat16, torch.device("cuda")) is None  # = the compute dtype
    assert dense.resolve_dense_dtype("auto", torch.float32, torch.device("cpu")) is None


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("dense_dtype", ["auto", "int8"])
def test_default_model_native_equals_reference(default_model, dense_dtype):
    """The default model: greedy tokens equal and logits close (|logits| ~ 20 here, float32 sums
    in another order: measured up to 4.5e-5 apart over 12 steps)."""
    om = load_offloaded(default_model, RuntimeConfig(predictor=Predictor.NONE, dense_dtype=dense_dtype))
    try:
        assert "lm_head" in om.dense.native and len(om.dense.native) > 200
        prompt = list(range(100, 130))
        fast, fast_toks = engine_steps(om, prompt, 8)
        om.dense.reference = True
        ref, ref_toks = engine_steps(om, prompt, 8)
    finally:
        om.close()
    assert fast_toks == ref_toks
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-4)


def test_the_start_line_names_a_dense_dtype(tiny_models):
    # A user must see that --dense-dtype took effect (the expert dtype in the line is the experts').
    from moespec.chat.open_model import open_model

    for dense_dtype, shown in (("auto", False), ("int8", True)):
        cfg = RuntimeConfig(cache_experts=4, dense_dtype=dense_dtype)
        opened = open_model(str(tiny_models["qwen3_moe"]), cfg)
        try:
            assert ("dense linears int8" in opened.describe(cfg)) is shown
        finally:
            opened.close()
