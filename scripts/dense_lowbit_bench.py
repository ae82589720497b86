"""Cold-weight one-token products of the dense path's bound weights, two kernel libraries A/B.

    python scripts/dense_lowbit_bench.py [--old DIR] [--new DIR] [--formats q8,bf16,f32]
        [--shapes 49152x576,960x576,4096x576:1] [--pairs 8] [--mb 240] [--count N]
        [--old-flags "-DX=1"] [--new-flags ...] [--old-isa avx2|avx512] [--new-isa ...]

Each of ``--old`` and ``--new`` is a csrc folder (default: main's and this tree's
moespec/kernels/csrc); each is compiled here with moespec's flags into a temporary library and both
are loaded into this process. For every (format, shape), enough weights to fill ``--mb`` MB lie on
2 MB pages (as the dense path binds them; ``RxC:N`` takes N weights instead, 1 for a cache-resident
one); a pass computes one product per weight (so each reads
its weight from memory, not from a cache) through ``spin_bind`` / ``spin_linear`` with no pool, one
thread; old and new passes alternate ``--pairs`` times (the order flipping every pair), so a burst
of load hits both. Prints microseconds per product, GB/s of weight bytes read (codes + scales +
zeros) and new / old per pair, and the largest difference of the two libraries' outputs; the last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = "49152x576,960x576,576x576,1536x576,576x768"


def _compile(src: Path, out: Path, flags: list[str], isa: str) -> ctypes.CDLL:
    from moespec.kernels import native

    sources = [str(f) for f in sorted(src.glob("*.c"))]
    subprocess.run(["cc", *native.FLAGS, *flags, "-o", str(out), *sources, "-lm"], check=True, timeout=300)
    lib = ctypes.CDLL(str(out))
    lib.cpu_isa.restype, lib.cpu_isa.argtypes = ctypes.c_int, [ctypes.c_int]
    lib.cpu_isa(0 if isa == "avx2" else 1)
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.spin_bind.restype, lib.spin_bind.argtypes = p, [ctypes.c_int, p, p, p, i, i, i]
    # spin_linear's last two (the read-ahead ranges, since issue 33's thread plan) are NULL here: no pool;
    # a tree from before them takes six and the two extra arguments are ignored (the caller pops them)
    lib.spin_linear.restype, lib.spin_linear.argtypes = ctypes.c_int, [p, p, p, i, p, i, p, p]
    lib.spin_unbind.restype, lib.spin_unbind.argtypes = None, [p]
    return lib


def _weights(fmt: str, r: int, c: int, n: int):
    """n weights [r, c] in ``fmt`` on 2 MB pages: (kind, pointers, keep-alive, bytes each)."""
    import torch

    from moespec.kernels import native
    from moespec.models.quant import QuantSpec, quantize
    from moespec.runtime.host import hugepages

    out = []
    for _ in range(n):
        w = torch.randn(r, c) * 0.05
        if fmt == "q8":
            spec = QuantSpec(8, 64)
            lw = quantize(w, spec).weight(spec, r, c)
            codes = hugepages.copy(lw.codes)
            keep = (codes, lw.scales.contiguous(), lw.zeros.contiguous())
            ptrs = (native.KIND_Q8, codes.data_ptr(), keep[1].data_ptr(), keep[2].data_ptr(), 64)
            nbytes = r * c + 3 * r * -(-c // 64)
        else:
            dt = torch.bfloat16 if fmt == "bf16" else torch.float32
            t = hugepages.copy(w.to(dt))
            keep = (t,)
            ptrs = (native.KIND_BF16 if fmt == "bf16" else native.KIND_F32, t.data_ptr(), None, None, 0)
            nbytes = t.numel() * t.element_size()
        out.append((ptrs, keep, nbytes))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="/work/main/moespec/kernels/csrc")
    parser.add_argument("--new", default=str(ROOT / "moespec/kernels/csrc"))
    for k in ("old", "new"):
        parser.add_argument(f"--{k}-flags", default="", help="extra compiler flags (-DNAME=1 ...)")
        parser.add_argument(f"--{k}-isa", choices=("avx2", "avx512"), default="avx512")
    parser.add_argument("--formats", default="q8")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--mb", type=float, default=240)
    parser.add_argument("--count", type=int, default=0,
                        help="weights per shape (0: enough for --mb); 1 with a small shape: cache-resident")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="dense_lowbit_bench-"))
    libs = {k: _compile(Path(getattr(args, k)), tmp / f"{k}.so", getattr(args, f"{k}_flags").split(),
                        getattr(args, f"{k}_isa")) for k in ("old", "new")}
    rows = []
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            shape, _, count = shape.partition(":")  # RxC:N: N weights of this shape
            r, c = (int(v) for v in shape.split("x"))
            per = r * c * (1 if fmt == "q8" else 2 if fmt == "bf16" else 4)
            ws = _weights(fmt, r, c, int(count or 0) or args.count or max(3, int(args.mb * 1e6 // per)))
            x = torch.randn(1, c)
            bound = {k: [lib.spin_bind(p[0], p[1], p[2], p[3], r, c, p[4]) for p, _, _ in ws]
                     for k, lib in libs.items()}
            ys = {k: torch.empty(1, r) for k in libs}

            def one_pass(k):
                lib, y = libs[k], ys[k]
                t0 = time.perf_counter()
                for b in bound[k]:
                    lib.spin_linear(None, b, x.data_ptr(), 1, y.data_ptr(), r, None, None)
                return (time.perf_counter() - t0) / len(bound[k]) * 1e6

            one_pass("old"), one_pass("new")  # first touch, untimed
            us = {"old": [], "new": []}
            for i in range(args.pairs):
                for k in (("old", "new") if i % 2 == 0 else ("new", "old")):
                    us[k].append(one_pass(k))
            ratio = [n / o for n, o in zip(us["new"], us["old"])]
            nbytes = ws[0][2]
            diff = float((ys["new"] - ys["old"]).abs().max() / ys["old"].abs().max())
            row = {"format": fmt, "shape": [r, c], "old_us": us["old"], "new_us": us["new"],
                   "new_over_old": ratio, "rel_diff": diff,
                   "old_gbps": nbytes / statistics.median(us["old"]) / 1e3,
                   "new_gbps": nbytes / statistics.median(us["new"]) / 1e3}
            rows.append(row)
            print(f"{fmt:>4} {r:>6}x{c:<5} old {statistics.median(us['old']):8.1f} us ({row['old_gbps']:5.1f} GB/s)"
                  f"  new {statistics.median(us['new']):8.1f} us ({row['new_gbps']:5.1f} GB/s)  new/old median "
                  f"{statistics.median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}]  diff {diff:.1e}",
                  file=sys.stderr)
            for k, lib in libs.items():
                for b in bound[k]:
                    lib.spin_unbind(b)
            del ws
    print(json.dumps({"rows": rows, "pairs": args.pairs, "old": args.old, "new": args.new}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
