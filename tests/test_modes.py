"""`speculative` and `guarded` run and record what they skipped; guarded with τ=0 is exact."""

from __future__ import annotations

import torch

from moespec.config import ExecuteMode, Predictor, RuntimeConfig, SamplingConfig
from moespec.models.base import Routing
from moespec.runtime.engine import Engine
from moespec.runtime.layer.guard import guard_routing
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder

PROMPT = [3, 14, 15, 92, 65, 35]


def _run(folder, **kw):
    om = load_offloaded(folder, RuntimeConfig(**kw), StatsRecorder())
    try:
        engine = Engine(om)
        toks = list(engine.generate(PROMPT, SamplingConfig(max_new_tokens=10)))
        return om, toks
    finally:
        om.close()


def _decode_total(om):
    from moespec.runtime.stats import LayerStats

    tot = LayerStats()
    for s in om.recorder.steps:
        if s.kind == "decode":
            tot.add(s.total())
    return tot


def test_guarded_threshold_zero_equals_exact(tiny_models):
    folder = tiny_models["qwen3_moe"]
    _, exact = _run(folder, cache_experts=4, execute=ExecuteMode.EXACT)
    om, guarded = _run(folder, cache_experts=4, execute=ExecuteMode.GUARDED, fetch_threshold=0.0)
    assert guarded == exact
    assert _decode_total(om).skipped == 0


def test_guarded_high_threshold_never_fetches_on_demand(tiny_models):
    om, _ = _run(tiny_models["qwen3_moe"], cache_experts=6, execute=ExecuteMode.GUARDED, fetch_threshold=2.0)
    tot = _decode_total(om)
    assert tot.misses == 0  # every miss was substituted by a resident expert
    assert tot.skipped > 0 and 0 < tot.substituted <= tot.skipped and tot.skipped_mass > 0
    # what ran = K x layers x tokens, less the skipped experts that had no resident substitute
    tokens = sum(1 for s in om.recorder.steps if s.kind == "decode")
    assert tot.hits + tot.misses == 2 * 3 * tokens - (tot.skipped - tot.substituted)


def test_speculative_runs_predicted_experts_and_records_skips(tiny_models):
    om, toks = _run(tiny_models["mixtral"], cache_experts=4, execute=ExecuteMode.SPECULATIVE,
                    predictor=Predictor.ROUTER)
    tot = _decode_total(om)
    assert len(toks) == 10
    # Layers after the first run the prediction: no demand miss there, recall is measured, and every
    # true expert that the prediction missed is counted as skipped.
    assert tot.recall_total > 0
    assert tot.skipped == tot.recall_total - tot.recall_hits
    for s in om.recorder.steps:
        if s.kind == "decode":
            for layer, st in s.layers.items():
                if layer > 0:
                    assert st.misses == 0 or st.prefetched < 2


def test_guard_substitutes_best_resident_and_keeps_mass():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.5, 0.0]])
    probs = torch.softmax(logits, -1)
    top, ids = torch.topk(probs, 2)
    top = top / top.sum()
    r = Routing(ids=ids, weights=top, logits=logits)  # experts 0, 1
    g = guard_routing(r, resident={0, 3, 4}, threshold=0.5)  # expert 1 (w≈0.27) missing and light
    assert g.routing.ids.tolist() == [[0, 3]]
    assert g.skipped == 1 and g.substituted == 1
    assert abs(g.routing.weights.sum().item() - 1.0) < 1e-6
    assert g.routing.weights[0, 0] > g.routing.weights[0, 1]
    assert guard_routing(r, resident={0, 3}, threshold=0.0).routing is r  # τ=0 fetches: unchanged
    heavy = guard_routing(r, resident={1}, threshold=0.5)  # expert 0 (w≈0.73) is fetched anyway
    assert heavy.routing.ids.tolist() == [[1, 0]] or 0 in heavy.routing.ids.tolist()[0]


def test_one_token_prefill_is_exact_in_speculative_mode(tiny_models):
    # A new chat turn (or a resumed prompt) can add exactly one token after the reused KV: that
    # forward is a prefill and must be exact, although it runs one token like a decode step.
    folder = tiny_models["mixtral"]
    ids = PROMPT + [7]
    logits = {}
    for mode in (ExecuteMode.EXACT, ExecuteMode.SPECULATIVE):
        om = load_offloaded(folder, RuntimeConfig(cache_experts=4, execute=mode, predictor=Predictor.ROUTER),
                            StatsRecorder())
        try:
            engine = Engine(om)
            engine.prefill(PROMPT)
            logits[mode] = engine.prefill(ids)  # reuses PROMPT's KV: one new token, kind "prefill"
            assert engine.reused_tokens == len(PROMPT)
            last = om.recorder.steps[-1]
            assert last.kind == "prefill" and last.tokens == 1
            assert last.total().skipped == 0  # nothing speculated away in a prefill
        finally:
            om.close()
    torch.testing.assert_close(logits[ExecuteMode.SPECULATIVE], logits[ExecuteMode.EXACT], rtol=0, atol=1e-5)
