"""Why moespec has its own CPU kernels: library candidates against them on one expert projection.

    python scripts/cpu_kernel_alternatives.py [--rows 1536] [--cols 2048] [--tokens 1,16] [--inductor]

One Qwen3-30B-A3B gate_up projection ([2I, H] = [1536, 2048]), one thread, warm cache (the same
weight every call: this compares compute, not memory), best of 20 calls, ms per call:
  - F.linear on float32 and bfloat16 weights (MKL / oneDNN as this torch build dispatches them);
  - PyTorch's packed CPU ops: ``_weight_int4pack_mm_for_cpu`` (groups of 64 along K, bf16 and float32
    activations) and ``_weight_int8pack_mm`` (per-channel scales); torchao's CPU layouts call these;
  - ``--inductor``: torch.compile of a dequantise-and-reduce written in torch (int4, float32), with
    its compile time;
  - moespec.kernels.linear: float32, bfloat16, int8, int4 (exact) and w8a8 / w4a8 rows.
Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moespec.kernels import linear as kl  # noqa: E402
from moespec.kernels.lowbit import LowBitWeight, groups_per_row  # noqa: E402


def best_ms(fn, calls: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def lowbit(bits: int, rows: int, cols: int, group: int) -> LowBitWeight:
    n = groups_per_row(cols, group)
    return LowBitWeight(bits, rows, cols, group, torch.randint(0, 256, (rows * cols * bits // 8,), dtype=torch.uint8),
                        (torch.rand(rows * n) * 0.02 + 1e-3).half(), torch.randint(0, 2**bits, (rows * n,), dtype=torch.uint8))


def inductor_int4(rows: int, cols: int, group: int):
    """torch.compile of x @ dequant(W).T written as a reduction (the candidate inductor fuses)."""
    g = cols // group

    def f(x, codes, scales, zeros):  # codes [R, C/2]: low nibbles first half of the row, high second
        lo = (codes & 15).float().view(rows, g // 2, group)
        hi = (codes >> 4).float().view(rows, g // 2, group)
        s, z = scales.float(), zeros.float()
        wl = (lo - z[:, : g // 2, None]) * s[:, : g // 2, None]
        wh = (hi - z[:, g // 2 :, None]) * s[:, g // 2 :, None]
        xl, xh = x[:, : cols // 2].view(-1, 1, g // 2, group), x[:, cols // 2 :].view(-1, 1, g // 2, group)
        return (xl * wl).sum((-1, -2)) + (xh * wh).sum((-1, -2))

    return torch.compile(f, dynamic=False), (torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8),
                                             (torch.rand(rows, g) * 0.01).half(),
                                             torch.randint(0, 16, (rows, g), dtype=torch.uint8))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1536)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--inductor", action="store_true", help="also torch.compile a dequantise-and-reduce (~1 min)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    r, c, g = args.rows, args.cols, args.group
    wf = torch.randn(r, c) * 0.02
    wb = wf.bfloat16()
    w4i = torch.randint(0, 16, (r, c), dtype=torch.int32)
    w4p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w4i, 1)
    sz_bf16, sz_f32 = torch.randn(c // g, r, 2, dtype=torch.bfloat16), torch.randn(c // g, r, 2)
    w8 = torch.randint(-128, 127, (r, c), dtype=torch.int8)
    s8_bf16, s8_f32 = torch.ones(r, dtype=torch.bfloat16), torch.ones(r)
    q8, q4 = lowbit(8, r, c, g), lowbit(4, r, c, g)
    compiled = compile_s = None
    if args.inductor:
        fn, tensors = inductor_int4(r, c, g)
        t0 = time.perf_counter()
        fn(torch.randn(1, c), *tensors)
        compiled, compile_s = (lambda x, f=fn: f(x, *tensors)), time.perf_counter() - t0
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, c)
        xb = x.bfloat16()
        arms = {
            "F.linear float32": lambda: F.linear(x, wf),
            "F.linear bfloat16": lambda: F.linear(xb, wb),
            "torch int4pack, bf16 act": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w4p, g, sz_bf16),
            "torch int4pack, f32 act": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w4p, g, sz_f32),
            "torch int8pack, bf16 act": lambda: torch.ops.aten._weight_int8pack_mm(xb, w8, s8_bf16),
            "torch int8pack, f32 act": lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8_f32),
            "moespec float32": lambda: kl.linear(x, wf),
            "moespec bfloat16": lambda: kl.linear(xb, wb),
            "moespec int8 (exact)": lambda: kl.linear(x, q8),
            "moespec int4 (exact)": lambda: kl.linear(x, q4),
            "moespec w8a8": lambda: kl.linear(x, q8, True),
            "moespec w4a8": lambda: kl.linear(x, q4, True),
        }
        if compiled is not None:
            arms["inductor int4, f32 act"] = lambda: compiled(x)
        for name, call in arms.items():
            calls = 3 if "f32 act" in name and "torch" in name else 20  # scalar loops: seconds
            ms = best_ms(call, calls)
            rows.append({"arm": name, "tokens": t, "ms": round(ms, 4), "gweights_per_s": round(r * c / ms / 1e6, 2)})
            print(f"t={t:2d}  {name:26s} {ms:9.3f} ms  {r * c / ms / 1e6:6.2f} G weights/s", flush=True)
    print(json.dumps({"rows": r, "cols": c, "group": g, "threads": 1, "torch": torch.__version__,
                      "cpu_capability": torch.backends.cpu.get_cpu_capability(), "inductor_compile_s": compile_s,
                      "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
