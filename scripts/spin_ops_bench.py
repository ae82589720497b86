"""Bound dense products of the default model's shapes through the spin pool, arms interleaved.

    python scripts/spin_ops_bench.py FMT ROUNDS GAP_US      (FMT f32 or int8)

Weights of the default model's dense shapes (q/k/v fused 960x576, o 576x576, shared gate/up
2048x576, down 576x1024, 30 layers, lm_head 49152x576: ~500 MB, so every product reads cold, as in
decode) on 2 MB pages where big; the caller busy-waits GAP_US between products (the Python of a
decode step). Arms, the order rotating each round: serial (no pool), ahead (a 1-worker pool that
only reads ahead), split (splits, no read-ahead), split+ahead. Prints the median us per call per
product kind and the median total per arm (gaps left out).
"""
import statistics
import sys
import time

import torch

from moespec.kernels import spin
from moespec.runtime.dense import stored_weight, on_huge_pages
from moespec.runtime.host import hugepages

fmt = sys.argv[1]; rounds = int(sys.argv[2]); gap = float(sys.argv[3]) * 1e-6
torch.manual_seed(0)
H, L = 576, 30
shapes = [("qkv", 960, H), ("o", H, H), ("gate_up", 2048, H), ("down", H, 1024)]
def make(r, c):
    w = torch.randn(r, c) * 0.02
    if fmt == "int8":
        return on_huge_pages(stored_weight(w, "int8"))
    return hugepages.copy(w) if r * c * 4 >= hugepages.MIN_BYTES else w.clone()
seq = [(n, spin.BoundWeight(make(r, c)), c) for _ in range(L) for n, r, c in shapes]
seq.append(("lm_head", spin.BoundWeight(make(49152, H)), H))
xs = {c: torch.randn(1, c) for c in (H, 1024)}
pool = spin.SpinPool(1)
arms = {"serial": None, "ahead": (1 << 40, True), "split": (0, False), "split+ahead": (0, True)}
names = [s[0] for s in shapes] + ["lm_head"]
times = {(n, a): [] for n in names for a in arms}
tot = {a: [] for a in arms}
def busy(t):
    end = time.perf_counter() + t
    while time.perf_counter() < end: pass
for r in range(rounds):
    order = list(arms)[r % 4:] + list(arms)[:r % 4]
    for arm in order:
        cfg = arms[arm]
        p = None
        if cfg is not None:
            p = pool; pool.set_split_min_bytes(cfg[0]); pool.read_ahead = cfg[1]
        t_all = time.perf_counter()
        for name, b, c in seq:
            busy(gap)
            t0 = time.perf_counter()
            b.linear(xs[c], p)
            times[(name, arm)].append(time.perf_counter() - t0)
        tot[arm].append(time.perf_counter() - t_all - gap * len(seq))
for n in names:
    s = statistics.median(times[(n, "serial")]) * 1e6
    cells = "  ".join(f"{a} {statistics.median(times[(n, a)]) * 1e6:8.1f}" for a in arms)
    print(f"{fmt} gap {gap * 1e6:.0f} {n:8s} {cells}")
print(f"{fmt} gap {gap*1e6:.0f} all(ms) " + "  ".join(f"{a} {statistics.median(tot[a]) * 1e3:7.2f}" for a in arms))
pool.close()
