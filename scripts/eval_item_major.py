"""Item-major vs arm-by-arm `moespec eval` on the same items, paired rounds in one process.

    python scripts/eval_item_major.py --arms exact,speculative:router,speculative:hybrid,guarded:router \\
        --tasks arc_easy,boolq,sciq,winogrande --limit 3 --rounds 2 --cache-experts 120

Each round runs ``moespec.eval.run.evaluate`` twice on one loaded model, arm by arm (``item_major``
False, the reference) and item-major (every arm scores an item before the next, sharing its
tokenisation and context prefill), into fresh result folders, in alternating order. Prints per run
the wall seconds, forwards by kind (count and tokens) and, per arm and task, the seconds per item;
then the ratio of the medians and the largest log-likelihood difference of the residency-independent
arms (exact, speculative) between the two. Quote the figures only from a run under the machine's
exclusive CPU lock. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="exact,speculative:router,guarded:router")
    ap.add_argument("--tasks", default="arc_easy,boolq,sciq,winogrande")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache-experts", type=int, default=120)
    ap.add_argument("--max-gen-toks", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fetch-threshold", type=float, default=0.2)
    args = ap.parse_args()

    from moespec.chat.open_model import open_model
    from moespec.cli.eval_cmd import parse_arm_options
    from moespec.cli.runtime_opts import build_runtime_config
    from moespec.config import ExecuteMode, Predictor
    from moespec.eval.data import load_task
    from moespec.eval.run import EvalConfig, Limits, evaluate, residency_matters
    from moespec.eval.tasks import resolve_tasks

    torch.set_num_threads(args.threads)
    arms = parse_arm_options("", "", args.arms, args.fetch_threshold)
    preds = list(dict.fromkeys(a.predictor for a in arms))
    predicting = next((p for p in preds if p != Predictor.NONE), Predictor.NONE)
    cfg = build_runtime_config(device="auto", dtype="auto", gpu_memory=None, cache_experts=args.cache_experts,
                               predictor=predicting, execute=ExecuteMode.EXACT, fetch_threshold=None,
                               link_gbps=None)
    opened = open_model(None, cfg)
    engine = opened.engine
    spent = {"prefill": [0, 0], "decode": [0, 0]}  # kind -> [forwards, tokens]
    forward = engine.forward

    def counted(ids, kind, *a, **k):
        spent[kind][0] += 1
        spent[kind][1] += len(ids)
        return forward(ids, kind, *a, **k)

    engine.forward = counted
    tasks = [load_task(s.name, s.path) for s in resolve_tasks(args.tasks, None)]
    walls = {False: [], True: []}
    records = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                for item_major in ((False, True) if r % 2 == 0 else (True, False)):
                    for s in spent.values():
                        s[:] = [0, 0]
                    out = Path(tmp) / f"r{r}-{'item' if item_major else 'arm'}"
                    ecfg = EvalConfig(out_dir=out, limit=Limits(args.limit), max_gen_toks=args.max_gen_toks,
                                      item_major=item_major)
                    t0 = time.perf_counter()
                    got = evaluate(opened, cfg, tasks, arms, ecfg)
                    wall = time.perf_counter() - t0
                    walls[item_major].append(wall)
                    records[item_major] = got
                    name = "item-major" if item_major else "arm by arm"
                    p, d = spent["prefill"], spent["decode"]
                    print(f"round {r} {name:10s} {wall:7.1f} s | prefill {p[0]} x {p[1] / max(p[0], 1):.0f} tok "
                          f"| decode {d[0]} steps", flush=True)
                    for a in arms:
                        per = got[a.name].tasks
                        cells = " ".join(f"{t}={per[t]['seconds'] / max(len(per[t]['items']), 1):.2f}"
                                         for t in per)
                        print(f"    {a.name:28s} s/item {cells}", flush=True)
    finally:
        opened.close()
    diff = 0.0
    for a in arms:
        if residency_matters(a, cfg.on_miss):
            continue
        for t, per in records[False][a.name].tasks.items():
            for doc, want in per["items"].items():
                have = records[True][a.name].tasks[t]["items"][doc]
                if "logprobs" in want:
                    diff = max(diff, max(abs(x - y) for x, y in zip(want["logprobs"], have["logprobs"])))
    ratio = statistics.median(walls[True]) / statistics.median(walls[False])
    print(f"item-major / arm by arm: {ratio:.3f} (medians {statistics.median(walls[True]):.1f} / "
          f"{statistics.median(walls[False]):.1f} s); largest logprob difference (exact, speculative) {diff:.2e}")
    print(json.dumps({"arms": args.arms, "tasks": args.tasks, "limit": args.limit, "walls_arm_by_arm": walls[False],
                      "walls_item_major": walls[True], "ratio": ratio, "max_logprob_diff": diff}))


if __name__ == "__main__":
    main()
