"""Item-major evaluation (every arm scores an item before the next; eval/run.run_arms) equals the arm-by-arm
reference (run_arm) record by record on a tiny model: exact and speculative log-likelihoods within 1e-5
(the same greedy texts), with one context prefill per multiple-choice item for all decode-path arms
together, a second prefill for a second arm whose outputs depend on residency (guarded), and the
exact prefill-path arm's own context forward.
"""

from __future__ import annotations

import pytest
from test_eval_cli import task_dir  # noqa: F401  (a fixture)

from moespec.config import ExecuteMode, Predictor, RuntimeConfig
from moespec.eval.arms import Arm
from moespec.eval.data import load_task
from moespec.eval.run import EvalConfig, evaluate, residency_matters

EXACT = Arm(ExecuteMode.EXACT, Predictor.ROUTER)
SPEC = Arm(ExecuteMode.SPECULATIVE, Predictor.ROUTER)
SPEC_NONE = Arm(ExecuteMode.SPECULATIVE, Predictor.NONE)
GUARD = Arm(ExecuteMode.GUARDED, Predictor.ROUTER, 0.2)
GUARD_NONE = Arm(ExecuteMode.GUARDED, Predictor.NONE, 0.2)


def _evaluate(folder, tasks, arms, out, item_major, exact_path="prefill"):
    from moespec.chat.open_model import open_model

    cfg = RuntimeConfig(cache_experts=5, device="cpu")
    opened = open_model(str(folder), cfg)
    calls = []
    forward = opened.engine.forward
    opened.engine.forward = lambda ids, kind, *a, **k: calls.append((kind, len(ids))) or forward(ids, kind, *a, **k)
    try:
        got = evaluate(opened, cfg, tasks, arms, EvalConfig(out_dir=out, item_major=item_major,
                                                            exact_path=exact_path))
    finally:
        opened.close()
    return {name: r.tasks for name, r in got.items()}, calls


def _items(results, arm, task):
    return results[arm.name][task]["items"]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_item_major_equals_arm_by_arm(tiny_models, task_dir, tmp_path, family):  # noqa: F811
    tasks = [load_task(n, task_dir / f"{n}.jsonl") for n in ("quiz", "sums")]
    arms = [EXACT, SPEC, SPEC_NONE, GUARD]
    ref, _ = _evaluate(tiny_models[family], tasks, arms, tmp_path / "ref", item_major=False)
    got, _ = _evaluate(tiny_models[family], tasks, arms, tmp_path / "got", item_major=True)
    for arm in (EXACT, SPEC, SPEC_NONE):
        for doc, want in _items(ref, arm, "quiz").items():
            have = _items(got, arm, "quiz")[doc]
            assert have["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5), (arm.name, doc)
            assert (have["acc"], have["acc_norm"], have["greedy"]) == (want["acc"], want["acc_norm"], want["greedy"])
        for doc, want in _items(ref, arm, "sums").items():
            assert _items(got, arm, "sums")[doc]["text"] == want["text"], (arm.name, doc)
    assert set(_items(got, GUARD, "quiz")) == set(_items(ref, GUARD, "quiz"))  # guarded: its own timing


def test_one_context_prefill_per_item_for_every_decode_arm(tiny_models, task_dir, tmp_path):  # noqa: F811
    quiz = [load_task("quiz", task_dir / "quiz.jsonl")]
    model = tiny_models["qwen3_moe"]
    _, alone = _evaluate(model, quiz, [SPEC], tmp_path / "a", item_major=True, exact_path="decode")
    _, three = _evaluate(model, quiz, [EXACT, SPEC, SPEC_NONE], tmp_path / "b", item_major=True,
                         exact_path="decode")
    prefills = [c for c in alone if c[0] == "prefill"]
    assert len(prefills) == 3  # one per item (3 items)
    assert [c for c in three if c[0] == "prefill"] == prefills  # the same three, shared by the 3 arms
    assert sum(c[0] == "decode" for c in three) == 3 * sum(c[0] == "decode" for c in alone)
    # a second arm whose outputs depend on residency runs the item's prefill again, from an empty cache
    _, guarded = _evaluate(model, quiz, [SPEC, GUARD, GUARD_NONE], tmp_path / "c", item_major=True)
    assert [c for c in guarded if c[0] == "prefill"] == [p for p in prefills for _ in range(2)]


def test_residency_matters():
    from moespec.config import OnMiss

    assert residency_matters(GUARD, OnMiss.FETCH)
    assert not residency_matters(SPEC, OnMiss.FETCH) and not residency_matters(EXACT, OnMiss.FETCH)
    assert residency_matters(SPEC, OnMiss.AUTO) and residency_matters(EXACT, OnMiss.HOST)


def test_prefill_exact_never_runs_one_token(tiny_models):
    """A one-token prefill would run the decode path, where speculation acts; prefill_exact runs two."""
    from moespec.eval.score import prefill_exact
    from moespec.runtime.engine import Engine
    from moespec.runtime.load import load_offloaded

    ids = [5, 9, 14, 3, 22, 7, 11, 30]
    om = load_offloaded(tiny_models["qwen3_moe"], RuntimeConfig(cache_experts=5, predictor=Predictor.ROUTER,
                                                                 execute=ExecuteMode.SPECULATIVE))
    try:
        engine = Engine(om)
        calls = []
        forward = engine.forward
        engine.forward = lambda i, kind, *a, **k: calls.append(len(i)) or forward(i, kind, *a, **k)
        engine.prefill(ids[:-1])
        got = prefill_exact(engine, ids)  # all but one cached
        again = prefill_exact(engine, ids)  # all cached
        engine.reset()
        want = engine.prefill(ids)
    finally:
        om.close()
    assert calls == [7, 2, 2, 8]
    assert (got - want).abs().max() < 1e-5 and (again - want).abs().max() < 1e-5


def test_a_generation_prompt_is_prefilled_once(tiny_models, task_dir, tmp_path):  # noqa: F811
    sums = [load_task("sums", task_dir / "sums.jsonl")]
    model = tiny_models["qwen3_moe"]
    _, alone = _evaluate(model, sums, [SPEC], tmp_path / "a", item_major=True)
    _, two = _evaluate(model, sums, [SPEC, SPEC_NONE], tmp_path / "b", item_major=True)
    firsts = [c for c in alone if c[0] == "prefill"]
    assert len(firsts) == 2  # one per item
    assert [c for c in two if c[0] == "prefill"] == [c for p in firsts for c in (p, ("prefill", 2))]
