"""CUDA runtime checks (skipped without a GPU): pinned store, copy stream, exactness on device."""

from __future__ import annotations

import pytest
import torch
from tiny import reference_model

from moespec.config import Predictor, RuntimeConfig, SamplingConfig
from moespec.runtime.engine import Engine
from moespec.runtime.offload import load_offloaded
from moespec.runtime.stats import StatsRecorder

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_cuda_exact_generation_and_pinned_store(tiny_models, family):
    folder = tiny_models[family]
    ref = reference_model(folder).cuda()
    prompt = [5, 17, 99, 3, 200, 41]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=10, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    om = load_offloaded(folder, RuntimeConfig(device="cuda", cache_experts=4, predictor=Predictor.ROUTER),
                        StatsRecorder())
    om.recorder.synchronize = om.cache.engine.synchronize
    try:
        assert om.store.pinned and om.cache.slots.is_cuda
        got = list(Engine(om).generate(prompt, SamplingConfig(max_new_tokens=10)))
        steps = om.recorder.steps
    finally:
        om.close()
    assert got == want
    eb = om.store.expert_bytes
    for s in steps:
        t = s.total()
        assert t.h2d_bytes == (t.misses + t.prefetched) * eb
