"""The policy replay runs the runtime's own layer protocol: replaying the routing (and predictions) a
decode run recorded gives exactly that run's hits, misses, copies and wasted prefetches, per layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moespec.config import CachePolicy, Predictor, RuntimeConfig
from moespec.predict.base import RouterPredictor
from moespec.runtime.cache.replay import NullEngine, replay
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder
from moespec.runtime.transfer import Ticket


class _InlineEngine(NullEngine):
    """Copies inside submit (so compute reads real experts); nothing is ever cancellable: no timing."""

    def submit(self, dst, src, slot, prefetch=False) -> Ticket:
        dst.copy_(src)
        return super().submit(dst, src, slot, prefetch)


@pytest.mark.parametrize("predictor", [Predictor.NONE, Predictor.ROUTER])
@pytest.mark.parametrize("slots", [4, 7, 24])
def test_replay_of_a_decode_run_gives_its_counts(tiny_models, predictor, slots):
    rec = StatsRecorder()
    om = load_offloaded(tiny_models["qwen3_moe"], RuntimeConfig(cache_experts=slots, predictor=predictor,
                                                                cache_policy=CachePolicy.LRU), rec)
    predicted: dict[int, list[int]] = {}

    class Recorded(RouterPredictor):
        def predict(self, layer, residual, used):
            got = super().predict(layer, residual, used)
            if got is not None:
                predicted[self.target(layer).layer] = got.ids.reshape(-1).tolist()
            return got

        def predict_first(self, state):  # the token start's (token_start.py): replayed at the step's start
            got = super().predict_first(state)
            if got is not None:
                predicted[self.first.layer] = got.ids.reshape(-1).tolist()
            return got

    if predictor == Predictor.ROUTER:
        om.use_policy(dataclasses.replace(om.policy, predictor=Recorded(om.adapter, om.layer_refs())))
    om.cache.engine.close()
    om.cache.engine = _InlineEngine()
    rec.synchronize = om.cache.engine.synchronize
    trace, predictions = [], []
    try:
        engine = Engine(om)
        with torch.inference_mode(), om.recording_routings() as ran:
            last = engine.prefill([5, 17, 99, 3, 200, 41])
            om.cache.clear()  # the replay starts from an empty cache
            copies = om.cache.copies
            rec.reset()
            for _ in range(10):
                predicted.clear()
                last = engine.forward([int(torch.argmax(last))], "decode")
                # The runner acquires a layer's experts in ascending id order (resident ones first).
                trace.append({layer: sorted(r.ids[0].tolist()) for layer, r in ran.items()})
                predictions.append(dict(predicted))
        copies = om.cache.copies - copies
    finally:
        om.close()
    ran_stats = [s for s in rec.steps if s.kind == "decode"]
    hits = {layer: sum(s.layers[layer].hits for s in ran_stats) for layer in trace[0]}
    misses = {layer: sum(s.layers[layer].misses for s in ran_stats) for layer in trace[0]}
    totals = [s.total() for s in ran_stats]
    res = replay(trace, slots, predictions=predictions if predictor == Predictor.ROUTER else None,
                 prefetch_slots=om.adapter.top_k())
    assert res.hits == {layer: n for layer, n in hits.items() if n}
    assert res.misses == {layer: n for layer, n in misses.items() if n}
    assert res.copies == copies
    assert res.prefetch_copies == sum(t.prefetched for t in totals)
    assert res.wasted == sum(t.prefetch_wasted for t in totals)
    if predictor == Predictor.ROUTER:
        assert res.prefetch_copies > 0 and sum(hits.values()) > 0  # the prefetch path really ran
