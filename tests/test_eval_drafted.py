"""drafted_greedy (eval/drafted.py) yields Engine.generate's greedy tokens in exact mode whatever the drafts
(right, partly right, wrong, none), with fewer forwards when they are right, on tiny models."""

from __future__ import annotations

import pytest

from moespec.config import RuntimeConfig, SamplingConfig
from moespec.eval.drafted import drafted_greedy

PROMPT = [3, 17, 5, 22, 9, 11, 4]
N = 14


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def engine(request, tiny_models):
    from moespec.chat.open_model import open_model

    opened = open_model(str(tiny_models[request.param]), RuntimeConfig(cache_experts=5, device="cpu"))
    yield opened.engine
    opened.close()


def _counted(engine):
    calls = []
    forward = engine.forward
    engine.forward = lambda ids, kind, *a, **k: calls.append((kind, len(ids))) or forward(ids, kind, *a, **k)
    return calls, forward


def _reference(engine, max_new=N, stop_ids=frozenset()):
    engine.reset()
    return list(engine.generate(PROMPT, SamplingConfig(max_new_tokens=max_new), stop_ids))


def _drafted(engine, drafts, max_new=N, stop_ids=frozenset(), block=32):
    engine.reset()
    calls, forward = _counted(engine)
    try:
        got = list(drafted_greedy(engine, PROMPT, max_new, set(stop_ids), drafts, block))
    finally:
        engine.forward = forward
    return got, calls


def test_the_same_tokens_whatever_the_drafts(engine):
    want = _reference(engine)
    assert len(want) == N
    wrong_at_5 = want[:5] + [(want[5] + 1) % 50] + want[6:]
    for drafts in ([], [want], [wrong_at_5], [[(t + 7) % 50 for t in want]], [wrong_at_5, want], [want[:3]]):
        got, _ = _drafted(engine, drafts)
        assert got == want, drafts
    got, _ = _drafted(engine, [want], block=4)  # checked four at a time
    assert got == want


def test_a_right_draft_is_checked_in_one_forward(engine):
    want = _reference(engine)
    _, calls = _drafted(engine, [want])
    assert calls == [("prefill", len(PROMPT)), ("prefill", N - 1)]  # the prompt, then every guess at once
    _, calls = _drafted(engine, [])
    assert calls == [("prefill", len(PROMPT))] + [("decode", 1)] * (N - 1)  # no draft: as Engine.generate
    wrong_at_5 = want[:5] + [(want[5] + 1) % 50] + want[6:]
    _, calls = _drafted(engine, [wrong_at_5])
    # the guess keeps 4 (after the first token), then no draft continues the text: one decode per token
    assert calls[:2] == [("prefill", len(PROMPT)), ("prefill", N - 1)]
    assert calls[2:] == [("decode", 1)] * (N - 6)


def test_stops_as_generate_does(engine):
    want = _reference(engine)
    stop = {want[6]}
    ref = _reference(engine, stop_ids=stop)
    got, _ = _drafted(engine, [want], stop_ids=stop)
    assert got == ref == want[: want.index(want[6]) + 1]
    got, _ = _drafted(engine, [want], max_new=5)
    assert got == want[:5]


def test_after_a_drafted_generation_the_cache_continues_exactly(engine):
    want = _reference(engine)
    engine.reset()
    bad = [(t + 1) % 50 for t in want[8:11]]
    gen = drafted_greedy(engine, PROMPT, N, set(), [want[:8] + bad])
    got = [next(gen) for _ in range(10)]  # past the guess that failed at its 9th token
    assert got == want[:10]
    assert engine.cached_ids == PROMPT + want[:9]  # what Engine.generate holds after yielding 10 tokens
