"""Cache policies and the prefetch rule, one rule per test on scripted routing traces.

Traces are replayed through the real ExpertCache (runtime/cache/replay.py): known hits, evictions and
copies (x expert bytes = H2D bytes). Then, on tiny models: exact mode stays exact under every
policy, and a prefetch never takes a pinned or in-flight slot.
"""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from tiny import make_checkpoint, reference_model

from typer.testing import CliRunner

from moespec.cli.app import app
from moespec.config import DEFAULT_CACHE_POLICY, CachePolicy, Predictor, RuntimeConfig
from moespec.errors import CalibrationError
from moespec.runtime.cache.eviction import LfruRule, hot_set, make_rule, resolve_policy, seed_from_frequencies
from moespec.runtime.cache.replay import replay
from moespec.runtime.load import load_offloaded

A, B, C, D = 0, 1, 2, 3


def _trace(*experts: int) -> list[dict[int, list[int]]]:
    """One layer (0), top-1: one step per expert id."""
    return [{0: [e]} for e in experts]


def _rule(policy: CachePolicy, seed: dict, slots: int, k: int = 1):
    return partial(make_rule, policy, seed, slots, k)


def test_lru_evicts_the_least_recently_used():
    res = replay(_trace(A, B, A, C, B), 2, _rule(CachePolicy.LRU, None, 2), prefetch_slots=0)
    # a b miss; a hit; c evicts b (a is more recent); b misses again
    assert res.hits == {0: 1} and res.misses == {0: 4} and res.copies == 4


def test_lfu_keeps_the_seeded_frequent_expert():
    seed = {(0, A): 0.9, (0, B): 0.05, (0, C): 0.05}
    lfu = replay(_trace(A, B, C, A), 2, _rule(CachePolicy.LFU, seed, 2), prefetch_slots=0)
    lru = replay(_trace(A, B, C, A), 2, _rule(CachePolicy.LRU, None, 2), prefetch_slots=0)
    assert lfu.hits == {0: 1} and lfu.copies == 3  # c evicted b (count 4.2 < a's 58.6)
    assert lru.hits == {} and lru.copies == 4  # c evicted a


def test_lfru_forgets_old_uses_that_lfu_keeps():
    # a used 4 times long ago, b 3 times since: LFU keeps a (4 > 3), LFRU keeps b
    # (a: (1 + .9 + .81 + .729) * .9^3 = 2.51 < b: 1 + .9 + .81 = 2.71); then a and b are asked again.
    trace = _trace(A, A, A, A, B, B, B, C, B, A)
    lfu = replay(trace, 2, _rule(CachePolicy.LFU, {}, 2), prefetch_slots=0)
    lfru = replay(trace, 2, partial(LfruRule, {}, 1, decay=0.9), prefetch_slots=0)  # the default decays slower
    assert lfu.hits == {0: 3 + 2 + 1} and lfu.misses == {0: 4}  # c took b's slot: b misses, then a hits
    assert lfru.hits == {0: 3 + 2 + 1} and lfru.misses == {0: 4}  # same counts, other victims:
    # after c, LFU holds {a, c} and LFRU holds {b, c}
    assert replay(trace[:8] + _trace(A), 2, _rule(CachePolicy.LFU, {}, 2), prefetch_slots=0).hits == {0: 6}
    assert replay(trace[:8] + _trace(A), 2, partial(LfruRule, {}, 1, decay=0.9), prefetch_slots=0).hits == {0: 5}


def test_static_never_evicts_the_hot_set():
    seed = {(0, A): 0.7, (0, B): 0.1, (0, C): 0.1, (0, D): 0.1}
    assert hot_set(seed, 1) == {(0, A)}
    trace = _trace(A, B, C, D, A)
    static = replay(trace, 3, _rule(CachePolicy.STATIC, seed, 3), prefetch_slots=0)  # hot = 3 - 2K = 1 key
    lru = replay(trace, 3, _rule(CachePolicy.LRU, None, 3), prefetch_slots=0)
    assert static.hits == {0: 1} and static.copies == 4  # d evicted b, a stayed
    assert lru.hits == {} and lru.copies == 5  # d evicted a


def test_seed_from_frequencies_sums_to_k_per_layer():
    seed = seed_from_frequencies([3, 5], torch.tensor([[6, 2, 0, 0], [1, 1, 1, 1]]), 2)
    assert seed[(3, 0)] == pytest.approx(1.5) and seed[(3, 2)] == 0.0 and seed[(5, 1)] == pytest.approx(0.5)


def test_prefetch_of_a_resident_expert_costs_nothing():
    trace = [{0: [A], 1: [B]}, {0: [A], 1: [B]}]
    res = replay(trace, 4, predictions=[{1: [B]}, {1: [B]}], prefetch_slots=1)
    # step 1: a, b miss (b was prefetched: one copy, used); step 2: b resident, its prefetch only pins
    assert res.copies == 2 and res.prefetch_copies == 1 and res.hits == {0: 1, 1: 2}


def test_wrong_prediction_is_copied_once_and_reused_first():
    # 2 layers, 3 slots: on-demand keeps a and b; the wrong prediction c takes the free slot once,
    # then its next prediction finds it resident (no copy)
    trace = [{0: [A], 1: [B]}] * 3
    wrong = [{1: [C]}] * 3
    ondemand = replay(trace, 3, prefetch_slots=1)
    pred = replay(trace, 3, predictions=wrong, prefetch_slots=1)
    assert ondemand.copies == 2 and ondemand.hits == {0: 2, 1: 2}
    assert pred.hits == {0: 2, 1: 2}  # a and b survive every wrong prefetch
    assert pred.copies == 2 + 1 and pred.wasted == 1


def test_unused_prediction_is_the_next_copy_s_slot():
    # 2 layers, 2 slots, LRU. Step 1: a (layer 0), the wrong prediction c for layer 1 takes the
    # second slot, then b misses: it takes c's slot (an unused prediction goes first), not a's.
    trace = [{0: [A], 1: [B]}, {0: [A], 1: [B]}]
    res = replay(trace, 2, predictions=[{1: [C]}, {}], prefetch_slots=1)
    assert res.copies == 3 and res.wasted == 1 and res.hits == {0: 1, 1: 1}  # a and b hit in step 2


def test_right_predictions_move_on_demand_s_bytes_at_the_lru_cliff():
    """3 layers, top-1, 3 slots (one token's experts: LRU's cliff), right predictions. The earlier
    rule (a prefetch area of K slots out of the cache, promotion on use) copied 8 experts here; a
    prefetch that takes the slot its miss would take copies what on-demand copies: 6."""
    trace = [{0: [C], 1: [A], 2: [A]}, {0: [A], 1: [A], 2: [A]}, {0: [C], 1: [A], 2: [B]}]
    rule = _rule(CachePolicy.LRU, None, 3)
    ondemand = replay(trace, 3, rule, prefetch_slots=1)
    # on-demand: step 1 three misses; step 2 (0, a) evicts (0, c); step 3 (0, c) evicts (0, a),
    # (2, b) evicts (2, a)
    assert ondemand.copies == 6 and ondemand.hits == {1: 2, 2: 1}
    pred = replay(trace, 3, rule, predictions=trace, prefetch_slots=1)
    # layer 0 is predicted at each step's start (the token start, runtime/layer/token_start.py)
    assert pred.copies == 6 and pred.prefetch_copies == 6 and pred.wasted == 0
    assert pred.hits == {0: 3, 1: 3, 2: 3} and pred.misses == {}
    alone = replay(trace, 3, rule, predictions=trace, prefetch_slots=1, token_start=False)
    assert alone.copies == 6 and alone.prefetch_copies == 3 and alone.wasted == 0
    assert alone.hits == {1: 3, 2: 3} and alone.misses == {0: 3}  # without it layer 0 has no predictor


@pytest.mark.parametrize("policy", list(CachePolicy))
def test_bytes_at_most_on_demand_plus_wrong_predictions(policy):
    """Skewed random routing, predictions with recall 1/2, a 25 % cache: copies <= on-demand's + wrong
    predictions (the issue's bound: (1 - recall) x K per layer)."""
    rng = random.Random(0)
    layers, experts, k, steps = 8, 16, 2, 80
    seed = {(layer, e): k / experts for layer in range(layers) for e in range(experts)}
    hot = {e: rng.random() for e in range(experts)}  # skewed routing, so frequencies matter
    trace, preds = [], []
    for _ in range(steps):
        step = {layer: rng.choices(range(experts), weights=list(hot.values()), k=k) for layer in range(layers)}
        step = {layer: list(dict.fromkeys(ids)) for layer, ids in step.items()}
        trace.append(step)
        preds.append({layer: [ids[0], (ids[0] + 1 + rng.randrange(experts - 1)) % experts]
                      for layer, ids in step.items()})
    slots = layers * experts // 4
    rule = _rule(policy, seed, slots, k)
    ondemand = replay(trace, slots, rule, prefetch_slots=0)
    pred = replay(trace, slots, rule, preds, prefetch_slots=k)
    wrong = sum(len(set(p.get(layer, [])) - set(step[layer])) for s, (step, p) in enumerate(zip(trace, preds))
                for layer in step)  # layer 0's too: the token start prefetches it
    assert pred.copies <= ondemand.copies + wrong, (pred.copies, ondemand.copies, wrong)
    assert pred.hit_rate() > ondemand.hit_rate()


def test_seeded_policy_without_calibration_is_a_typed_error(tmp_path):
    from tiny import make_checkpoint

    folder = make_checkpoint(tmp_path / "m", "qwen3_moe")  # fresh: no calibration file anywhere
    assert resolve_policy(None, folder, None) == CachePolicy.LRU  # the default falls back without a file
    for policy in (CachePolicy.LFU, CachePolicy.LFRU, CachePolicy.STATIC):
        with pytest.raises(CalibrationError) as err:
            resolve_policy(policy, folder, None)
        assert "moespec calibrate" in err.value.hint and policy.value in err.value.message
    res = CliRunner().invoke(app, ["chat", str(folder), "--cache-policy", "lfru", "--prompt", "hi"])
    assert res.exit_code != 0 and "moespec calibrate" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("policy", list(CachePolicy))
def test_exact_mode_stays_exact_under_every_policy(tiny_models, policy):
    folder = tiny_models["qwen2_moe"]
    ref = reference_model(folder)
    prompt = [5, 17, 99, 3, 200, 41]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                            pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    om = load_offloaded(folder, RuntimeConfig(cache_experts=6, predictor=Predictor.ROUTER))
    try:
        k = om.adapter.top_k()
        freqs = torch.arange(len(om.store.moe_layers) * om.store.num_experts).view(len(om.store.moe_layers), -1) % 5
        seed = seed_from_frequencies(om.store.moe_layers, freqs, k)
        om.cache._make_rule = partial(make_rule, policy, seed, om.cache.num_slots, k)
        om.cache.clear()
        assert om.cache.policy == policy
        from moespec.runtime.engine import Engine

        engine = Engine(om)
        got, logits = [], []
        with torch.inference_mode():
            last = engine.forward(prompt, "prefill")
            for _ in range(10):
                logits.append(last)
                got.append(int(torch.argmax(last)))
                last = engine.forward([got[-1]], "decode")
    finally:
        om.close()
    assert got == want.sequences[0, len(prompt):].tolist()
    for mine, theirs in zip(logits, want.logits):
        assert torch.allclose(mine.reshape(-1), theirs.reshape(-1), atol=1e-5, rtol=0)


def test_prefetch_never_takes_a_pinned_or_in_flight_slot(tiny_models):
    """End to end on a throttled link (copies stay in flight): every prefetch copy goes into a slot
    that was neither pinned nor still being written."""
    from moespec.config import SamplingConfig
    from moespec.runtime.engine import Engine

    om = load_offloaded(tiny_models["qwen3_moe"], RuntimeConfig(cache_experts=6, predictor=Predictor.ROUTER,
                                                                link_gbps=0.0005))
    cache = om.cache
    seen = {"prefetch": 0, "displaced": 0}
    copy_into = cache._copy_into

    def checked(slot, key, prefetch):
        if prefetch:
            seen["prefetch"] += 1
            seen["displaced"] += cache.key_of(slot) is not None
            assert not cache.pinned(slot), f"prefetch took pinned slot {slot}"
            assert not cache.in_flight(slot), f"prefetch took slot {slot} while a copy was writing it"
            held = sum(cache.pinned(s) and cache.unused_prediction(s) for s in range(cache.num_slots))
            assert held < cache.prefetch_slots, "more unused prefetch copies pinned than K"
        return copy_into(slot, key, prefetch)

    cache._copy_into = checked
    try:
        list(Engine(om).generate([3, 14, 15, 92, 65, 35], SamplingConfig(max_new_tokens=8)))
    finally:
        om.close()
    assert seen["prefetch"] > 0 and seen["displaced"] > 0  # prefetches did evict, never a pinned slot


def test_landed_is_false_while_a_copy_can_still_write_its_slot():
    from moespec.runtime.transfer import ThreadTransferEngine

    engine = ThreadTransferEngine(link_gbps=1e-6)  # 4 KB at 1 kB/s: the first copy runs ~4 s
    src, dst = torch.ones(1024), torch.zeros(2, 1024)
    first = engine.submit(dst[0], src, 0)
    queued = engine.submit(dst[1], src, 1, prefetch=True)
    assert not engine.landed(first) and not engine.landed(queued)
    assert engine.cancel(queued) and engine.landed(queued)  # cancelled: it will never write
    engine.wait(first)
    assert engine.landed(first)
    engine.close()


def test_a_calibration_file_of_another_model_is_checked_like_quasi(tiny_models, tmp_path):
    """The seeded policies read expert frequencies only from this model's file (config hash, MoE layers,
    router fingerprint): asked for explicitly, a stale file is quasi's error; by default the cache falls
    back to lru with a one-line note."""
    from test_calibrate import _calibrate

    from moespec.artifacts import CALIBRATION_BESIDE_MODEL as BESIDE_MODEL
    from moespec.predict.calibration_file import save_calibration

    calib = _calibrate(tiny_models["qwen3_moe"])
    own = save_calibration(tmp_path / "own.safetensors", calib)
    twin = make_checkpoint(tmp_path / "twin", "qwen3_moe", seed=7)  # same config, other router weights
    save_calibration(twin / BESIDE_MODEL, calib)  # found automatically for the twin: stale
    import threading

    def copy_threads() -> int:
        return sum(t.name == "moespec-h2d" for t in threading.enumerate())

    before = copy_threads()
    for policy in (CachePolicy.LFU, CachePolicy.LFRU, CachePolicy.STATIC):
        with pytest.raises(CalibrationError, match="router weights differ") as err:
            load_offloaded(twin, RuntimeConfig(predictor=Predictor.NONE, cache_policy=policy))
        assert "moespec calibrate" in err.value.hint and "--cache-policy lru" in err.value.hint
        assert copy_threads() == before  # the failed load stopped its copy engine
    om = load_offloaded(twin, RuntimeConfig(predictor=Predictor.NONE))  # default policy: falls back
    try:
        assert om.cache.policy == CachePolicy.LRU
        assert len(om.notes) == 1 and "router weights differ" in om.notes[0] and "\n" not in om.notes[0]
    finally:
        om.close()
    om = load_offloaded(tiny_models["qwen3_moe"], RuntimeConfig(predictor=Predictor.NONE, calibration_path=str(own)))
    try:  # its own file: the default seeded policy, no note
        assert om.cache.policy == DEFAULT_CACHE_POLICY and om.notes == []
    finally:
        om.close()
