"""`moespec eval` end to end on a tiny model with a task folder of its own: the table, the lm-eval-shaped
JSON, resuming (a second run scores nothing again, a cut-short arm file is completed to the same
numbers), stale result files refused, and one-line errors before any model loads."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moespec.cli.app import app

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, ["eval", *map(str, args)], env={"COLUMNS": "80"})


def _line(doc_id, idx, label, context, continuation, kind="loglikelihood"):
    return json.dumps({"request_type": kind, "doc_id": doc_id, "idx": idx, "label": label,
                       "request": {"context": context, "continuation": continuation}, "doc": {}})


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    mc = [_line(0, i, 1, "Question: 2+2?\nAnswer:", c) for i, c in enumerate([" 5", " 4", " four"])]
    mc += [_line(1, i, 0, "Is the sky blue?\nAnswer:", c) for i, c in enumerate([" yes", " no"])]
    mc += [_line(2, i, 0, f"The cat sat because {o}", " was tired.") for i, o in enumerate(["it", "the mat"])]
    (d / "quiz.jsonl").write_text("\n".join(mc) + "\n")
    gen = [json.dumps({"request_type": "generate_until", "doc_id": i, "label": str(i + 2),
                       "request": {"context": f"Q: 1+{i + 1}?\nA:", "stop_sequences": ["\n\n", "Q:"],
                                   "generation_kwargs": {"max_gen_toks": 6}}}) for i in range(2)]
    (d / "sums.jsonl").write_text("\n".join(gen) + "\n")
    (d / "broken.jsonl").write_text(mc[0] + "\n{not json\n")
    return d


ARGS = ("--data", "--tasks", "quiz,sums", "--arms", "exact,speculative:router,guarded:router", "--cache-experts", 4,
        "--device", "cpu")


def test_table_json_and_resume(tiny_models, task_dir, tmp_path):
    model = tiny_models["qwen3_moe"]
    out = tmp_path / "out"
    args = (model, ARGS[0], task_dir, *ARGS[1:], "--out", out)
    res = _run(*args)
    assert res.exit_code == 0, res.output
    assert "quiz n=3" in res.output and "speculative router" in res.output and "guarded router" in res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    files = sorted(p.name for p in out.iterdir())
    assert files == ["exact.json", "guarded-router-tau0.2.json", "results-exact.json",
                     "results-guarded-router-tau0.2.json", "results-speculative-router.json",
                     "speculative-router.json", "summary.json"]
    lm = json.loads((out / "results-speculative-router.json").read_text())
    assert set(lm) >= {"results", "configs", "versions", "n-shot", "higher_is_better", "n-samples", "config"}
    assert set(lm["results"]["quiz"]) == {"alias", "acc,none", "acc_stderr,none", "acc_norm,none", "acc_norm_stderr,none"}
    assert "exact_match,flexible-extract" in lm["results"]["sums"]
    assert lm["n-samples"]["quiz"] == {"original": 3, "effective": 3}
    assert lm["config"]["model_args"].endswith("execute=speculative,predictor=router")
    first = json.loads((out / "summary.json").read_text())

    # resume: nothing is scored again; a cut-short arm is completed to the same records
    exact_s = json.loads((out / "exact.json").read_text())["tasks"]["quiz"]["seconds"]
    spec = json.loads((out / "speculative-router.json").read_text())
    kept = spec["tasks"]["quiz"]["items"].pop("2")
    from moespec.integrity import seal_json

    (out / "speculative-router.json").write_text(json.dumps(seal_json(spec)))  # sealed again: cut, not damaged
    res = _run(*args, "--json")
    assert res.exit_code == 0, res.output
    again = json.loads(res.stdout)
    redone = json.loads((out / "speculative-router.json").read_text())["tasks"]["quiz"]["items"]["2"]
    assert redone["acc"] == kept["acc"] and redone["logprobs"] == pytest.approx(kept["logprobs"], abs=1e-5)
    assert again["summary"]["tasks"] == first["tasks"]
    assert json.loads((out / "exact.json").read_text())["tasks"]["quiz"]["seconds"] == exact_s  # nothing re-scored

    # another cache: the guarded arm's file is refused (exact's still fits), --fresh starts it again
    res = _run(*args[:-4], "--cache-experts", 5, "--device", "cpu", "--out", out)
    assert res.exit_code == 2 and "cache_slots 4 (now 5)" in " ".join(res.output.split())
    assert _run(*args[:-4], "--cache-experts", 5, "--device", "cpu", "--out", out, "--fresh").exit_code == 0


def test_one_line_errors_before_the_model_loads(task_dir):
    cases = [
        (("--tasks", "arc_easy,nosuch"), "unknown task 'nosuch'; known tasks: arc_easy, boolq, gsm8k, sciq, winogrande"),
        (("--data", task_dir, "--tasks", "broken"), "broken.jsonl line 2: not JSON"),
        (("--limit", 0), "--limit 0 must be at least 1"),
        (("--execute", "exact,fast"), "--execute 'fast' is not valid"),
        (("--arms", "exact,speculative:psychic"), "--arms 'psychic' is not valid"),
        (("--data", task_dir / "nope"), "is not a folder"),
    ]
    for args, message in cases:
        res = _run("./no-model-needed", *args)
        assert res.exit_code == 2, (args, res.output)
        lines = res.output.strip().splitlines()
        assert lines[0].startswith("error:") and message in lines[0], (args, res.output)
        assert "Traceback" not in res.output


def test_help_has_examples():
    res = _run("--help")
    assert res.exit_code == 0 and "moespec eval --tasks arc_easy,boolq --limit 50" in res.output
