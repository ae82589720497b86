"""Host compute of one Qwen3-30B-A3B-shaped expert from its row: GGUF block rows against float and int4 rows.

    python scripts/gguf_host_speed.py [--tokens 1] [--repeats 20]

One expert (H 2048, I 768) computed on the CPU with one thread from a row in each format: GGUF
Q4_K (gate/up) + Q6_K (down) as Q4_K_M stores it, Q8_0, MXFP4 (as GPT-OSS stores it, with biases),
float32, bfloat16 and moespec's int4-g64; the median of ``--repeats`` timed calls after a warm-up,
and the dequantisation alone for the GGUF rows. Random blocks (every byte pattern is valid).
Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    import numpy as np
    import torch
    import torch.nn.functional as F
    from gguf import GGMLQuantizationType as Q

    from moespec.gguf.export import random_blocks
    from moespec.gguf.layout import GgufGptOssLayout, GgufLayout, GgufPart
    from moespec.models.layout import ExpertLayout

    torch.set_num_threads(1)
    h, i, rng = 2048, 768, np.random.default_rng(0)

    def gguf_row(kinds: dict, gpt: bool = False):
        parts = tuple(GgufPart(n, int(Q[k]), (i, h) if n != "down" else (h, i)) for n, k in kinds.items())
        if gpt:
            parts += tuple(GgufPart(f"{n}_bias", int(Q.F32), (i,) if n != "down" else (h,)) for n in ("gate", "up", "down"))
            layout = GgufGptOssLayout(h, i, parts=parts)
        else:
            layout = GgufLayout(h, i, parts=parts)
        row = torch.zeros(layout.numel, dtype=torch.uint8)
        for p in parts:
            v = layout.disk_view(row, p.name)
            if p.ggml_type == int(Q.F32):
                v.view(torch.float32).normal_(0, 0.02)
            else:
                v.copy_(torch.from_numpy(random_blocks(Q(p.ggml_type).name, p.shape, rng).reshape(-1)))
        return layout, row

    def timed(fn) -> float:
        fn()
        samples = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    x = torch.randn(args.tokens, h)
    out = {}
    rows = {"gguf Q4_K/Q4_K/Q6_K": gguf_row({"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}),
            "gguf Q8_0": gguf_row({"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0"}),
            "gguf MXFP4 (GPT-OSS)": gguf_row({"gate": "MXFP4", "up": "MXFP4", "down": "MXFP4"}, gpt=True)}
    for name, (layout, row) in rows.items():
        out[name] = {"row_bytes": layout.numel, "forward_ms": timed(lambda: layout.forward(x, row, F.silu)),
                     "dequantise_ms": timed(lambda: layout.weights(row, torch.float32))}
    for dtype in (torch.float32, torch.bfloat16):
        layout = ExpertLayout(h, i)
        row = torch.randn(layout.numel).to(dtype) * 0.02
        xd = x.to(dtype)
        out[str(dtype).removeprefix("torch.")] = {"row_bytes": layout.numel * row.element_size(),
                                                  "forward_ms": timed(lambda: layout.forward(xd, row, F.silu))}
    try:
        from moespec.models.quant_layout import QuantLayout

        layout = QuantLayout(h, i, bits=4, group_size=64)
        row = torch.zeros(layout.numel, dtype=torch.uint8)
        convert = layout.converter()
        from moespec.models.base import ExpertKey

        for part, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            for key, t, _ in convert(ExpertKey(0, 0, part), torch.randn(shape) * 0.02, part):
                layout.disk_view(row, key.part).copy_(t)
        out["int4-g64"] = {"row_bytes": layout.numel, "forward_ms": timed(lambda: layout.forward(x, row, F.silu))}
    except ImportError:  # torchao missing: no int4 arm
        pass
    for name, r in out.items():
        extra = f", of which dequantising {r['dequantise_ms']:.2f} ms" if "dequantise_ms" in r else ""
        print(f"{name:<22} {r['row_bytes'] / 1e6:6.2f} MB/row  {r['forward_ms']:7.2f} ms per expert "
              f"({args.tokens} token){extra}")
    print(json.dumps({"tokens": args.tokens, "threads": 1, "hidden": h, "intermediate": i, "results": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
