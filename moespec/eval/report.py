"""The quality table: each task's score per arm, its 95 % interval, and Δ vs exact on the same items.

Also the JSON: a summary with every interval and test, and one lm-evaluation-harness results object
per arm (``results`` / ``configs`` / ``versions`` / ``n-shot`` / ``higher_is_better`` / ``n-samples``
/ ``config``, metric keys ``acc,none``, ``exact_match,flexible-extract`` ... as lm-eval writes them).
Only items every arm has scored are counted, so every Δ is paired.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from moespec.eval.arms import Arm
from moespec.eval.data import TaskData
from moespec.eval.stats import Interval, Paired, mean_interval, paired

# per task kind: the metric the table shows first, then the second one
METRICS = {"choice": ("acc", "acc_norm"), "generate": ("exact_match,flexible-extract", "exact_match,strict-match")}
N_SHOT = {"gsm8k": 8}  # the vendored prompts; every other vendored task is 0-shot


@dataclass(frozen=True)
class Cell:
    """One task × arm × metric over the paired items."""

    n: int
    score: Interval
    vs_exact: Paired | None  # None for exact itself
    agree: float = 1.0  # share of items whose answer (chosen choice, generated text) is exact's


def paired_items(task: TaskData, results: dict) -> list[str]:
    """doc_ids (as saved) of ``task``'s items that every arm has scored, in task order."""
    have = [set(r.tasks.get(task.name, {}).get("items", {})) for r in results.values()]
    return [str(it.doc_id) for it in task.items if all(str(it.doc_id) in h for h in have)]


def _answer(record: dict):
    """What an item's record answered: the chosen choice (first maximum) or the generated text."""
    if "logprobs" in record:
        lps = record["logprobs"]
        return max(range(len(lps)), key=lambda i: (lps[i], -i))
    return record["text"]


def summarise(tasks: list[TaskData], arms: list[Arm], results: dict) -> dict[str, dict[str, dict[str, Cell]]]:
    """task -> metric -> arm name -> Cell (arms in order, exact first)."""
    out: dict[str, dict[str, dict[str, Cell]]] = {}
    for task in tasks:
        ids = paired_items(task, results)
        recs = {a.name: [results[a.name].tasks[task.name]["items"][i] for i in ids] for a in arms}
        base = [_answer(r) for r in recs[arms[0].name]]
        agree = {a.name: sum(_answer(r) == b for r, b in zip(recs[a.name], base)) / max(len(ids), 1) for a in arms}
        per_metric: dict[str, dict[str, Cell]] = {}
        for metric in METRICS[task.kind]:
            scores = {a.name: [float(r[metric]) for r in recs[a.name]] for a in arms}
            exact = scores[arms[0].name]
            per_metric[metric] = {a.name: Cell(len(ids), mean_interval(scores[a.name]),
                                               None if i == 0 else paired(scores[a.name], exact), agree[a.name])
                                  for i, a in enumerate(arms)}
        out[task.name] = per_metric
    return out


def _interval(iv: Interval) -> dict:
    return {"value": iv.value, "ci95": [iv.low, iv.high]}


def summary_json(model: str, arms: list[Arm], tasks: list[TaskData], results: dict, cells: dict) -> dict:
    """The machine-readable summary: arms (with wall seconds), and per task and metric every arm's
    score, interval, Δ vs exact with its interval, McNemar p, discordant counts and the share of items
    answered as exact answered them."""
    arm_rows = [{"name": a.name, "label": a.label, "execute": a.execute.value, "predictor": a.predictor.value,
                 "fetch_threshold": a.threshold,
                 "seconds": sum(t.get("seconds", 0.0) for t in results[a.name].tasks.values())} for a in arms]
    out_tasks = {}
    for task in tasks:
        metrics = {}
        for metric, by_arm in cells[task.name].items():
            metrics[metric] = {}
            for name, cell in by_arm.items():
                row = {"n": cell.n, **_interval(cell.score)}
                if cell.vs_exact is not None:
                    d = cell.vs_exact
                    row.update(delta=d.delta.value, delta_ci95=[d.delta.low, d.delta.high], p_value=d.p_value,
                               gained=d.gained, lost=d.lost, same_answer_as_exact=cell.agree)
                metrics[metric][name] = row
        out_tasks[task.name] = {"kind": task.kind, "source": task.source, "sha256": task.sha256, "metrics": metrics}
    return {"model": model, "arms": arm_rows, "tasks": out_tasks}


def _lm_eval_key(metric: str, stderr: bool = False) -> str:
    name, _, filt = metric.partition(",")
    return f"{name}{'_stderr' if stderr else ''},{filt or 'none'}"


def lm_eval_results(arm: Arm, model: str, device: str, tasks: list[TaskData], originals: dict[str, int],
                    cells: dict, limit, seconds: float, max_gen_toks: int) -> dict:
    """One arm's results in lm-evaluation-harness's results shape (stderr of the mean as lm-eval computes it)."""
    import math

    from moespec import __version__

    results, configs = {}, {}
    for task in tasks:
        row: dict = {"alias": task.name}
        for metric, by_arm in cells[task.name].items():
            cell = by_arm[arm.name]
            p, n = cell.score.value, cell.n
            row[_lm_eval_key(metric)] = p
            row[_lm_eval_key(metric, stderr=True)] = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else "N/A"
        results[task.name] = row
        configs[task.name] = {
            "task": task.name, "dataset_path": task.source, "output_type":
                "multiple_choice" if task.kind == "choice" else "generate_until",
            "num_fewshot": N_SHOT.get(task.name, 0), "repeats": 1,
            "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                            for m in dict.fromkeys(m.partition(",")[0] for m in METRICS[task.kind])],
            **({"generation_kwargs": {"until": "from the task file", "do_sample": False, "max_gen_toks": max_gen_toks}}
               if task.kind == "generate" else {}),
            "metadata": {"sha256": task.sha256}}
    return {
        "results": results, "group_subtasks": {t.name: [] for t in tasks}, "configs": configs,
        "versions": {t.name: 1.0 for t in tasks}, "n-shot": {t.name: N_SHOT.get(t.name, 0) for t in tasks},
        "higher_is_better": {t.name: {m.partition(",")[0]: True for m in METRICS[t.kind]} for t in tasks},
        "n-samples": {t.name: {"original": originals[t.name], "effective": next(iter(cells[t.name].values()))[arm.name].n}
                      for t in tasks},
        "config": {"model": "moespec", "model_args": f"pretrained={model},execute={arm.execute.value},"
                   f"predictor={arm.predictor.value}" + (f",fetch_threshold={arm.threshold:g}" if arm.threshold is not None else ""),
                   "batch_size": 1, "device": device,
                   "limit": {t.name: limit.of(t.name) for t in tasks}, "bootstrap_iters": 0},
        "git_hash": None, "date": time.time(), "total_evaluation_time_seconds": f"{seconds:.1f}",
        "moespec_version": __version__,
    }
