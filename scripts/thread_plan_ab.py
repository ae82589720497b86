"""Decode TPOT at 1 and 2 threads, the thread plan against the serial path, arms interleaved step by step.

    python scripts/thread_plan_ab.py [MODEL] [--arms all:auto:1,all:auto:2,all:auto:2s] [--rounds 3] [--gen 24]

An arm is ``CACHE:EXPERT_DTYPE:THREADS[:VARIANT]``: CACHE ``all`` (every expert resident) or ``hostN``
(``--cache-experts N --on-miss host``, the host pool on its default threads); EXPERT_DTYPE as
``--expert-dtype``, or ``E/D`` for ``--expert-dtype E --dense-dtype D``;
THREADS torch's thread count for the step (``--threads``), with the thread plan
(runtime/threads.py), or ``Ns``: N threads with the plan off (the serial path: torch's N intra-op
threads, as before the plan). VARIANT (``+``-separated) changes the plan for that arm: ``mN`` splits
products from N MiB on (kernels/linear.SPLIT_MIN_BYTES), ``ns`` keeps the shared expert on the
compute thread (ThreadPlan.shared_beside = False), ``ra0`` turns the spin pool's read-ahead off
(ThreadPlan.read_ahead), ``sN`` splits bound products from N KiB on (ThreadPlan.split_min_bytes).
Each (CACHE, EXPERT_DTYPE) pair is loaded once (CPU, --predictor none,
exact); each decode step runs once on each arm, the order rotating every step, so a burst of load
hits every arm alike. Also measured in the same process: memory read GB/s (``torch.sum`` over 256 MiB
float32, best of 7) at 1 and 2 intra-op threads.

Prints per arm the median TPOT over rounds (each round's TPOT: median of its steps), and per
(CACHE, EXPERT_DTYPE) the tok/s ratio of every arm against its 1-thread arm. Last stdout line: one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def read_gbps(threads: int, reps: int = 7) -> float:
    """Memory-read GB/s (10^9 B/s): best of ``reps`` sums over a 256 MiB float32 tensor at ``threads``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = torch.ones(64 * 2**20)
        w.sum()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            w.sum()
            best = min(best, time.perf_counter() - t0)
        return w.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(before)


def _load(model: str, cache: str, expert_dtype: str):
    from moespec.config import CachePolicy, OnMiss, Predictor, RuntimeConfig
    from moespec.runtime.engine import Engine
    from moespec.runtime.load import load_offloaded

    host = cache.startswith("host")
    expert_dtype, _, dense_dtype = expert_dtype.partition("/")
    cfg = RuntimeConfig(cache_experts=int(cache[4:]) if host else None, predictor=Predictor.NONE, device="cpu",
                        expert_dtype=expert_dtype, dense_dtype=dense_dtype or "auto", cache_policy=CachePolicy.LRU,
                        on_miss=OnMiss.HOST if host else OnMiss.FETCH)
    return Engine(load_offloaded(model, cfg))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--arms", default="all:auto:1,all:auto:2,all:auto:2s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen", type=int, default=24)
    args = parser.parse_args()

    import torch

    from moespec.kernels import linear as L
    from moespec.kernels import spin

    torch.set_num_threads(1)
    if args.model is None:
        from moespec.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    arms = args.arms.split(",")
    keys, variants = {}, {}
    for a in arms:
        cache, dtype, threads, *variant = a.split(":")
        keys[a] = (cache, dtype, int(threads.rstrip("s")), not threads.endswith("s"))
        v = variant[0] if variant else ""
        mib = next((int(p[1:]) for p in v.split("+") if p.startswith("m")), None)
        kib = next((int(p[1:]) for p in v.split("+") if p.startswith("s") and p[1:].isdigit()), None)
        variants[a] = (L.SPLIT_MIN_BYTES if mib is None else mib << 20, "ns" not in v.split("+"),
                       "ra0" not in v.split("+"), None if kib is None else kib << 10)
    engines = {}
    for cache, dtype, _, _ in keys.values():
        if (cache, dtype) not in engines:
            engines[(cache, dtype)] = _load(args.model, cache, dtype)
    gbps = {t: read_gbps(t) for t in (1, 2)}
    vocab = int(next(iter(engines.values())).om.config.get_text_config().vocab_size)
    ids = torch.randint(0, vocab, (args.prompt_len + args.gen,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt, decode = ids[: args.prompt_len], ids[args.prompt_len:]

    def one_round(decode_ids):
        for eng in engines.values():
            eng.reset()
            torch.set_num_threads(1)
            eng.forward(prompt, "prefill")
        times = {a: [] for a in arms}
        for i, tok in enumerate(decode_ids):
            for a in arms[i % len(arms):] + arms[: i % len(arms)]:
                cache, dtype, threads, plan = keys[a]
                eng = engines[(cache, dtype)]
                eng.om.threads.enabled = plan
                plan_ = eng.om.threads
                L.SPLIT_MIN_BYTES, plan_.shared_beside, plan_.read_ahead, split = variants[a]
                plan_.split_min_bytes = spin.SPLIT_MIN_BYTES if split is None else split
                torch.set_num_threads(threads)
                eng.truncate(len(prompt) + i)  # arms sharing an engine: the same context each step
                t0 = time.perf_counter()
                eng.forward([tok], "decode")
                times[a].append((time.perf_counter() - t0) * 1e3)
        torch.set_num_threads(1)
        return {a: statistics.median(v) for a, v in times.items()}

    one_round(decode[:4])  # warm-up (first touch, the row workers start), untimed
    rounds = [one_round(decode) for _ in range(args.rounds)]
    tpot = {a: statistics.median(r[a] for r in rounds) for a in arms}
    rows = {}
    for a in arms:
        cache, dtype, threads, plan = keys[a]
        base = next((b for b in arms if keys[b][:2] == (cache, dtype) and keys[b][2] == 1), None)
        ratios = [r[base] / r[a] for r in rounds] if base else []
        rows[a] = {"tpot_ms": round(tpot[a], 3), "tok_s": round(1e3 / tpot[a], 2),
                   "speedup_vs_1_thread": round(statistics.median(ratios), 3) if ratios else None,
                   "speedup_range": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None}
        extra = (f", {rows[a]['speedup_vs_1_thread']:.3f}x 1 thread ({ratios and min(ratios):.3f}-"
                 f"{ratios and max(ratios):.3f})") if ratios else ""
        print(f"{a:>16}: {tpot[a]:7.2f} ms ({1e3 / tpot[a]:5.1f} tok/s){extra}", file=sys.stderr)
    print(f"memory read: {gbps[1]:.1f} GB/s at 1 thread, {gbps[2]:.1f} GB/s at 2", file=sys.stderr)
    for eng in engines.values():
        eng.om.close()
    print(json.dumps({"model": args.model, "arms": arms, "gbps": gbps, "rounds": rounds, "rows": rows,
                      "prompt_len": args.prompt_len, "gen": args.gen, "cpus": os.cpu_count(),
                      "load_avg": os.getloadavg(), "torch": torch.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
