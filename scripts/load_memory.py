"""Peak host memory of loading a checkpoint for offloaded inference, as a ratio to its size.

    python scripts/load_memory.py [--hidden 1024 --inter 512 --layers 8 --experts 32]
    python scripts/load_memory.py --hidden 1024 --inter 384 --expert-dtype int4   # Qwen3-30B-A3B-shaped

Builds a random Qwen3-MoE checkpoint (float32) in a temp folder, then in a fresh process loads it
with moespec and reports (peak RSS - RSS after imports) / checkpoint bytes. With --expert-dtype
int8/int4 the experts are quantised while the checkpoint streams in, so the budget is the loaded
size instead: (peak RSS - RSS after imports) / (quantised store + dense part); the load runs twice
with a fresh moespec home, the first start quantising, the second reading the cached store, and
both wall times are reported. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import sys, json, threading, time
import torch, transformers, accelerate, safetensors  # imports are not part of loading
from moespec.config import RuntimeConfig
from moespec.models.quant import _primitives
import transformers.models.qwen3_moe.modeling_qwen3_moe  # transformers' lazy imports (~3 s) neither
from transformers import AutoConfig, AutoModelForCausalLM
from accelerate import init_empty_weights
if sys.argv[2] != "auto":
    _primitives()  # nor torchao's (~1-4 s)
from moespec.runtime.offload import load_offloaded

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

# Anonymous memory is what loading really costs: mmapped safetensors pages are page cache, which
# the kernel drops under pressure. The kernel keeps no anonymous high-water mark, so sample it.
peak = {"anon": 0}
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak["anon"] = max(peak["anon"], status("RssAnon"))
        time.sleep(0.005)
base_anon, base_hwm = status("RssAnon"), status("VmHWM")
t = threading.Thread(target=sample); t.start()
t0 = time.perf_counter()
om = load_offloaded(sys.argv[1], RuntimeConfig(cache_experts=16, expert_dtype=sys.argv[2],
                                               group_size=int(sys.argv[3]) or None))
load_s = time.perf_counter() - t0
stop.set(); t.join()
print(json.dumps({"base_anon": base_anon, "peak_anon": max(peak["anon"], status("RssAnon")),
                  "base_hwm": base_hwm, "peak_hwm": status("VmHWM"), "load_s": load_s,
                  "store_bytes": om.store.total_bytes}))
om.close()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--expert-dtype", default="auto", help="auto, int8 or int4")
    ap.add_argument("--group-size", type=int, default=0, help="int8/int4 group size (0: the default)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_checkpoint(Path(tmp) / "m", "qwen3_moe", hidden=args.hidden, inter=args.inter,
                                 layers=args.layers, experts=args.experts, top_k=4)
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        expert_ckpt = args.layers * args.experts * 3 * args.hidden * args.inter * 4  # float32 on disk
        env = {**os.environ, "MOESPEC_HOME": str(Path(tmp) / "home")}  # no cached store yet
        runs = []
        for _ in range(2 if args.expert_dtype != "auto" else 1):  # quantise, then read the cached store
            out = subprocess.run([sys.executable, "-c", CHILD, str(folder), args.expert_dtype, str(args.group_size)],
                                 capture_output=True, text=True, check=True, env=env)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    rss = runs[0]
    anon = rss["peak_anon"] - rss["base_anon"]
    hwm = rss["peak_hwm"] - rss["base_hwm"]
    loaded = rss["store_bytes"] + size - expert_ckpt  # experts as stored + the dense part
    print(f"checkpoint {size / 1e6:.0f} MB; loading peak anonymous memory +{anon / 1e6:.0f} MB = {anon / size:.2f}x; "
          f"resident high-water incl. mmapped file pages +{hwm / 1e6:.0f} MB = {hwm / size:.2f}x")
    result = {"checkpoint_bytes": size, "peak_anon_delta_bytes": anon, "anon_ratio": anon / size,
              "hwm_delta_bytes": hwm, "hwm_ratio": hwm / size, "load_s": rss["load_s"], **vars(args)}
    if args.expert_dtype != "auto":
        print(f"{args.expert_dtype}: store {rss['store_bytes'] / 1e6:.0f} MB + dense {(size - expert_ckpt) / 1e6:.0f} MB; "
              f"peak anonymous {anon / loaded:.2f}x that; first start {runs[0]['load_s']:.1f} s (quantising), "
              f"second {runs[1]['load_s']:.1f} s (cached store) = {runs[0]['load_s'] / runs[1]['load_s']:.1f}x faster")
        second = runs[1]["peak_anon"] - runs[1]["base_anon"]
        result.update({"store_bytes": rss["store_bytes"], "loaded_bytes": loaded, "anon_ratio_loaded": anon / loaded,
                       "second_anon_ratio_loaded": second / loaded, "second_load_s": runs[1]["load_s"],
                       "speedup": runs[0]["load_s"] / runs[1]["load_s"]})
    print(json.dumps(result))

if __name__ == "__main__":
    main()
