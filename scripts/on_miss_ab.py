"""Token-interleaved A/B of `--on-miss` arms on one machine load (CPU, emulated link).

`moespec profile` runs each arm for a whole prompt + N tokens before the next arm; on a shared,
busy machine the load changes between those runs by more than the differences measured here. This
script loads one OffloadedModel per arm (same checkpoint; only predictor and on-miss differ), each
with its own Engine, KV cache, expert cache and link, prefills the same prompt in every arm, then
decodes step by step in rotation (arm order rotates every step), so each arm's step i runs within
a second of the others'. Exact mode: every arm decodes the same greedy tokens (checked). Reports
per arm the median step ms and the median over steps of the ratio to the first arm and to the
better of the ``--best`` arms (the one with the lower median); the last stdout line is one JSON
object (with every step's ms).

An arm is PREDICTOR+ON_MISS, optionally @GBPS for its own link (``none+fetch@1000``: a link too fast
to matter). ``--copy-share`` adds two arms, on-demand fetch at ``--link-gbps`` and unthrottled, and
reports the share of the fetch TPOT that is copies, 1 - unthrottled / fetch (median over steps of
the per-step ratio): the "copies are ~75 % of on-demand TPOT" of issue 17, stated in the same run.

  PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/on_miss_ab.py --link-gbps 0.9 \\
      --arms none+fetch,none+host,none+auto --best none+fetch,none+host --steps 60 --copy-share
  PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/on_miss_ab.py --link-gbps 0.25 \\
      --arms none+auto,router+auto --steps 60
"""
import argparse
import json
import statistics
import time

import torch

from moespec.config import OnMiss, Predictor, RuntimeConfig
from moespec.default_model.build import default_model_dir
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded

ap = argparse.ArgumentParser()
ap.add_argument("--link-gbps", type=float, required=True)
ap.add_argument("--arms", default="none+fetch,none+host,none+auto")
ap.add_argument("--best", default="", help="arms whose better (lower median) is the reference")
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--prompt-len", type=int, default=64)
ap.add_argument("--cache-experts", type=int, default=8)
ap.add_argument("--warmup", type=int, default=3)
ap.add_argument("--copy-share", action="store_true",
                help="add none+fetch and an unthrottled none+fetch@1000 arm; report the copy share of fetch TPOT")
args = ap.parse_args()
torch.set_num_threads(1)

UNTHROTTLED = "none+fetch@1000"
arms = [a.strip() for a in args.arms.split(",")]
if args.copy_share:
    arms += [a for a in ("none+fetch", UNTHROTTLED) if a not in arms]
models, engines = {}, {}
for arm in arms:
    spec, _, gbps = arm.partition("@")
    pred, _, where = spec.partition("+")
    cfg = RuntimeConfig(cache_experts=args.cache_experts, link_gbps=float(gbps) if gbps else args.link_gbps,
                        predictor=Predictor(pred), on_miss=OnMiss(where or "fetch"))
    models[arm] = load_offloaded(default_model_dir(), cfg)
    engines[arm] = Engine(models[arm])
prompt = [int(t) for t in torch.randint(100, 20000, (args.prompt_len,), generator=torch.Generator().manual_seed(0))]
last = {arm: engines[arm].forward(prompt, "prefill") for arm in arms}
ms = {arm: [] for arm in arms}
for step in range(args.warmup + args.steps):
    toks = {arm: int(torch.argmax(last[arm])) for arm in arms}
    assert len(set(toks.values())) == 1, f"arms diverged at step {step}: {toks}"
    order = arms[step % len(arms):] + arms[: step % len(arms)]
    for arm in order:
        t0 = time.perf_counter()
        last[arm] = engines[arm].forward([toks[arm]], "decode")
        if step >= args.warmup:
            ms[arm].append((time.perf_counter() - t0) * 1e3)
for om in models.values():
    om.close()
ref = arms[0]
best = [a.strip() for a in args.best.split(",") if a.strip()]
out = {"link_gbps": args.link_gbps, "steps": args.steps, "median_ms": {}, "ratio_to_first": {}, "ratio_to_best": {}}
for arm in arms:
    out["median_ms"][arm] = statistics.median(ms[arm])
    out["ratio_to_first"][arm] = statistics.median(b / a for a, b in zip(ms[ref], ms[arm]))
if best:
    # The better fixed choice: the --best arm with the lower median; each arm's steps are divided by its
    # step in the same rotation (a per-step minimum of two noisy arms would be biased low).
    winner = min(best, key=lambda b: statistics.median(ms[b]))
    out["best"] = winner
for arm in arms:
    if best:
        out["ratio_to_best"][arm] = statistics.median(x / ms[winner][i] for i, x in enumerate(ms[arm]))
    print(f"{arm:16s} median {out['median_ms'][arm]:8.1f} ms  x{ref} {out['ratio_to_first'][arm]:.3f}"
          + (f"  x {winner} {out['ratio_to_best'][arm]:.3f}" if best else ""))
if args.copy_share:
    out["copy_share"] = 1 - statistics.median(u / f for u, f in zip(ms[UNTHROTTLED], ms["none+fetch"]))
    print(f"copy share of none+fetch at {args.link_gbps} GB/s: {out['copy_share']:.1%}"
          f" (1 - {UNTHROTTLED} / none+fetch, median of step ratios)")
out["step_ms"] = ms
print(json.dumps(out))
