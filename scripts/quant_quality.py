"""Perplexity and expert bytes of int8/int4 experts against float32; the last stdout line is one JSON object.

    python scripts/quant_quality.py [MODEL] [--specs int8:64,int4:32,int4:64,int4:128] [--windows 8]

MODEL defaults to the embedded default model. Loads it with plain transformers (float32), measures
held-out perplexity as the default-model gates do (moespec.default_model.gates: 8 windows of 512
tokens = 4096 tokens), then for each bits:group_size replaces every expert weight by its quantised
and dequantised value (fake_quantize_experts_: what moespec's `exact` mode computes with int8/int4
experts, by the exactness tests) and measures again. Reports ppl / float32 ppl and the packed
expert bytes / float32 expert bytes (QuantLayout row, stored = moved). Exit code 1 when the issue's
bounds fail for int8:64 or int4:64 (int8 within 0.5 %, <= 0.27x; int4 within 5 %, <= 0.15x).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="model folder (default: the embedded model)")
    parser.add_argument("--specs", default="int8:64,int4:32,int4:64,int4:128", help="bits:group_size list")
    parser.add_argument("--windows", type=int, default=8, help="held-out windows of 512 tokens")
    args = parser.parse_args()

    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moespec.data import heldout_text
    from moespec.default_model.recipe import WINDOW_TOKENS
    from moespec.default_model.gates import eval_windows, perplexity
    from moespec.models import adapter_for
    from moespec.models.quant_layout import QuantLayout, fake_quantize_experts_

    console = Console(stderr=True)
    if args.model is None:
        from moespec.default_model import ensure_default_model

        folder = ensure_default_model(console)
    else:
        from pathlib import Path

        folder = Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    adapter = adapter_for(model.config)
    h, i = int(model.config.hidden_size), adapter.expert_intermediate()
    windows = eval_windows(tokenizer, heldout_text(), args.windows, WINDOW_TOKENS)
    original = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))
                and p.dim() == 3}
    t0 = time.perf_counter()
    base = perplexity(model, windows)
    console.print(f"float32: ppl {base:.4f} ({time.perf_counter() - t0:.0f} s)")
    f32_bytes = 3 * h * i * 4
    rows = []
    for item in args.specs.split(","):
        kind, group = item.split(":")
        layout = QuantLayout(hidden=h, intermediate=i, bits=int(kind.removeprefix("int")), group_size=int(group))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, w in original.items():
                params[n].copy_(w)
        fake_quantize_experts_(model, layout)
        ppl = perplexity(model, windows)
        row = {"expert_dtype": kind, "group_size": int(group), "ppl": ppl, "ppl_ratio": ppl / base,
               "expert_bytes": layout.numel, "bytes_ratio": layout.numel / f32_bytes}
        rows.append(row)
        console.print(f"{kind} g{group}: ppl {ppl:.4f} = {ppl / base:.4f}x float32; "
                      f"{layout.numel} B/expert = {layout.numel / f32_bytes:.4f}x")
    ok = all((r["ppl_ratio"] <= 1.005 and r["bytes_ratio"] <= 0.27) if r["expert_dtype"] == "int8" else
             (r["ppl_ratio"] <= 1.05 and r["bytes_ratio"] <= 0.15)
             for r in rows if r["group_size"] == 64)
    print(json.dumps({"model": str(folder), "eval_tokens": windows.numel(), "float32_ppl": base,
                      "float32_expert_bytes": f32_bytes, "results": rows, "pass": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
