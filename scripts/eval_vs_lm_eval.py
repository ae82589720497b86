"""Exact-mode `moespec eval` against lm-evaluation-harness's own `hf` model, item by item, offline.

    python scripts/eval_vs_lm_eval.py --results ~/eval-table --tasks arc_easy,boolq,sciq --limit 40

Writes the vendored multiple-choice items as local lm-eval tasks (tests/lm_eval_tasks.py: the same
context and continuation strings, lm-eval's default target delimiter), runs lm-eval's `hf` model on the
default model's folder in float32, and compares every document with the exact arm's records in
RESULTS/exact.json (from `moespec eval ... --out RESULTS`): acc and acc_norm must be the same, and the
largest log-likelihood difference is printed. Needs `pip install "moespec[eval]"`. Prints one JSON line.

transformers' own MoE forward is slow on CPU (8-9 s for 170 tokens of the default model on one busy
core, against well under a second in moespec's runtime), so long-context tasks (BoolQ, SciQ) take
hours there: ARC-Easy's 30 first items took lm-eval's hf model 4 min 45 s (OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    from lm_eval_tasks import per_doc, run_lm_eval, write_choice_task

    from moespec.eval.data import load_task
    from moespec.eval.run import Limits, limited
    from moespec.eval.tasks import resolve_tasks
    from moespec.paths import DEFAULT_MODEL_FOLDER, models_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, required=True, help="--out folder of a moespec eval run")
    ap.add_argument("--tasks", default="arc_easy,boolq,sciq")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the default model)")
    args = ap.parse_args()
    folder = args.model or models_dir() / DEFAULT_MODEL_FOLDER
    ours = json.loads((args.results / "exact.json").read_text())["tasks"]
    tasks = [limited(load_task(s.name, s.path), Limits(args.limit)) for s in resolve_tasks(args.tasks)]
    with tempfile.TemporaryDirectory() as tmp:
        for t in tasks:
            write_choice_task(Path(tmp), f"moespec_{t.name}", t.items)
        hf = run_lm_eval("hf", f"pretrained={folder},dtype=float32", Path(tmp), [f"moespec_{t.name}" for t in tasks])
    report = {}
    for t in tasks:
        theirs = per_doc(hf, f"moespec_{t.name}")
        mine = ours[t.name]["items"]
        same_acc = same_norm = 0
        worst = 0.0
        for i, it in enumerate(t.items):  # lm-eval numbers documents 0.. in file order
            want, got = theirs[i], mine[str(it.doc_id)]
            same_acc += want["acc"] == got["acc"]
            same_norm += want["acc_norm"] == got["acc_norm"]
            lps = [float(r[0][0]) for r in want["resps"]]
            worst = max(worst, max(abs(a - b) for a, b in zip(lps, got["logprobs"])))
        acc = [sum(theirs[i]["acc"] for i in range(len(t.items))) / len(t.items),
               sum(mine[str(it.doc_id)]["acc"] for it in t.items) / len(t.items)]
        report[t.name] = {"items": len(t.items), "same_acc": same_acc, "same_acc_norm": same_norm,
                          "max_abs_logprob_diff": worst, "acc_lm_eval_hf": acc[0], "acc_moespec_exact": acc[1]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
