"""Prediction's host cost with every expert resident (issue 29): `--predictor router` / `none` TPOT.

On the tiny-dimension 48-layer, 128-expert top-8 Qwen3-MoE of ../shared/measure/overhead.py (built
there, in /tmp/moespec-overhead-q48; compute ~0, so TPOT is the host's cost per layer). Both arms
are loaded once in this one process (CPU, all experts resident, LRU, torch on one thread); each
decode step runs once on each arm, the order alternating every step, so a burst of load on a shared
machine hits both alike. Prints one JSON line per round (median step ms of each arm; router / none
of the mean wall and thread-CPU ms per step) and, last, the median of each ratio over rounds. The
prediction gate (runtime/layer/gate.py) decides after 4 predicted visits, so round 0 holds its
open phase and later rounds its steady state (a closed layer probes once in 64 visits).

    PYTHONPATH=$PWD python scripts/gate_overhead.py [ROUNDS=5] [TOKENS=64]
"""

import json
import statistics
import sys
import time

import torch

from moespec.config import CachePolicy, Predictor, RuntimeConfig
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded

MODEL = "/tmp/moespec-overhead-q48"


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    gen = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    torch.set_num_threads(1)
    eng = {}
    for name, pred in (("none", Predictor.NONE), ("router", Predictor.ROUTER)):
        om = load_offloaded(MODEL, RuntimeConfig(device="cpu", predictor=pred, cache_policy=CachePolicy.LRU))
        eng[name] = Engine(om, reuse_kv=False)
    prompt = list(range(3, 35))
    decode = [(7 * i) % 90 + 3 for i in range(gen)]  # ids inside the model's 100-token vocabulary
    out = []
    with torch.inference_mode():
        for r in range(rounds):
            wall = {n: [] for n in eng}
            cpu = {n: [] for n in eng}
            for e in eng.values():
                e.reset()
                e.forward(prompt, "prefill")
            names = list(eng)
            for i, tok in enumerate(decode):
                for n in names[i % 2:] + names[: i % 2]:
                    t0, c0 = time.perf_counter(), time.thread_time()
                    eng[n].forward([tok], "decode")
                    wall[n].append((time.perf_counter() - t0) * 1e3)
                    cpu[n].append((time.thread_time() - c0) * 1e3)
            row = {"round": r, **{f"{n}_ms": statistics.median(wall[n]) for n in eng},
                   "wall_ratio_mean": statistics.fmean(wall["router"]) / statistics.fmean(wall["none"]),
                   "cpu_ratio_mean": statistics.fmean(cpu["router"]) / statistics.fmean(cpu["none"])}
            print(json.dumps(row), flush=True)
            out.append(row)
    print(json.dumps({"median_wall_ratio_mean": statistics.median(r["wall_ratio_mean"] for r in out),
                      "median_cpu_ratio_mean": statistics.median(r["cpu_ratio_mean"] for r in out)}))


if __name__ == "__main__":
    main()
