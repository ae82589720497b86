"""Peak host memory and start time of loading a config-shaped GGUF, first start and second start.

    python scripts/gguf_load_memory.py [--layers 3 --experts 128 --hidden 2048 --inter 768] [--dtype bfloat16]

Writes (tensor by tensor, random blocks) a Qwen3-30B-A3B-shaped GGUF slice in /tmp: Q4_K_M-like,
Q4_K gate/up experts, Q6_K down in the first and last layer, Q4_K elsewhere; Q4_K embeddings and
attention, Q6_K output and attn_v; the vocabulary size of Qwen3 (151936: the default model's
byte-level BPE tokenizer, its 48900 merges, padded). Then, in fresh processes with one fresh
moespec home, starts twice: resolve MODEL (the first start prepares config, tokenizer and tensor
table), load_offloaded, load the tokenizer. Peak RSS is VmHWM reset before the start (as
scripts/load_memory.py), over the RSS after imports, reported against the loaded size: expert
store + dense part as held (dequantised to --dtype). The file is deleted at the end. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BUDGET = 1.3  # peak RSS / (expert rows + dense part dequantised), issue 30
CHILD = r"""
import sys, json, threading, time
import torch, transformers, accelerate, gguf  # imports are not part of loading
import transformers.models.qwen3_moe.modeling_qwen3_moe
from transformers import AutoTokenizer, TokenizersBackend
from moespec.config import Predictor, RuntimeConfig
from moespec.hub.resolve import resolve_model
from moespec.runtime.load import load_offloaded

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # VmHWM := current RSS
t0 = time.perf_counter()
folder = resolve_model(sys.argv[1])
t1 = time.perf_counter()
om = load_offloaded(folder, RuntimeConfig(dtype=sys.argv[2], cache_experts=16, predictor=Predictor.NONE))
t2 = time.perf_counter()
tok = AutoTokenizer.from_pretrained(folder)
t3 = time.perf_counter()
dense = sum(p.numel() * p.element_size() for p in om.model.parameters() if p.device.type != "meta")
print(json.dumps({"peak_delta": status("VmHWM") - base, "resolve_s": t1 - t0, "load_s": t2 - t1, "tokenizer_s": t3 - t2,
                  "start_s": t3 - t0, "store_bytes": om.store.total_bytes, "dense_bytes": dense,
                  "expert_bytes": om.store.expert_bytes, "vocab": len(tok)}))
om.close()
"""


def write_file(path: Path, layers: int, experts: int, hidden: int, inter: int, vocab: int) -> None:
    """The config-shaped GGUF, written tensor by tensor (never the whole file in memory)."""
    import gguf
    import numpy as np
    from transformers import AutoConfig, AutoTokenizer

    from moespec.gguf.export import random_blocks, write_metadata, write_tokenizer

    config = AutoConfig.for_model("qwen3_moe", hidden_size=hidden, moe_intermediate_size=inter, intermediate_size=6144,
                                  num_hidden_layers=layers, num_experts=experts, num_experts_per_tok=8,
                                  num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=vocab,
                                  max_position_embeddings=40960, tie_word_embeddings=False, norm_topk_prob=True)
    default = Path.home() / ".cache" / "moespec" / "models" / "smollm2-135m-moe-e16k4"
    tokenizer = AutoTokenizer.from_pretrained(default)
    rng = np.random.default_rng(0)
    q, kv = 32 * 128, 4 * 128
    tensors = [("token_embd.weight", "Q4_K", (vocab, hidden)), ("output.weight", "Q6_K", (vocab, hidden)),
               ("output_norm.weight", "F32", (hidden,))]
    for b in range(layers):
        down = "Q6_K" if b in (0, layers - 1) else "Q4_K"
        tensors += [(f"blk.{b}.attn_norm.weight", "F32", (hidden,)), (f"blk.{b}.ffn_norm.weight", "F32", (hidden,)),
                    (f"blk.{b}.attn_q.weight", "Q4_K", (q, hidden)), (f"blk.{b}.attn_k.weight", "Q4_K", (kv, hidden)),
                    (f"blk.{b}.attn_v.weight", "Q6_K", (kv, hidden)), (f"blk.{b}.attn_output.weight", "Q4_K", (hidden, q)),
                    (f"blk.{b}.attn_q_norm.weight", "F32", (128,)), (f"blk.{b}.attn_k_norm.weight", "F32", (128,)),
                    (f"blk.{b}.ffn_gate_inp.weight", "F32", (experts, hidden)),
                    (f"blk.{b}.ffn_gate_exps.weight", "Q4_K", (experts, inter, hidden)),
                    (f"blk.{b}.ffn_up_exps.weight", "Q4_K", (experts, inter, hidden)),
                    (f"blk.{b}.ffn_down_exps.weight", down, (experts, hidden, inter))]
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    write_metadata(w, config, "qwen3moe", "qwen3-30b-a3b-shaped")
    write_tokenizer(w, tokenizer, "default", pad_to=vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)

    def data(name, kind, shape):
        if kind != "F32":
            return random_blocks(kind, shape, rng)
        if "norm" in name:
            return np.ones(shape, dtype=np.float32)
        return rng.normal(0, 0.02, size=shape).astype(np.float32)

    for name, kind, shape in tensors:  # sizes first (the header), then the data one tensor at a time
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        byte_shape = shape if kind == "F32" else (*shape[:-1], shape[-1] // block * size)
        nbytes = int(np.prod(byte_shape)) * (4 if kind == "F32" else 1)
        w.add_tensor_info(name, byte_shape, np.dtype(np.float32 if kind == "F32" else np.uint8), nbytes,
                          raw_dtype=None if kind == "F32" else gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, kind, shape in tensors:  # one tensor in memory at a time (<= 0.2 GB)
        w.write_tensor_data(data(name, kind, shape))
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="moespec-gguf-", dir="/tmp"))
    try:
        path = tmp / "Qwen3-30B-A3B-shaped-Q4_K_M.gguf"
        write_file(path, args.layers, args.experts, args.hidden, args.inter, args.vocab)
        size = path.stat().st_size
        env = {**os.environ, "MOESPEC_HOME": str(tmp / "home")}
        runs = [json.loads(subprocess.run([sys.executable, "-c", CHILD, str(path), args.dtype], env=env, check=True,
                                          capture_output=True, text=True).stdout.strip().splitlines()[-1])
                for _ in range(2)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    loaded = runs[0]["store_bytes"] + runs[0]["dense_bytes"]
    mb = 1e6
    print(f"GGUF {size / mb:.0f} MB; loaded {loaded / mb:.0f} MB = expert rows {runs[0]['store_bytes'] / mb:.0f} MB "
          f"+ dense {runs[0]['dense_bytes'] / mb:.0f} MB ({args.dtype}); {runs[0]['expert_bytes']} B per expert row")
    for name, r in zip(("first start", "second start"), runs):
        r["ratio"] = r["peak_delta"] / loaded
        print(f"{name}: {r['start_s']:.1f} s (resolve {r['resolve_s']:.1f}, load {r['load_s']:.1f}, tokenizer "
              f"{r['tokenizer_s']:.1f}); peak RSS +{r['peak_delta'] / mb:.0f} MB over imports = {r['ratio']:.2f}x loaded")
    speedup = runs[0]["start_s"] / runs[1]["start_s"]
    print(f"second start {speedup:.1f}x faster")
    ok = all(r["ratio"] <= BUDGET for r in runs)
    print(json.dumps({"gguf_bytes": size, "loaded_bytes": loaded, "first": runs[0], "second": runs[1],
                      "speedup": speedup, "budget": BUDGET, "pass": ok, **vars(args)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
