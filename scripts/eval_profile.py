"""Where an eval item's time goes, per arm and task: context prefills, decode steps, the rest.

    python scripts/eval_profile.py --arms exact,speculative:router,guarded:router \\
        --tasks arc_easy,winogrande,gsm8k --limit 4 --cache-experts 120 --max-gen-toks 32

Scores the first --limit items of each task as `moespec eval` does (each item from an empty expert
cache, the scorer each arm uses: moespec/eval/shared_prefix.scorer_for) and times every engine
forward by kind. Prints one line per arm and task: seconds per item, prefills per item (their mean
length in tokens and seconds), decode steps per item (ms per step) and the rest (tokenising,
log-softmax, Python). Quote the figures only from a run under the machine's exclusive CPU lock.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="exact,speculative:router")
    ap.add_argument("--tasks", default="arc_easy,boolq,sciq,winogrande")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--cache-experts", type=int, default=120)
    ap.add_argument("--max-gen-toks", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fetch-threshold", type=float, default=0.2)
    args = ap.parse_args()

    from moespec.chat.open_model import open_model
    from moespec.chat.render import stop_ids
    from moespec.cli.runtime_opts import build_runtime_config
    from moespec.config import ExecuteMode, Predictor
    from moespec.eval.arms import Arm, cold_start, use_arm
    from moespec.eval.data import load_task
    from moespec.eval.run import Limits, limited, score_item
    from moespec.eval.shared_prefix import scorer_for
    from moespec.eval.tasks import resolve_tasks
    from moespec.predict.factory import make_predictor

    torch.set_num_threads(args.threads)
    cfg = build_runtime_config(device="auto", dtype="auto", gpu_memory=None, cache_experts=args.cache_experts,
                               predictor=Predictor.ROUTER, execute=ExecuteMode.EXACT, fetch_threshold=None,
                               link_gbps=None)
    opened = open_model(None, cfg)
    om, engine = opened.engine.om, opened.engine
    spent = {"prefill": [0, 0.0, 0], "decode": [0, 0.0, 0]}  # kind -> [forwards, seconds, tokens]
    forward = engine.forward

    def timed(ids, kind, *a, **k):
        t0 = time.perf_counter()
        out = forward(ids, kind, *a, **k)
        s = spent[kind]
        s[0], s[1], s[2] = s[0] + 1, s[1] + time.perf_counter() - t0, s[2] + len(ids)
        return out

    engine.forward = timed
    stops = stop_ids(opened.path, om.config, opened.tokenizer)
    tasks = [limited(load_task(s.name, s.path), Limits(args.limit)) for s in resolve_tasks(args.tasks, None)]
    made = {}
    try:
        for text in args.arms.split(","):
            mode, _, pred = text.partition(":")
            arm = Arm(ExecuteMode(mode), Predictor(pred or "router"),
                      args.fetch_threshold if mode == "guarded" else None)
            if arm.predictor not in made:
                made[arm.predictor] = make_predictor(arm.predictor, om.adapter, om.layer_refs(),
                                                     dataclasses.replace(cfg, predictor=arm.predictor), opened.path)
            use_arm(om, arm, made[arm.predictor])
            scorer = scorer_for(engine, arm.execute)
            for task in tasks:
                for s in spent.values():
                    s[:] = [0, 0.0, 0]
                t0 = time.perf_counter()
                for item in task.items:
                    cold_start(om)
                    score_item(scorer, opened.tokenizer, item, task, args.max_gen_toks, stops)
                n, total = len(task.items), time.perf_counter() - t0
                p, d = spent["prefill"], spent["decode"]
                print(f"{text:20s} {task.name:10s} {total / n:6.2f} s/item | prefill {p[0] / n:.1f} x "
                      f"{p[2] / max(p[0], 1):.0f} tok {p[1] / n:.2f} s | decode {d[0] / n:.1f} steps "
                      f"{1000 * d[1] / max(d[0], 1):.0f} ms/step {d[1] / n:.2f} s | rest {(total - p[1] - d[1]) / n:.2f} s",
                      flush=True)
    finally:
        opened.close()


if __name__ == "__main__":
    main()
