"""``--workers``: an evaluation split over processes by item gives the records one process gives, merged into
the same per-arm files (eval/workers.py); guarded scores are the same on every run (no timed gate in eval)."""

from __future__ import annotations

import json

import pytest
from test_eval_cli import task_dir  # noqa: F401  (a fixture)

from moespec.config import ExecuteMode, Predictor, RuntimeConfig
from moespec.eval.arms import Arm, gated
from moespec.eval.data import load_task
from moespec.eval.run import EvalConfig, evaluate
from moespec.eval.workers import evaluate_split, part_dirs, shares
from moespec.integrity import JSON_DIGEST_KEY

EXACT = Arm(ExecuteMode.EXACT, Predictor.ROUTER)
SPEC = Arm(ExecuteMode.SPECULATIVE, Predictor.ROUTER)
GUARD = Arm(ExecuteMode.GUARDED, Predictor.ROUTER, 0.2)
ARMS = [EXACT, SPEC, GUARD]


def _run(folder, tasks, out, workers):
    from moespec.chat.open_model import open_model

    cfg = RuntimeConfig(cache_experts=5, device="cpu")
    opened = open_model(str(folder), cfg)
    steps = []
    try:
        progress = lambda a, t, total, done: (lambda: steps.append((a.name, t.name)))  # noqa: E731
        ecfg = EvalConfig(out_dir=out)
        if workers == 1:
            got = evaluate(opened, cfg, tasks, ARMS, ecfg, progress)
        else:
            got = evaluate_split(opened, str(folder), cfg, tasks, ARMS, ecfg, workers, 1, progress)
    finally:
        opened.close()
    return {name: r.tasks for name, r in got.items()}, steps


def test_two_workers_equal_one_and_guarded_is_reproducible(tiny_models, task_dir, tmp_path):  # noqa: F811
    tasks = [load_task(n, task_dir / f"{n}.jsonl") for n in ("quiz", "sums")]
    model = tiny_models["qwen3_moe"]
    one, steps1 = _run(model, tasks, tmp_path / "one", 1)
    again, _ = _run(model, tasks, tmp_path / "again", 1)
    two, steps2 = _run(model, tasks, tmp_path / "two", 2)
    assert sorted(steps1) == sorted(steps2) and len(steps1) == 3 * (3 + 2)  # every arm-item once, from both workers
    assert part_dirs(tmp_path / "two") == []  # the worker's part was merged and removed
    for arm in ARMS:
        for task in ("quiz", "sums"):
            a, b, c = (r[arm.name][task]["items"] for r in (one, again, two))
            assert set(a) == set(c) == {str(i) for i in range(3 if task == "quiz" else 2)}
            for doc, want in a.items():
                if task == "quiz":
                    assert b[doc]["logprobs"] == want["logprobs"], (arm.name, doc)  # the same process: bit for bit
                    assert c[doc]["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5), (arm.name, doc)
                    assert (c[doc]["acc"], c[doc]["acc_norm"]) == (want["acc"], want["acc_norm"])
                else:
                    assert b[doc]["text"] == c[doc]["text"] == want["text"], (arm.name, doc)
    # the merged file on disk is the one a resumed run reads
    saved = json.loads((tmp_path / "two" / f"{GUARD.name}.json").read_text())
    assert set(saved["tasks"]["quiz"]["items"]) == {"0", "1", "2"} and saved["key"]["prediction_gate"] is False


def test_a_part_left_by_a_killed_run_is_merged_at_the_next_start(tiny_models, task_dir, tmp_path):  # noqa: F811
    tasks = [load_task("quiz", task_dir / "quiz.jsonl")]
    model = tiny_models["qwen3_moe"]
    whole, _ = _run(model, tasks, tmp_path / "whole", 1)
    out = tmp_path / "out"
    _run(model, tasks, out, 2)
    part = out / ".worker-1"
    part.mkdir()
    for arm in ARMS:  # as if worker 1 had scored item 2 and been killed before the merge
        data = json.loads((out / f"{arm.name}.json").read_text())
        data.pop(JSON_DIGEST_KEY, None)
        (part / f"{arm.name}.json").write_text(json.dumps(data))
        data["tasks"]["quiz"]["items"].pop("2")
        (out / f"{arm.name}.json").write_text(json.dumps(data))
    got, steps = _run(model, tasks, out, 2)
    assert steps == [] and part_dirs(out) == []  # nothing left to score: the part held item 2
    for arm in ARMS:
        assert set(got[arm.name]["quiz"]["items"]) == {"0", "1", "2"}
        assert got[arm.name]["quiz"]["items"]["2"]["logprobs"] == pytest.approx(
            whole[arm.name]["quiz"]["items"]["2"]["logprobs"], abs=1e-5)


def test_shares_deal_each_task_round_robin(task_dir):  # noqa: F811
    quiz = load_task("quiz", task_dir / "quiz.jsonl")
    done = {"exact": {"quiz": {"0"}}, "spec": {"quiz": {"0", "1"}}}  # item 0 is done by every arm
    parts = shares([quiz], done, 2)
    assert [[it.doc_id for it in p[0].items] for p in parts] == [[1], [2]]
    assert all(p[0].sha256 == quiz.sha256 for p in parts)


def test_only_guarded_runs_without_the_gate():
    assert gated(GUARD, True) is False and gated(EXACT, True) is True and gated(SPEC, False) is False


def test_workers_below_one_is_refused(tiny_models, task_dir):  # noqa: F811
    from test_eval_cli import _run as cli

    res = cli(tiny_models["qwen3_moe"], "--data", task_dir, "--tasks", "quiz", "--workers", 0)
    assert res.exit_code != 0 and "--workers 0 must be at least 1" in res.output


def test_one_bar_per_task_counts_every_arm_and_the_time_line_gives_the_wall_time():
    from moespec.cli.eval_cmd import _Bar
    from moespec.eval.data import TaskData
    from moespec.eval.results import ArmResults
    from moespec.eval.table import time_line

    task = TaskData("quiz", "choice", (), "x", "0")
    with _Bar() as bar:
        steps = [bar.start(arm, task, 5, done) for arm, done in ((EXACT, 2), (SPEC, 1), (GUARD, 0))]
        for step in steps:
            step()
        (bar_id, names), = bar.bars.values()
        t = bar.progress.tasks[bar_id]
        assert (t.total, t.completed, len(names)) == (15, 6, 3) and t.description.startswith("quiz")
    results = {a.name: ArmResults(None, {}, {"quiz": {"seconds": s, "items": {}}}) for a, s in ((EXACT, 61.0), (SPEC, 30.0))}
    line = time_line([EXACT, SPEC], results, 65.5, 2)
    assert line == "wall time 1m05s (2 workers); scoring time per arm (items summed): exact 1m01s, speculative router 0m30s"


def test_a_worker_slower_than_the_parent_is_waited_for(tiny_models, task_dir, tmp_path, monkeypatch):  # noqa: F811
    """The parent ends its share first (the worker still starts a process, imports and opens the model):
    it waits for the worker however long it takes; the Ctrl-C bound (JOIN_S) is for an interrupted run
    only (CI, on a loaded machine, had a worker stopped 30 s after the parent's share: exit code -15)."""
    from moespec.eval import workers

    monkeypatch.setattr(workers, "JOIN_S", 0.0)
    tasks = [load_task("quiz", task_dir / "quiz.jsonl")]
    got, steps = _run(tiny_models["qwen3_moe"], tasks, tmp_path / "two", 2)
    assert len(steps) == 3 * 3  # every arm-item, the worker's share included
    assert all(set(got[a.name]["quiz"]["items"]) == {"0", "1", "2"} for a in ARMS)
