"""Host syncs per MoE layer on a real GPU (skipped without one): torch.cuda.set_sync_debug_mode.

The CPU test (test_host_syncs.py) counts the calls that would sync; here CUDA itself reports every
synchronizing operation as a warning, counted inside each MoE layer call. Limit: one per layer in
every mode (the layer's ids, read together with the next layer's prediction), prefill included.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny import make_checkpoint

from moespec.config import ExecuteMode, Predictor, RuntimeConfig, SamplingConfig
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder

pytestmark = pytest.mark.cuda
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]


@pytest.mark.parametrize("mode", [ExecuteMode.EXACT, ExecuteMode.SPECULATIVE, ExecuteMode.GUARDED])
def test_cuda_syncs_per_layer(tmp_path, mode):
    folder = make_checkpoint(tmp_path / "m", "qwen3_moe", seed=5, layers=6)
    cfg = RuntimeConfig(device="cuda", cache_experts=6, predictor=Predictor.ROUTER, execute=mode, fetch_threshold=0.4)
    om = load_offloaded(folder, cfg, StatsRecorder())
    om.recorder.synchronize = om.cache.engine.synchronize
    counts: list[tuple[int, int]] = []
    run = om.runner.run

    def counted(block, x):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = run(block, x)
        counts.append((x.shape[0], sum("synchroniz" in str(w.message) for w in caught)))
        return out

    om.runner.run = counted
    torch.cuda.set_sync_debug_mode("warn")
    try:
        tokens = list(Engine(om).generate(PROMPT, SamplingConfig(max_new_tokens=8)))
    finally:
        torch.cuda.set_sync_debug_mode(0)
        om.close()
    assert len(tokens) == 8
    assert max(n for t, n in counts if t == 1) <= 1, counts
    assert max(n for t, n in counts if t > 1) <= 1, counts
