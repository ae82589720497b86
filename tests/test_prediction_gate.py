"""The per-layer prediction gate (runtime/layer/gate.py): a layer predicts while its used prefetches
save more link time than predicting and its wasted copies cost, probes when closed, comes back."""

from __future__ import annotations

import pytest
import torch

from moespec.config import ExecuteMode, Predictor, RuntimeConfig
from moespec.runtime.engine import Engine
from moespec.runtime.layer.gate import MIN_OUTCOMES, PROBE_EVERY, PredictionGate
from moespec.runtime.layer.token_start import TOKEN_START
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder


def _outcomes(gate, layer, used, wasted, n=MIN_OUTCOMES):
    for _ in range(n):
        gate.observe_outcome(layer, used=used, wasted=wasted)


def test_closes_when_nothing_is_saved_and_probes():
    gate = PredictionGate(lambda: 2.0)  # 2 ms per copy
    assert gate.admits(0)  # not measured: predicts
    gate.observe_predict(0, 0.5)
    _outcomes(gate, 0, 0, 0, MIN_OUTCOMES - 1)  # saves 0 < costs 0.5, but not measured enough yet
    assert gate.report()[0]["open"]
    gate.observe_outcome(0, used=0, wasted=0)
    assert not gate.report()[0]["open"]
    admitted = [gate.admits(0) for _ in range(2 * PROBE_EVERY)]
    assert admitted.count(True) == 2 and admitted[PROBE_EVERY - 1] and admitted[2 * PROBE_EVERY - 1]
    assert gate.report()[0]["skipped"] == 2 * (PROBE_EVERY - 1)


def test_stays_open_while_used_copies_pay_and_weighs_wasted_ones():
    gate = PredictionGate(lambda: 2.0)
    gate.observe_predict(3, 0.5)
    _outcomes(gate, 3, 1, 0)  # saves 2.0 >= 0.5
    assert gate.report()[3]["open"] and gate.report()[3]["saving_ms"] == 2.0
    gate = PredictionGate(lambda: 2.0)
    gate.observe_predict(3, 0.5)
    _outcomes(gate, 3, 1, 1)  # saves 2.0 < 0.5 + 1 x 2 x 2.0 (its copy and a displaced hit)
    assert not gate.report()[3]["open"] and gate.report()[3]["cost_ms"] == 4.5


def test_comes_back_when_a_probe_finds_savings():
    gate = PredictionGate(lambda: 2.0)
    gate.observe_predict(1, 0.5)
    _outcomes(gate, 1, 0, 0)
    while not gate.admits(1):
        pass  # the probe
    for _ in range(30):  # the layer's routing became predictable
        gate.observe_outcome(1, used=2, wasted=0)
    assert gate.report()[1]["open"] and gate.admits(1)


def test_unknown_link_speed_keeps_a_layer_whose_copies_are_used():
    gate = PredictionGate(lambda: None)
    gate.observe_predict(0, 0.5)
    _outcomes(gate, 0, 1, 0)
    assert gate.report()[0]["open"]
    gate.observe_predict(1, 0.5)
    _outcomes(gate, 1, 0, 0)
    assert not gate.report()[1]["open"]


def test_one_slow_prediction_is_not_the_cost():
    gate = PredictionGate(lambda: 2.0)
    gate.observe_predict(0, 14.0)  # a first call
    gate.observe_predict(0, 0.5)
    assert gate.layers[0].predict_ms == 0.5  # the fastest of the first outcomes
    _outcomes(gate, 0, 1, 0)
    gate.observe_predict(0, 100.0)  # preempted: counts as 4 x 0.5 = 2.0 at weight 0.1
    assert gate.layers[0].predict_ms == pytest.approx(0.5 + 0.1 * (2.0 - 0.5))


def _decode(path, predictor, execute=ExecuteMode.EXACT, slots=None, n=12, rec=None):
    om = load_offloaded(path, RuntimeConfig(predictor=predictor, execute=execute, cache_experts=slots), rec)
    try:
        engine, out = Engine(om), []
        with torch.inference_mode():
            last = engine.prefill([5, 17, 99, 3])
            for _ in range(n):
                out.append(int(torch.argmax(last)))
                last = engine.forward([out[-1]], "decode")
        gate = om.runner.prefetcher.gate if predictor != Predictor.NONE else None
        return out, None if gate is None else gate.report()
    finally:
        om.close()


def test_every_expert_resident_stops_predicting_and_stays_exact(tiny_models):
    path = tiny_models["qwen3_moe"]
    none, _ = _decode(path, Predictor.NONE)
    rec = StatsRecorder()
    router, report = _decode(path, Predictor.ROUTER, rec=rec)
    assert router == none
    assert report and all(not r["open"] and r["skipped"] > 0 for r in report.values()), report
    # The stats say so per layer: every layer but the last predicted MIN_OUTCOMES times, then was gated.
    decode = [s for s in rec.steps if s.kind == "decode"]
    assert TOKEN_START in report  # the token-start prediction (token_start.py) is gated the same way
    for layer, r in report.items():
        if layer == TOKEN_START:  # no layer's l -> l+1: in the gate's report only
            assert r["ran"] == MIN_OUTCOMES and r["skipped"] == len(decode) - MIN_OUTCOMES
            continue
        assert sum(s.layers[layer].predicted for s in decode) == r["ran"] == MIN_OUTCOMES
        assert sum(s.layers[layer].predict_gated for s in decode) == r["skipped"] == len(decode) - MIN_OUTCOMES


def test_speculative_mode_has_no_gate(tiny_models):
    _, report = _decode(tiny_models["qwen3_moe"], Predictor.ROUTER, ExecuteMode.SPECULATIVE, n=2)
    assert report is None
