"""Choice log-likelihoods through the decode path equal the prefill path and transformers (float32, 1e-4).

Three paths: DecodeScorer (one token per decode step), PrefillScorer (exact mode's fast path: each
choice in one forward) and the slow reference prefill_logprob (one prefill from scratch per token).

On every architecture's tiny model (GPT-OSS decodes past its sliding window of 4, where a KV cut
can fail and the context runs again), for choices sharing a context and for WinoGrande-style choices
whose contexts differ. An item costs one context prefill whatever its number of choices, and in
speculative mode the decode path changes even a one-token answer's score (prefill would not).
"""

from __future__ import annotations

import pytest
import torch
from tiny import reference_model

from moespec.config import ExecuteMode, Predictor, RuntimeConfig
from moespec.eval.score import DecodeScorer, PrefillScorer, encode_pair, prefill_logprob, shared_length
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "gpt_oss_mxfp4", "deepseek_v2",
            "deepseek_v3", "glm4_moe_lite"]
CTX = [5, 17, 99, 3, 200, 41, 7, 88, 120, 9]
SHARED = [(CTX, [31]), (CTX, [64, 2, 250]), (CTX, [31, 77, 12, 5])]  # one context, three answers
SPLIT = [(CTX[:6] + [11, 12], [90, 91, 92]), (CTX[:6] + [13], [90, 91, 92])]  # the option in the context


def _transformers_logprob(ref, ctx: list[int], cont: list[int]) -> float:
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(ref(ids).logits[0].float(), dim=-1)  # [T, V]
    return float(sum(logp[len(ctx) + i - 1, t] for i, t in enumerate(cont)))


@pytest.fixture
def folder_of(tiny_models, adapter_models):
    return lambda family: {**tiny_models, **adapter_models}[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_path_equals_prefill_path_and_transformers(folder_of, family):
    folder = folder_of(family)
    ref = reference_model(folder)
    k = ref.config.num_experts_per_tok
    om = load_offloaded(folder, RuntimeConfig(cache_experts=2 * k + 1, predictor=Predictor.ROUTER))
    try:
        scorer, fast = DecodeScorer(Engine(om)), PrefillScorer(Engine(om))
        for pairs in (SHARED, SPLIT, SHARED):  # the third reuses the KV prefix the first left
            for (ctx, cont), score, quick in zip(pairs, scorer.score(pairs), fast.score(pairs)):
                want = _transformers_logprob(ref, ctx, cont)
                slow = prefill_logprob(Engine(om, reuse_kv=False), ctx, cont)
                for got in (score, quick, slow):
                    assert abs(got.logprob - want) < 1e-4, (family, got.logprob, want)
                    assert got.greedy == slow.greedy
        if family not in ("gpt_oss", "gpt_oss_mxfp4"):  # sliding window 4: some cuts re-run the context
            assert scorer.prefills == fast.prefills == 3
    finally:
        om.close()


def test_one_prefill_per_item_whatever_the_choices(tiny_models):
    om = load_offloaded(tiny_models["qwen3_moe"], RuntimeConfig(predictor=Predictor.ROUTER))
    calls = []
    engine = Engine(om)
    forward = engine.forward
    engine.forward = lambda ids, kind, reused=0: calls.append((kind, len(ids))) or forward(ids, kind, reused)
    try:
        five = [(CTX, [i, i + 1]) for i in range(5)]
        DecodeScorer(engine).score(five)
    finally:
        om.close()
    prefills = [n for kind, n in calls if kind == "prefill"]
    assert prefills == [len(CTX) - 1]  # one prefill of the context less its last token
    # the last context token once, then one step per continuation token but the last
    assert [n for kind, n in calls if kind == "decode"] == [1] * (1 + 5 * 1)


def test_speculative_mode_changes_a_one_token_answer(tiny_models):
    folder = tiny_models["olmoe"]
    pairs = [(CTX, [31]), (CTX, [64])]
    scores = {}
    for mode in (ExecuteMode.EXACT, ExecuteMode.SPECULATIVE):
        om = load_offloaded(folder, RuntimeConfig(predictor=Predictor.ROUTER, execute=mode))
        try:
            scores[mode] = [s.logprob for s in DecodeScorer(Engine(om)).score(pairs)]
        finally:
            om.close()
    assert all(abs(a - b) > 1e-4 for a, b in zip(scores[ExecuteMode.EXACT], scores[ExecuteMode.SPECULATIVE]))


def test_shared_length_stops_at_the_shortest_context():
    assert shared_length(SHARED) == len(CTX)
    assert shared_length(SPLIT) == 6
    assert shared_length([([1, 2], [3]), ([1, 2, 3], [4])]) == 2  # never past a context's end


def test_encode_pair_moves_trailing_spaces_and_splits_after_the_context(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["qwen3_moe"])
    ctx, cont = encode_pair(tok, "Answer: ", "yes")
    assert tok.decode(ctx) == "Answer:" and tok.decode(cont) == " yes"
    ctx, cont = encode_pair(tok, "", "yes")
    assert ctx == [tok.eos_token_id] and tok.decode(cont) == "yes"  # no BOS: the prefix token is EOS
