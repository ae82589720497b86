"""Export a transformers MoE model folder to GGUF as llama.cpp's converter would (moespec.gguf.export).

    python scripts/export_gguf.py ~/.cache/moespec/models/smollm2-135m-moe-e16k4 /tmp/smollm2-moe-Q8_0.gguf
    moespec chat /tmp/smollm2-moe-Q8_0.gguf --prompt "What is the capital of France?"

The round trip of the embedded default model: experts Q8_0 where their rows are whole Q8_0 blocks
(gate/up: 576 columns) and F16 where they are not (down: 80 columns), as llama-quantize falls back;
dense 2-D tensors Q8_0 (--dense), norms F32. Prints the file's size and the tensor types; the
last line is JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path, help="a transformers MoE model folder")
    ap.add_argument("out", type=Path, help="the .gguf to write")
    ap.add_argument("--experts", default="Q8_0", help="GGUF type of the expert tensors")
    ap.add_argument("--dense", default="Q8_0", help="GGUF type of the other 2-D tensors")
    ap.add_argument("--fallback", default="F16", help="for rows that are not whole blocks of the type")
    ap.add_argument("--pre", default="smollm", help="tokenizer.ggml.pre (the default model's source GGUF says smollm)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moespec.gguf.export import ExportTypes, export_gguf
    from moespec.gguf.files import GgufFiles
    from moespec.gguf.reader import GgufCheckpoint

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    types = ExportTypes(experts=args.experts, dense=args.dense, fallback=args.fallback)
    export_gguf(model, args.out, types, tokenizer, name=args.model.name, pre=args.pre)
    ck = GgufCheckpoint.open(GgufFiles((args.out,)))
    kinds = collections.Counter()
    for info in ck.tensors.values():
        from moespec.gguf.dequant import type_name

        kind = "experts " + info.name.split(".")[2] if "_exps" in info.name else "dense"
        kinds[f"{kind}: {type_name(info.ggml_type)}"] += 1
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1e6:.1f} MB, {len(ck.tensors)} tensors, arch {ck.arch})")
    for k, n in sorted(kinds.items()):
        print(f"  {k} x{n}")
    print(json.dumps({"path": str(args.out), "bytes": size, "types": dict(kinds)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
