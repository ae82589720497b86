"""SharedPrefixScorer (each shared continuation prefix decoded once) equals DecodeScorer (the reference:
every choice decoded from the context) within 1e-5 in float32, in exact and speculative mode, on every
architecture's tiny model; it runs one decode step per distinct prefix; guarded arms keep DecodeScorer.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_eval_score import CTX, FAMILIES, folder_of  # noqa: F401  (folder_of: a fixture)

from moespec.config import ExecuteMode, Predictor, RuntimeConfig
from moespec.eval.score import DecodeScorer, PrefillScorer
from moespec.eval.shared_prefix import SharedPrefixScorer, scorer_for
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded

# choices 0, 2 and 3 share [31, 77] / [31]; 1 and 4 share [64, 2]; order chosen so neighbours differ
TREE = [(CTX, [31, 77, 12, 5]), (CTX, [64, 2, 250]), (CTX, [31, 77, 40]), (CTX, [31]), (CTX, [64, 2])]
SPLIT = [(CTX[:6] + [11, 12], [90, 91, 92]), (CTX[:6] + [13], [90, 91, 92]), (CTX[:6] + [11, 12], [90, 91])]


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefix_equals_the_decode_path(folder_of, family):
    folder = folder_of(family)
    k = json.loads((folder / "config.json").read_text())["num_experts_per_tok"]
    om = load_offloaded(folder, RuntimeConfig(cache_experts=2 * k + 1, predictor=Predictor.ROUTER,
                                              execute=ExecuteMode.SPECULATIVE))  # misses at every step
    try:
        for mode in (ExecuteMode.SPECULATIVE, ExecuteMode.EXACT):
            om.use_policy(dataclasses.replace(om.policy, execute=mode))
            ref, fast = DecodeScorer(Engine(om)), SharedPrefixScorer(Engine(om))
            for pairs in (TREE, SPLIT, TREE):
                for want, got in zip(ref.score(pairs), fast.score(pairs)):
                    assert abs(got.logprob - want.logprob) < 1e-5, (family, mode, got.logprob, want.logprob)
                    assert got.greedy == want.greedy
            if family not in ("gpt_oss", "gpt_oss_mxfp4"):  # sliding window 4: some cuts re-run the context
                assert fast.prefills == ref.prefills
    finally:
        om.close()


def test_one_decode_step_per_distinct_prefix(tiny_models):
    om = load_offloaded(tiny_models["qwen3_moe"], RuntimeConfig(predictor=Predictor.ROUTER,
                                                                execute=ExecuteMode.SPECULATIVE))
    try:
        engine = Engine(om)
        calls = []
        forward = engine.forward
        engine.forward = lambda ids, kind, *a, **k: calls.append((kind, list(ids))) or forward(ids, kind, *a, **k)
        scorer = SharedPrefixScorer(engine)
        scorer.score(TREE)
    finally:
        om.close()
    # the context's last token, then the distinct decode inputs: 31, 31 77, 31 77 12, 64, 64 2
    decoded = [ids for kind, ids in calls if kind == "decode"]
    assert decoded == [[9], [31], [77], [12], [64], [2]]
    assert scorer.decode_steps == 5  # DecodeScorer: 3 + 2 + 2 + 0 + 1 = 8
    assert [len(ids) for kind, ids in calls if kind == "prefill"] == [len(CTX) - 1]
    assert engine.cached_ids == CTX[:-1]  # only prefilled positions stay cached


def test_scorer_for_keeps_the_reference_where_residency_matters(tiny_models):
    engine = object()
    assert type(scorer_for(engine, ExecuteMode.EXACT)) is PrefillScorer
    assert type(scorer_for(engine, ExecuteMode.EXACT, "decode")) is SharedPrefixScorer
    assert type(scorer_for(engine, ExecuteMode.SPECULATIVE)) is SharedPrefixScorer
    assert type(scorer_for(engine, ExecuteMode.GUARDED)) is DecodeScorer
