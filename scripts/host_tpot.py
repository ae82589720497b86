"""Decode TPOT of low-bit experts against float32 with misses computed on the host, paired step by step.

    python scripts/host_tpot.py [MODEL] [--rounds 3] [--gen 32] [--arms host8:auto,host8:int4,all:auto,all:int4]

An arm is ``CACHE:EXPERT_DTYPE``: CACHE ``hostN`` = ``--cache-experts N --on-miss host`` (every miss
computed by the host pool from its store row; ``hostNxT``: with ``--host-threads T``), ``all`` =
every expert resident (the CPU slots, no misses); EXPERT_DTYPE as ``--expert-dtype`` (auto = the
checkpoint's float32 on the default model; ``zero``: float32 rows whose experts return zeros, the
TPOT of everything but the routed experts' compute, so ``X/all:auto`` can go no lower than
``all:zero/all:auto`` by faster expert kernels alone). A third field ``:wait`` (``host8:int4:wait``):
the decode thread only waits for the host pool's results instead of running the queued units itself.
Every arm is loaded once in this one process (CPU, --predictor none, LRU, torch on one thread, the
host pool on its default threads, --execute exact); each decode step runs once on each arm, the
order rotating every step, so a burst of load on a shared machine hits all arms alike. Each round
reports every arm's mean decode TPOT and the ratios of the pairs named by --pairs (A/B, same
CACHE); the summary gives min / median / max of each ratio over rounds. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quant_tpot import _round  # noqa: E402  (scripts/ is sys.path[0]: the same interleaved round)


def _load(model: str, arm: str, host_threads: int | None):
    from moespec.config import CachePolicy, OnMiss, Predictor, RuntimeConfig
    from moespec.runtime.engine import Engine
    from moespec.runtime.load import load_offloaded

    cache, expert_dtype, *mode = arm.split(":")
    zero = expert_dtype == "zero"
    expert_dtype = "auto" if zero else expert_dtype
    host = cache.startswith("host")
    slots, _, threads = cache[4:].partition("x")
    host_threads = int(threads) if threads else host_threads
    cfg = RuntimeConfig(cache_experts=int(slots) if host else None, predictor=Predictor.NONE, device="cpu",
                        expert_dtype=expert_dtype, cache_policy=CachePolicy.LRU,
                        on_miss=OnMiss.HOST if host else OnMiss.FETCH, host_threads=host_threads)
    om = load_offloaded(model, cfg)
    if zero:  # the same runtime, routed experts computed as zeros (a subclass: the layout is frozen)
        import dataclasses

        import torch

        layout = om.store.layout
        kind = type("ZeroExperts", (type(layout),), {"forward": lambda self, x, row, act: torch.zeros_like(x)})
        om.store.layout = kind(**{f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)})
    if mode == ["wait"]:  # the decode thread only waits for the host pool (it runs no queued unit)
        om.planner.pool.caller_helps = False
    return Engine(om, reuse_kv=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--arms", default="host8:auto,host8:int4,all:auto,all:int4")
    parser.add_argument("--pairs", default="host8:int4/host8:auto,all:int4/all:auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--host-threads", type=int, default=None)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    if args.model is None:
        from moespec.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    arms = args.arms.split(",")
    engines = {a: _load(args.model, a, args.host_threads) for a in arms}
    om = next(iter(engines.values())).om
    vocab = int(om.config.get_text_config().vocab_size)
    ids = torch.randint(0, vocab, (args.prompt_len + args.gen,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt, decode = ids[: args.prompt_len], ids[args.prompt_len :]
    _round(engines, prompt[:8], decode[:3])  # warm-up, untimed
    pairs = [p.split("/") for p in args.pairs.split(",") if p]
    rounds = []
    for k in range(args.rounds):
        t = _round(engines, prompt, decode)
        ratios = {f"{a}/{b}": t[a] / t[b] for a, b in pairs}
        rounds.append({"round": k, "tpot_ms": t, "ratios": ratios})
        print(f"round {k}: " + ", ".join(f"{a} {v:.1f} ms" for a, v in t.items()) + "; "
              + ", ".join(f"{p} {r:.3f}" for p, r in ratios.items()), file=sys.stderr)
    threads = {a: (e.om.planner.pool.threads if e.om.planner is not None else 0) for a, e in engines.items()}
    for eng in engines.values():
        eng.om.close()
    summary = {p: {"min": min(v), "median": statistics.median(v), "max": max(v)}
               for p, v in ((p, [r["ratios"][p] for r in rounds]) for p in rounds[0]["ratios"])}
    tpot = {a: statistics.median(r["tpot_ms"][a] for r in rounds) for a in arms}
    print(json.dumps({"model": args.model, "arms": arms, "prompt_len": args.prompt_len, "gen": args.gen,
                      "torch_threads": 1, "host_threads": threads, "cpus": os.cpu_count(),
                      "load_avg": os.getloadavg(), "torch": torch.__version__, "rounds": rounds,
                      "median_tpot_ms": tpot, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
