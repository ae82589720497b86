"""Bytes, hits and misses add up; every cache slot is reused safely."""

from __future__ import annotations

import torch
from tiny import make_checkpoint, reference_model

from moespec.config import Predictor, RuntimeConfig, SamplingConfig
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder

PROMPT = [7, 21, 250, 33, 90, 11, 4]


def _generate(folder, cfg: RuntimeConfig, n: int = 10):
    om = load_offloaded(folder, cfg, StatsRecorder())
    try:
        toks = list(Engine(om).generate(PROMPT, SamplingConfig(max_new_tokens=n)))
        return om, toks
    finally:
        om.close()


def test_bytes_equal_misses_times_expert_bytes_without_prediction(tiny_models):
    om, _ = _generate(tiny_models["qwen3_moe"], RuntimeConfig(cache_experts=2, predictor=Predictor.NONE))
    eb = om.store.expert_bytes
    assert eb == 3 * 32 * 16 * 4  # 3 matrices of H*I float32
    steps = om.recorder.steps
    decode = [s for s in steps if s.kind == "decode"]
    for s in decode:
        t = s.total()
        assert t.hits + t.misses == 2 * 3  # K x MoE layers per token
        assert t.h2d_bytes == t.misses * eb
        assert t.prefetched == 0
    total_misses = sum(s.total().misses for s in steps)
    assert om.cache.engine.bytes_moved == total_misses * eb == om.cache.copies * eb


def test_full_cache_moves_each_expert_once(tiny_models):
    om, _ = _generate(tiny_models["mixtral"], RuntimeConfig(predictor=Predictor.NONE), n=16)
    assert om.cache.num_slots == 3 * 8
    copied = om.cache.copies
    resident = om.cache.resident_keys()
    assert copied == len(resident) == len(set(resident))  # no expert was copied twice
    assert om.cache.engine.bytes_moved == copied * om.store.expert_bytes
    assert copied <= 3 * 8


def test_prefetch_accounting_with_router_predictor(tiny_models):
    om, _ = _generate(tiny_models["qwen2_moe"], RuntimeConfig(cache_experts=6, predictor=Predictor.ROUTER, prediction_gate=False), n=12)
    eb = om.store.expert_bytes
    for s in om.recorder.steps:
        t = s.total()
        assert t.h2d_bytes == (t.misses + t.prefetched) * eb
    decode = [s.total() for s in om.recorder.steps if s.kind == "decode"]
    assert sum(t.recall_total for t in decode) == 2 * 2 * len(decode)  # K x predicted layers x tokens
    assert sum(t.prefetched for t in decode) > 0
    assert sum(t.prefetch_used + t.prefetch_wasted for t in decode) <= sum(t.prefetched for t in decode)
    assert om.cache.engine.bytes_moved == om.cache.copies * eb


def test_slot_reuse_with_odd_layer_count_and_minimum_cache(tmp_path):
    """5 layers, 4 slots (2 running + 2 prefetch), slow link: no prefetch may overwrite a slot
    whose expert has not run yet, or the logits would differ from the reference."""
    folder = make_checkpoint(tmp_path / "m", "qwen3_moe", layers=5)
    ref = reference_model(folder)
    prompt = PROMPT
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
    om, got = _generate(folder, RuntimeConfig(cache_experts=4, predictor=Predictor.ROUTER, link_gbps=0.02, prediction_gate=False))
    assert got == want
    assert om.cache.copies > 5 * 2  # the small cache really was reused


def test_stats_off_records_nothing(tiny_models):
    om = load_offloaded(tiny_models["olmoe"], RuntimeConfig(cache_experts=4))
    try:
        list(Engine(om).generate(PROMPT, SamplingConfig(max_new_tokens=3)))
        assert om.recorder.enabled is False and om.recorder.steps == []
    finally:
        om.close()
