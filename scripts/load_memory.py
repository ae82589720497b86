"""Peak host memory of loading a checkpoint for offloaded inference, as a ratio to its size.

    python scripts/load_memory.py [--hidden 1024 --inter 512 --layers 8 --experts 32]

Builds a random Qwen3-MoE checkpoint (float32) in a temp folder, then in a fresh process loads it
with moespec and reports (peak RSS - RSS after imports) / checkpoint bytes. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import sys, json, threading, time
import torch, transformers, accelerate, safetensors  # imports are not part of loading
from moespec.config import RuntimeConfig
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
om = load_offloaded(sys.argv[1], RuntimeConfig(cache_experts=16))
stop.set(); t.join()
print(json.dumps({"base_anon": base_anon, "peak_anon": max(peak["anon"], status("RssAnon")),
                  "base_hwm": base_hwm, "peak_hwm": status("VmHWM")}))
om.close()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_checkpoint(Path(tmp) / "m", "qwen3_moe", hidden=args.hidden, inter=args.inter,
                                 layers=args.layers, experts=args.experts, top_k=4)
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        out = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, check=True)
        rss = json.loads(out.stdout.strip().splitlines()[-1])
    anon = rss["peak_anon"] - rss["base_anon"]
    hwm = rss["peak_hwm"] - rss["base_hwm"]
    print(f"checkpoint {size / 1e6:.0f} MB; loading peak anonymous memory +{anon / 1e6:.0f} MB = {anon / size:.2f}x; "
          f"resident high-water incl. mmapped file pages +{hwm / 1e6:.0f} MB = {hwm / size:.2f}x")
    print(json.dumps({"checkpoint_bytes": size, "peak_anon_delta_bytes": anon, "anon_ratio": anon / size,
                      "hwm_delta_bytes": hwm, "hwm_ratio": hwm / size, **vars(args)}))


if __name__ == "__main__":
    main()
