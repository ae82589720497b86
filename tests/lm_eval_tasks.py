"""Write choice and generation tasks as local lm-evaluation-harness tasks (a YAML over a JSONL of docs),
so lm-eval's own ``hf`` model and moespec's scores can be compared item by item, offline.

A choice document becomes ``{"context", "choices", "gold"}`` with the continuations' leading space
dropped from the choices: lm-eval puts its target delimiter " " back, so it scores the same
(context, continuation) strings, and its acc_norm counts the same characters.
"""

from __future__ import annotations

import json
from pathlib import Path

MC_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: context
doc_to_target: answer
generation_kwargs:
  until: {until}
  do_sample: false
  max_gen_toks: {max_gen_toks}
metric_list:
  - metric: exact_match
"""


def write_choice_task(folder: Path, name: str, items) -> Path:
    """``items`` (ChoiceItems sharing one context each) as lm-eval task ``name`` in ``folder``; the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    with open(data, "w") as fh:
        for it in items:
            assert len(set(it.contexts)) == 1 and all(c.startswith(" ") for c in it.continuations)
            fh.write(json.dumps({"context": it.contexts[0], "choices": [c[1:] for c in it.continuations],
                                 "gold": it.gold}) + "\n")
    (folder / f"{name}.yaml").write_text(MC_YAML.format(name=name, data=data))
    return folder


def write_generate_task(folder: Path, name: str, docs: list[dict], until: list[str], max_gen_toks: int) -> Path:
    """``docs`` ({"context", "answer"}) as a greedy generate_until task ``name`` in ``folder``; the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{name}.yaml").write_text(GEN_YAML.format(name=name, data=data, until=json.dumps(until),
                                                         max_gen_toks=max_gen_toks))
    return folder


def run_lm_eval(model: str, model_args: str, folder: Path, tasks: list[str], limit: int | None = None) -> dict:
    """lm-eval's simple_evaluate over the local tasks in ``folder``, with per-sample logs; its result dict."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import moespec.harness.model  # noqa: F401  (registers "moespec")

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, limit=limit,
                                   task_manager=TaskManager(include_path=str(folder)), log_samples=True,
                                   batch_size=1, device="cpu", num_fewshot=0)


def per_doc(result: dict, task: str) -> dict[int, dict]:
    """doc_id -> that sample's record (its filtered responses and metrics) in ``result``."""
    return {s["doc_id"]: s for s in result["samples"][task]}
