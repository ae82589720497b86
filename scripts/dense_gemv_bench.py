"""Cold-weight matrix-vector products at t = 1, one thread: the native GEMV against F.linear,
torch.mv and torch.sum (the read speed of a plain stream) on the same weights, on 4 KB and 2 MB pages.

    python scripts/dense_gemv_bench.py [--mb 300] [--pages 4k|2m|both]

For each shape (the default model's dense shapes, and a tiny one), enough weights to fill ``--mb``
MB are cycled through, so every product reads its weight from memory, not from a cache. The weights
of the ``2m`` rows lie on 2 MB pages (runtime/host/hugepages.py, as moespec's bound weights and
expert stores do), those of ``4k`` in torch.empty buffers. Prints microseconds per product and the
GB/s read (best of 3 passes); the last line is one JSON object.
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
    parser.add_argument("--pages", choices=("4k", "2m", "both"), default="both")
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    from moespec.kernels.linear import linear
    from moespec.runtime.host import hugepages

    torch.set_num_threads(1)
    fns = {"native": linear, "f_linear": F.linear, "mv": lambda x, w: torch.mv(w, x[0]),
           "sum": lambda x, w: w.sum()}
    rows = []
    for r, c in SHAPES:
        x = torch.randn(1, c)
        for pages in (["4k", "2m"] if args.pages == "both" else [args.pages]):
            make = (lambda: torch.randn(r, c)) if pages == "4k" else \
                (lambda: hugepages.empty((r, c), torch.float32).normal_())
            ws = [make() for _ in range(max(4, int(args.mb * 1e6 // (r * c * 4))))]
            mb = r * c * 4 / 1e6
            row = {"shape": [r, c], "pages": pages}
            for name, fn in fns.items():
                us = _pass_us(fn, ws, x)
                row[f"{name}_us"], row[f"{name}_gbps"] = us, mb / us * 1e3
            rows.append(row)
            print(f"{r}x{c} {pages}: " + "  ".join(f"{n} {row[f'{n}_us']:7.1f} us {row[f'{n}_gbps']:4.1f} GB/s"
                                                   for n in fns), file=sys.stderr)
            del ws
    print(json.dumps({"rows": rows, "torch": torch.__version__, "huge_pages": hugepages.enabled()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
