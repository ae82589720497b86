"""GGUF MoE files run exactly: logits within 1e-5 (float32) of transformers on the same weights.

The reference is transformers running the tiny model with every weight replaced by gguf's numpy
dequantisation of the file (tiny_gguf.write_gguf). Files are written as llama.cpp's converter
writes them, in F32, F16, Q8_0, Q4_0, Q4_K, Q6_K and MXFP4, for Qwen3-MoE, Qwen2-MoE (shared
expert, its gate stored [1, 1, H]), GPT-OSS (MXFP4 experts with biases, attention sinks), Mixtral
(q/k permuted), OLMoE, DeepSeek-V2/V3 and GLM-4.7-Flash (MLA's kv_b split; llama.cpp writes GLM-4.7-Flash
as deepseek2, moespec runs it as DeepSeek-V3); the mixed file holds Q4_K and Q6_K
experts in different layers, as llama-quantize's Q4_K_M does.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny import GREEDY_PROMPT
from tiny_gguf import write_gguf

from moespec.config import OnMiss, Predictor, RuntimeConfig
from moespec.gguf.export import ExportTypes
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded

# layer 0: Q4_K gate, Q8_0 up (dequantised apart), Q4_K down; layer 1: Q4_K gate/up (one call), Q6_K down
MIXED = ExportTypes("Q4_K", dense="Q8_0", per_layer={(1, "down"): "Q6_K", (0, "up"): "Q8_0"})
CASES = {
    "qwen3_moe-Q8_0": ("qwen3_moe", ExportTypes("Q8_0"), dict(hidden=64, inter=64)),
    "qwen3_moe-Q4_K+Q6_K": ("qwen3_moe", MIXED, dict(hidden=256, inter=256, layers=2, experts=4)),
    "qwen2_moe-Q8_0": ("qwen2_moe", ExportTypes("Q8_0", dense="Q8_0"), dict(hidden=64, inter=64, shexp_gate_3d=True)),
    "gpt_oss-MXFP4": ("gpt_oss", ExportTypes("MXFP4"), dict(hidden=64, inter=64)),
    "mixtral-Q4_0": ("mixtral", ExportTypes("Q4_0", dense="Q4_0"), dict(hidden=64, inter=64)),
    "mixtral-F32": ("mixtral", ExportTypes("F32", dense="F32"), dict()),
    "olmoe-F16": ("olmoe", ExportTypes("F16", dense="F16"), dict()),
    "deepseek_v3-Q8_0": ("deepseek_v3", ExportTypes("Q8_0"), dict(hidden=64, inter=64)),
    "deepseek_v2-Q4_0": ("deepseek_v2", ExportTypes("Q4_0"), dict(hidden=64, inter=64)),
    "glm4_moe_lite-Q8_0": ("glm4_moe_lite", ExportTypes("Q8_0"), dict(hidden=64, inter=64)),  # deepseek2 in GGUF
}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for case, (family, types, cfg) in CASES.items():
        cfg = dict(cfg)
        gate3d = cfg.pop("shexp_gate_3d", False)
        out[case] = write_gguf(root / case, family, types, shexp_gate_3d=gate3d, **cfg)
    return out


def _logits(model, ids: torch.Tensor, step=lambda: None) -> tuple[torch.Tensor, torch.Tensor]:
    """(one prefill of all of ``ids``, prefill of 5 then one decode step per token), each [1, T, V];
    ``step`` runs before each forward (the offloaded runner's reset_step)."""
    from transformers import DynamicCache

    with torch.inference_mode():
        step()
        full = model(ids).logits
        kv, outs = DynamicCache(config=model.config), []
        step()
        outs.append(model(ids[:, :5], cache=kv, use_cache=True).logits)
        for t in range(5, ids.shape[1]):
            step()
            outs.append(model(ids[:, t : t + 1], cache=kv, use_cache=True).logits)
    return full, torch.cat(outs, dim=1)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers_on_the_dequantised_weights(gguf_files, case):
    from moespec.hub.resolve import resolve_model

    path, ref = gguf_files[case]
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    want_full, want_inc = _logits(ref, ids)
    k = ref.config.num_experts_per_tok
    om = load_offloaded(resolve_model(str(path)), RuntimeConfig(dtype="float32", cache_experts=2 * k))
    try:
        full, inc = _logits(om.model, ids, om.runner.reset_step)
    finally:
        om.close()
    assert (full - want_full).abs().max() < 1e-5, (case, (full - want_full).abs().max())
    assert (inc - want_inc).abs().max() < 1e-5, (case, (inc - want_inc).abs().max())


@pytest.mark.parametrize("case,on_miss", [("qwen3_moe-Q4_K+Q6_K", OnMiss.HOST), ("gpt_oss-MXFP4", OnMiss.FETCH),
                                          ("qwen2_moe-Q8_0", OnMiss.FETCH), ("mixtral-Q4_0", OnMiss.HOST),
                                          ("deepseek_v3-Q8_0", OnMiss.FETCH)])
def test_greedy_tokens_equal_transformers(gguf_files, case, on_miss):
    """Greedy decoding, with misses fetched or computed on the host from the GGUF rows."""
    from moespec.config import SamplingConfig
    from moespec.hub.resolve import resolve_model

    path, ref = gguf_files[case]
    with torch.no_grad():
        want = ref.generate(torch.tensor([GREEDY_PROMPT]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(GREEDY_PROMPT):].tolist()
    k = ref.config.num_experts_per_tok
    om = load_offloaded(resolve_model(str(path)), RuntimeConfig(dtype="float32", cache_experts=2 * k,
                                                                predictor=Predictor.ROUTER, on_miss=on_miss))
    try:
        got = list(Engine(om).generate(GREEDY_PROMPT, SamplingConfig(max_new_tokens=10)))
    finally:
        om.close()
    assert got == want


def test_one_copy_moves_the_experts_bytes_in_the_file(gguf_files):
    """Per layer the row is gate | up | down as the file holds them (each padded to 16 bytes), and
    each miss moves exactly that layer's row: a layer with smaller parts copies fewer bytes than a slot."""
    from moespec.gguf.reader import GgufCheckpoint
    from moespec.runtime.host.gguf_source import GgufSource
    from moespec.hub.resolve import resolve_model
    from moespec.runtime.stats import StatsRecorder

    path, ref = gguf_files["qwen3_moe-Q4_K+Q6_K"]
    folder = resolve_model(str(path))
    ck = GgufSource.open(folder).ck
    assert isinstance(ck, GgufCheckpoint)
    om = load_offloaded(folder, RuntimeConfig(dtype="float32", cache_experts=2, predictor=Predictor.NONE),
                        StatsRecorder())
    try:
        for layer in om.store.moe_layers:
            layout = om.store.layout.for_layer(layer)
            file_bytes = [ck.tensors[f"blk.{layer}.ffn_{p}_exps.weight"].row_bytes for p in ("gate", "up", "down")]
            assert layout.numel - sum(file_bytes) < 3 * 16  # alignment padding only
            raw = ck.read(ck.tensors[f"blk.{layer}.ffn_down_exps.weight"], 3 * file_bytes[2], file_bytes[2])
            assert torch.equal(layout.views(om.store.expert(layer, 3))["down"], raw)  # the file's bytes, as they are
        # layer 0's Q8_0 up makes its rows larger: every slot has the largest layer's size
        sizes = {x: om.store.layout.for_layer(x).numel for x in om.store.moe_layers}  # uint8 rows: bytes
        assert om.store.expert_bytes == max(sizes.values()) > min(sizes.values())
        om.recorder.begin_step("prefill", len(GREEDY_PROMPT))
        with torch.inference_mode():
            om.runner.reset_step()
            om.model(torch.tensor([GREEDY_PROMPT]))
        step = om.recorder.end_step()
        moved = om.cache.engine.bytes_moved
    finally:
        om.close()
    for layer, st in step.layers.items():
        assert st.misses > 0 and st.h2d_bytes == st.misses * sizes[layer], layer
    assert moved == sum(st.h2d_bytes for st in step.layers.values())
    from moespec.hub.gguf_repos import gguf_sizes

    listed = gguf_sizes(ck, json.loads((folder / "config.json").read_text()))  # what `moespec models` shows
    assert listed.expert_bytes == om.store.expert_bytes
    assert listed.zero_cache_h2d_bytes_per_token == ref.config.num_experts_per_tok * sum(sizes.values())


@pytest.mark.parametrize("case", ["qwen3_moe-Q4_K+Q6_K", "gpt_oss-MXFP4"])
def test_experts_dequantised_at_load_are_exact_too(gguf_files, case):
    """--expert-dtype float32: the GGUF experts dequantised once into float rows (GPT-OSS: interleaved
    gate/up as transformers keeps them), the same logits."""
    from moespec.hub.resolve import resolve_model

    path, ref = gguf_files[case]
    ids = torch.tensor([GREEDY_PROMPT])
    with torch.no_grad():
        want = ref(ids).logits
    om = load_offloaded(resolve_model(str(path)), RuntimeConfig(dtype="float32", expert_dtype="float32", cache_experts=8))
    try:
        assert om.store.dtype == torch.float32
        with torch.inference_mode():
            got = om.model(ids).logits
    finally:
        om.close()
    assert (got - want).abs().max() < 1e-5
