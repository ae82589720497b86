"""(slow) On the default model, exact-mode `moespec eval` equals lm-eval's own `hf` model item by item on
ARC-Easy (same acc and acc_norm per document, log-likelihoods within 1e-4), offline."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")

from lm_eval_tasks import per_doc, run_lm_eval, write_choice_task  # noqa: E402

pytestmark = pytest.mark.slow


def test_exact_equals_lm_eval_hf_on_arc_easy(default_model, tmp_path, monkeypatch):
    from moespec.chat.open_model import open_model
    from moespec.config import RuntimeConfig
    from moespec.eval.arms import make_arms
    from moespec.eval.data import load_task
    from moespec.eval.run import EvalConfig, Limits, evaluate, limited
    from moespec.eval.tasks import known_tasks

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    task = limited(load_task("arc_easy", known_tasks()["arc_easy"].path), Limits(12))
    opened = open_model(str(default_model), RuntimeConfig(cache_experts=120))
    try:
        cfg = RuntimeConfig(cache_experts=120)
        results = evaluate(opened, cfg, [task], make_arms([], 0.2), EvalConfig(out_dir=tmp_path / "out", limit=Limits(12)))
    finally:
        opened.close()
    mine = results["exact"].tasks["arc_easy"]["items"]
    write_choice_task(tmp_path / "tasks", "arc12", task.items)
    theirs = per_doc(run_lm_eval("hf", f"pretrained={default_model},dtype=float32", tmp_path / "tasks", ["arc12"]),
                     "arc12")
    for i, it in enumerate(task.items):
        got, want = mine[str(it.doc_id)], theirs[i]
        assert (got["acc"], got["acc_norm"]) == (want["acc"], want["acc_norm"]), it.doc_id
        assert max(abs(a - float(r[0][0])) for a, r in zip(got["logprobs"], want["resps"])) < 1e-4
