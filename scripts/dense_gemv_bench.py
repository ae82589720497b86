"""Cold-weight matrix-vector products at t = 1, one thread: F.linear against the native GEMV.

    python scripts/dense_gemv_bench.py [--mb 300]

For each shape (the default model's dense shapes, and a tiny one), enough weights to fill ``--mb``
MB are cycled through, so every product reads its weight from memory, not from a cache. Prints
microseconds per product and the GB/s read (best of 3 passes); the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

SHAPES = [(64, 64), (192, 576), (576, 576), (1024, 576), (576, 1024), (8192, 576)]


def _pass_us(fn, ws, x) -> float:
    best = float("inf")
    for w in ws:  # one untimed pass: first touch
        fn(x, w)
    for _ in range(3):
        t0 = time.perf_counter()
        for w in ws:
            fn(x, w)
        best = min(best, (time.perf_counter() - t0) / len(ws))
    return best * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=300)
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    from moespec.kernels.linear import linear

    torch.set_num_threads(1)
    rows = []
    for r, c in SHAPES:
        ws = [torch.randn(r, c) for _ in range(max(4, int(args.mb * 1e6 // (r * c * 4))))]
        x = torch.randn(1, c)
        ref, nat = _pass_us(F.linear, ws, x), _pass_us(linear, ws, x)
        mb = r * c * 4 / 1e6
        rows.append({"shape": [r, c], "f_linear_us": ref, "native_us": nat, "f_linear_gbps": mb / ref * 1e3,
                     "native_gbps": mb / nat * 1e3})
        print(f"{r}x{c}: F.linear {ref:8.1f} us ({mb / ref * 1e3:4.1f} GB/s), native {nat:8.1f} us "
              f"({mb / nat * 1e3:4.1f} GB/s)", file=sys.stderr)
    print(json.dumps({"rows": rows, "torch": torch.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
