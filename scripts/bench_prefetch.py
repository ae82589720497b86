"""Benchmark: TPOT of on-demand loading (`none`) vs router prefetch (`router`) on one token trace.

A tiny Qwen3-MoE-shaped model (random weights) on CPU; the emulated link is set so that copies
are about 85% of on-demand TPOT (the paper's regime on an RTX A6000). Warm-up untimed, the same
prompt and teacher-forced tokens for both arms, repeats with mean ± std. Last stdout line: JSON.

    python scripts/bench_prefetch.py [--layers 8] [--experts 64] [--top-k 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny import make_checkpoint  # noqa: E402

from moespec.config import Predictor, RuntimeConfig  # noqa: E402
from moespec.runtime.engine import Engine  # noqa: E402
from moespec.runtime.load import load_offloaded  # noqa: E402
from moespec.runtime.stats import StatsRecorder, summarize  # noqa: E402


def run_trace(folder: Path, cfg: RuntimeConfig, prompt: list[int], forced: list[int]):
    """Prefill ``prompt`` then teacher-force ``forced``; returns the Summary of the decode steps."""
    om = load_offloaded(folder, cfg, StatsRecorder())
    om.recorder.synchronize = om.cache.engine.synchronize
    try:
        eng = Engine(om)
        eng.prefill(prompt[:4])  # warm-up (untimed): allocator, kernels, thread start
        eng.reset()
        om.recorder.reset()
        eng.prefill(prompt)
        for tok in forced:
            eng.forward([tok], "decode")
        return summarize(om.recorder.steps), om.store.expert_bytes
    finally:
        om.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--copy-share", type=float, default=0.85)
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core computes, the other runs the copy worker
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_checkpoint(Path(tmp) / "m", "qwen3_moe", hidden=args.hidden, inter=args.inter,
                                 layers=args.layers, experts=args.experts, top_k=args.top_k)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 256, (32,), generator=gen).tolist()
        forced = torch.randint(0, 256, (args.tokens,), generator=gen).tolist()
        slots = 2 * args.top_k
        # 1. compute-only TPOT: every expert resident after a first pass, no link limit.
        full, eb = run_trace(folder, RuntimeConfig(predictor=Predictor.NONE), prompt, forced)
        compute_ms = full.tpot_ms
        bytes_per_token = args.layers * args.top_k * eb
        # 2. link so that copy = share / (1 - share) x compute (copies ~85% of on-demand TPOT).
        copy_ms = compute_ms * args.copy_share / (1 - args.copy_share)
        gbps = bytes_per_token / (copy_ms / 1e3) / 1e9
        arms = {}
        for name in ("none", "router"):
            cfg = RuntimeConfig(cache_experts=slots, predictor=Predictor(name), link_gbps=gbps)
            runs = [run_trace(folder, cfg, prompt, forced)[0] for _ in range(args.repeats)]
            tp = [r.tpot_ms for r in runs]
            arms[name] = {"tpot_ms": statistics.mean(tp), "tpot_std": statistics.pstdev(tp),
                          "recall": runs[-1].recall, "h2d_mb_per_token": runs[-1].h2d_mb_per_token,
                          "stall_ms_per_token": statistics.mean(r.stall_ms_per_token for r in runs)}
            print(f"{name:7s} TPOT {arms[name]['tpot_ms']:.1f} ± {arms[name]['tpot_std']:.1f} ms, "
                  f"recall {arms[name]['recall']}, H2D {arms[name]['h2d_mb_per_token']:.1f} MB/token, "
                  f"stall {arms[name]['stall_ms_per_token']:.1f} ms/token")
    out = {"compute_only_tpot_ms": compute_ms, "link_gbps": gbps, "expert_bytes": eb,
           "zero_cache_bytes_per_token": bytes_per_token, "cache_experts": slots, **args.__dict__,
           "arms": arms, "router_vs_none_tpot_ratio": arms["router"]["tpot_ms"] / arms["none"]["tpot_ms"],
           "torch": torch.__version__}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
