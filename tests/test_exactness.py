"""`exact` mode equals the plain transformers model: logits within 1e-5, same greedy tokens.

Across families, cache sizes from the minimum to all experts, predictors none/router, prefill
and token-by-token decode, sharded checkpoints, tied embeddings, and H == I / H == 2I layouts.
"""

from __future__ import annotations

import pytest
import torch
from tiny import GREEDY_PROMPT, make_checkpoint, offloaded_greedy, reference_greedy, reference_model

from moespec.config import ExecuteMode, Predictor, RuntimeConfig
from moespec.runtime.engine import Engine, _cache_kwarg
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


def _incremental_logits(om, ids: torch.Tensor) -> torch.Tensor:
    """Logits [1, T, V]: prefill of the first 5 tokens, then one decode step per token, each reusing the
    KV cache under the name the forward takes (engine._cache_kwarg: ``cache`` on transformers 5.24,
    ``past_key_values`` on 5.17, which ignores ``cache``). The cache must hold every position afterwards, and a decode step without it sees no
    context, so a cache that were not reused fails both this check and the logits comparison."""
    engine = Engine(om)
    outs = []
    with torch.inference_mode():
        from transformers import DynamicCache

        kv = DynamicCache(config=om.config)
        name = _cache_kwarg(om.model)
        om.reset_step()
        outs.append(om.model(ids[:, :5], **{name: kv}, use_cache=True).logits)
        for t in range(5, ids.shape[1]):
            om.reset_step()
            assert kv.get_seq_length() == t
            outs.append(om.model(ids[:, t : t + 1], **{name: kv}, use_cache=True).logits)
        assert kv.get_seq_length() == ids.shape[1]
    del engine
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("predictor", [Predictor.NONE, Predictor.ROUTER])
def test_logits_equal_transformers_for_every_cache_size(tiny_models, family, predictor):
    folder = tiny_models[family]
    ref = reference_model(folder)
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
    k = ref.config.num_experts_per_tok
    minimum = k if predictor == Predictor.NONE else 2 * k
    for slots in sorted({minimum, minimum + 1, 12, 24}):
        om = load_offloaded(folder, RuntimeConfig(cache_experts=slots, predictor=predictor), StatsRecorder())
        try:
            with torch.inference_mode():
                full = om.model(ids).logits
            inc = _incremental_logits(om, ids)
        finally:
            om.close()
        assert torch.allclose(full, want, atol=1e-5, rtol=0), (family, slots, (full - want).abs().max())
        assert torch.allclose(inc, want, atol=1e-5, rtol=0), (family, slots, (inc - want).abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(tiny_models, family):
    folder = tiny_models[family]
    cfg = RuntimeConfig(cache_experts=5, predictor=Predictor.ROUTER, link_gbps=None)
    assert offloaded_greedy(folder, cfg, GREEDY_PROMPT, 12) == reference_greedy(folder, GREEDY_PROMPT, 12)


@pytest.mark.parametrize("hidden,inter", [(32, 32), (32, 16)])  # H == I and H == 2I
def test_square_and_double_layouts(tmp_path, hidden, inter):
    """Layouts are decided by name, never by shape: square gate/up/down must still be exact."""
    folder = make_checkpoint(tmp_path / "m", "qwen3_moe", hidden=hidden, inter=inter)
    ref = reference_model(folder)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(ids).logits
    om = load_offloaded(folder, RuntimeConfig(cache_experts=4))
    try:
        got = _incremental_logits(om, ids)
    finally:
        om.close()
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_sharded_checkpoint_and_tied_embeddings(tmp_path):
    """A layer's experts split across shards; tie_word_embeddings=True has no lm_head on disk."""
    folder = make_checkpoint(tmp_path / "m", "mixtral", shard_size="20KB", tie_word_embeddings=True)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 3
    from safetensors import safe_open

    names = set()
    for s in shards:
        with safe_open(str(folder / s), "pt") as f:
            names |= set(f.keys())
    assert "lm_head.weight" not in names
    ref = reference_model(folder)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits
    om = load_offloaded(folder, RuntimeConfig(cache_experts=4))
    try:
        got = _incremental_logits(om, ids)
        assert om.model.lm_head.weight.data_ptr() == om.model.model.embed_tokens.weight.data_ptr()
    finally:
        om.close()
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_fused_experts_on_disk(tmp_path):
    """Checkpoints that store experts fused ([E, 2I, H], [E, H, I]) load as well as per-expert ones."""
    from safetensors.torch import load_file, save_file

    folder = make_checkpoint(tmp_path / "m", "qwen3_moe")
    sd = load_file(folder / "model.safetensors")
    fused = {k: v for k, v in sd.items() if ".experts." not in k}
    for layer in range(3):
        p = f"model.layers.{layer}.mlp.experts"
        gate = torch.stack([sd[f"{p}.{e}.gate_proj.weight"] for e in range(8)])
        up = torch.stack([sd[f"{p}.{e}.up_proj.weight"] for e in range(8)])
        fused[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1)  # halves: gate rows then up rows
        fused[f"{p}.down_proj"] = torch.stack([sd[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    ref = reference_model(folder)
    save_file(fused, folder / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(ids).logits
    om = load_offloaded(folder, RuntimeConfig(cache_experts=4))
    try:
        with torch.inference_mode():
            got = om.model(ids).logits
    finally:
        om.close()
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_throttled_link_keeps_exactness(tiny_models):
    """Copies on an emulated slow link land late; compute must wait for exactly its slot."""
    folder = tiny_models["qwen3_moe"]
    ref = reference_model(folder)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(ids).logits
    om = load_offloaded(folder, RuntimeConfig(cache_experts=4, link_gbps=0.05, execute=ExecuteMode.EXACT))
    try:
        got = _incremental_logits(om, ids)
    finally:
        om.close()
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
