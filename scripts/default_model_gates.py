"""Measure issue 3's gates on the embedded default model; the last stdout line is one JSON object.

    python scripts/default_model_gates.py [--rebuild] [--windows 8]

Builds the model if needed (--rebuild forces a fresh conversion, which also times it), loads the
built folder with plain transformers (Qwen2MoeForCausalLM: moespec's `exact` mode gives the same
output by contract) and the dense source from the cached GGUF, and measures on held-out text:
dense, routed and random-routing perplexity, routed byte share, E, K, short answers. The
conversion time is the one recorded at build time. Exit code 1 when a gate fails.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild", action="store_true", help="convert again (and time it)")
    parser.add_argument("--windows", type=int, default=8, help="held-out windows of 512 tokens")
    args = parser.parse_args()

    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moespec.data import heldout_text
    from moespec.default_model import ensure_default_model
    from moespec.default_model.build import GATES_FILE, WINDOW_TOKENS
    from moespec.default_model.gates import eval_windows, measure_gates
    from moespec.default_model.source import ensure_gguf

    console = Console(stderr=True)
    folder = ensure_default_model(console, rebuild=args.rebuild)
    recorded = json.loads((folder / GATES_FILE).read_text(encoding="utf-8"))
    gguf = ensure_gguf(console)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    moe = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    dense = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    windows = eval_windows(tokenizer, heldout_text(), args.windows, WINDOW_TOKENS)
    report = measure_gates(dense, moe, tokenizer, windows, recorded["conversion_s"]).to_json()
    for gate, ok in report["checks"].items():
        console.print(f"{'[green]pass[/]' if ok else '[red]FAIL[/]'}  {gate}")
    print(json.dumps({"model": str(folder), **report}))
    return 0 if report["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
