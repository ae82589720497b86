"""Where a decode token's time goes: the dense path's native products against the rest, per arm.

    python scripts/dense_share.py [--arms auto:auto,int4:int8] [--steps 24]

An arm is ``EXPERT_DTYPE:DENSE_DTYPE`` (as ``--expert-dtype`` / ``--dense-dtype``); every expert
resident, CPU, one thread, --predictor none, compile off. Each bound dense product (kernels/spin.py
BoundWeight.linear: q/k/v, o, the shared expert, lm_head) is timed around its call; the arms'
decode steps alternate. Prints per arm the median token time, the products' ms per token (lm_head
apart) and their GB/s; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="auto:auto,int4:int8")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    import torch

    from moespec.config import Predictor, RuntimeConfig
    from moespec.default_model import ensure_default_model
    from moespec.kernels import spin
    from moespec.runtime.engine import Engine
    from moespec.runtime.load import load_offloaded

    torch.set_num_threads(1)
    acc = {"ms": 0.0, "head_ms": 0.0, "bytes": 0, "head_bytes": 0}
    plain = spin.BoundWeight.linear
    vocab = {"rows": -1}  # lm_head's rows, set once a model is loaded

    def timed(self, x, pool=None):
        t0 = time.perf_counter()
        y = plain(self, x, pool)
        dt = (time.perf_counter() - t0) * 1e3
        w = self.weight
        nbytes = (w.codes.numel() + 3 * w.scales.numel()) if hasattr(w, "codes") else w.numel() * w.element_size()
        head = self.rows == vocab["rows"]
        acc["head_ms" if head else "ms"] += dt
        acc["head_bytes" if head else "bytes"] += nbytes
        return y

    spin.BoundWeight.linear = timed
    arms = args.arms.split(",")
    engines = {}
    for a in arms:
        e, d = a.split(":")
        cfg = RuntimeConfig(device="cpu", predictor=Predictor.NONE, expert_dtype=e, dense_dtype=d, compile="off")
        engines[a] = Engine(load_offloaded(str(ensure_default_model()), cfg))
        vocab["rows"] = int(engines[a].om.config.get_text_config().vocab_size)
    prompt = list(range(100, 132))
    res = {a: {"step": [], "ms": [], "head_ms": [], "bytes": 0, "head_bytes": 0} for a in arms}
    for a in arms:
        engines[a].forward(prompt, "prefill")
    for i in range(args.steps + 4):
        for a in arms[i % len(arms):] + arms[: i % len(arms)]:
            for k in acc:
                acc[k] = 0
            t0 = time.perf_counter()
            engines[a].forward([200 + i], "decode")
            if i >= 4:  # warm-up steps untimed
                r = res[a]
                r["step"].append((time.perf_counter() - t0) * 1e3)
                r["ms"].append(acc["ms"])
                r["head_ms"].append(acc["head_ms"])
                r["bytes"], r["head_bytes"] = acc["bytes"], acc["head_bytes"]
    out = {}
    for a, r in res.items():
        step, ms, head = (statistics.median(r[k]) for k in ("step", "ms", "head_ms"))
        out[a] = {"step_ms": step, "dense_ms": ms, "head_ms": head, "dense_mb": r["bytes"] / 1e6,
                  "head_mb": r["head_bytes"] / 1e6, "dense_gbps": r["bytes"] / ms / 1e6 if ms else 0,
                  "head_gbps": r["head_bytes"] / head / 1e6 if head else 0}
        o = out[a]
        print(f"{a:>10}: step {step:6.2f} ms; dense products {ms:5.2f} ms ({o['dense_mb']:.0f} MB, "
              f"{o['dense_gbps']:.1f} GB/s), lm_head {head:5.2f} ms ({o['head_mb']:.0f} MB, "
              f"{o['head_gbps']:.1f} GB/s), "
              f"rest {step - ms - head:5.2f} ms", file=sys.stderr)
    for eng in engines.values():
        eng.om.close()
    print(json.dumps({"arms": arms, "steps": args.steps, "rows": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
