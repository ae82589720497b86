"""Peak host memory of loading a checkpoint for offloaded inference, as the OS counts it.

    python scripts/load_memory.py [--hidden 1024 --inter 512 --layers 8 --experts 32]
    python scripts/load_memory.py --hidden 1024 --inter 384 --expert-dtype int4   # Qwen3-30B-A3B-shaped

Builds a random Qwen3-MoE checkpoint (float32) in a temp folder, then in a fresh process loads it
with moespec. Peak RSS is the kernel's high-water mark of the resident set (VmHWM, what `ps`,
`time -v` and ru_maxrss report: anonymous memory AND file pages mapped from the safetensors
checkpoint), reset right before loading (/proc/self/clear_refs), minus the RSS after imports
(torch, transformers and torchao are not part of loading). It is reported as a ratio to the
checkpoint size, and with --expert-dtype int8/int4 (experts quantised while the checkpoint streams
in) to the loaded size: quantised store + dense part; the budget there is 1.3x. The load runs twice
with a fresh moespec home, the first start quantising, the second reading the cached store; both
are reported with their wall times. The peaks of anonymous and of file-backed memory (sampled
every 5 ms) show which one a peak is made of. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BUDGET = 1.3  # peak RSS / (quantised store + dense part), issue 18

BUILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tiny import make_checkpoint
h, i, layers, experts = map(int, sys.argv[3:7])
make_checkpoint(Path(sys.argv[2]), "qwen3_moe", hidden=h, inter=i, layers=layers, experts=experts, top_k=4)
"""

# Loads with the moespec that `import moespec` finds from the current folder (run from the repo root).
CHILD = r"""
import sys, json, resource, threading, time
import torch, transformers, accelerate, safetensors  # imports are not part of loading
from moespec.config import RuntimeConfig
from moespec.models.quant import _primitives
import transformers.models.qwen3_moe.modeling_qwen3_moe  # transformers' lazy imports (~3 s) neither
from transformers import AutoConfig, AutoModelForCausalLM
from accelerate import init_empty_weights
if sys.argv[2] != "auto":
    _primitives()  # nor torchao's (~1-4 s)
from moespec.runtime.load import load_offloaded

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

# The kernel keeps a high-water mark of the whole RSS only; sample its parts to say what a peak is.
peak = {"RssAnon": 0, "RssFile": 0}
stop = threading.Event()
def sample():
    while not stop.is_set():
        for k in peak:
            peak[k] = max(peak[k], status(k))
        time.sleep(0.005)
base = {"rss": status("VmRSS"), "anon": status("RssAnon"), "file": status("RssFile")}
try:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    reset = True
except OSError:
    reset = False  # then VmHWM may hold an import-time peak: the ratio errs high
t = threading.Thread(target=sample); t.start()
t0 = time.perf_counter()
om = load_offloaded(sys.argv[1], RuntimeConfig(cache_experts=16, expert_dtype=sys.argv[2],
                                               group_size=int(sys.argv[3]) or None))
load_s = time.perf_counter() - t0
stop.set(); t.join()
print(json.dumps({"base_rss": base["rss"], "hwm_reset": reset, "peak_hwm": status("VmHWM"),
                  "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "anon_delta": max(peak["RssAnon"], status("RssAnon")) - base["anon"],
                  "file_delta": max(peak["RssFile"], status("RssFile")) - base["file"],
                  "rss_after": status("VmRSS"), "load_s": load_s, "store_bytes": om.store.total_bytes}))
om.close()
"""


def _summary(run: dict, loaded: int) -> dict:
    peak = run["peak_hwm"] - run["base_rss"]
    # ru_maxrss (the whole process's peak, imports included) is what `time -v` prints.
    return {"peak_rss_delta_bytes": peak, "peak_rss_bytes": run["peak_hwm"], "ru_maxrss_bytes": run["ru_maxrss"],
            "hwm_reset": run["hwm_reset"], "ratio_loaded": peak / loaded,
            "anon_delta_bytes": run["anon_delta"], "file_delta_bytes": run["file_delta"], "load_s": run["load_s"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--expert-dtype", default="auto", help="auto, int8 or int4")
    ap.add_argument("--group-size", type=int, default=0, help="int8/int4 group size (0: the default)")
    args = ap.parse_args()
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "m"
        # Built in its own process: a child inherits its parent's peak RSS in ru_maxrss across exec.
        subprocess.run([sys.executable, "-c", BUILD, tests, str(folder), str(args.hidden), str(args.inter),
                        str(args.layers), str(args.experts)], check=True, capture_output=True)
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        expert_ckpt = args.layers * args.experts * 3 * args.hidden * args.inter * 4  # float32 on disk
        env = {**os.environ, "MOESPEC_HOME": str(Path(tmp) / "home")}  # no cached store yet
        runs = []
        for _ in range(2 if args.expert_dtype != "auto" else 1):  # quantise, then read the cached store
            out = subprocess.run([sys.executable, "-c", CHILD, str(folder), args.expert_dtype, str(args.group_size)],
                                 capture_output=True, text=True, check=True, env=env)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    loaded = runs[0]["store_bytes"] + size - expert_ckpt  # experts as stored + the dense part
    first = _summary(runs[0], loaded)
    mb = 1e6
    print(f"checkpoint {size / mb:.0f} MB; loaded {loaded / mb:.0f} MB (store {runs[0]['store_bytes'] / mb:.0f} MB "
          f"+ dense {(size - expert_ckpt) / mb:.0f} MB)")
    result = {"checkpoint_bytes": size, "loaded_bytes": loaded, "store_bytes": runs[0]["store_bytes"],
              "budget": BUDGET, "first": first, **vars(args)}
    for name, s in [("first start", first)] + ([("second start", _summary(runs[1], loaded))] if len(runs) > 1 else []):
        print(f"{name}: peak RSS +{s['peak_rss_delta_bytes'] / mb:.0f} MB over imports = {s['ratio_loaded']:.2f}x "
              f"loaded ({s['peak_rss_delta_bytes'] / size:.2f}x checkpoint; anonymous peak "
              f"+{s['anon_delta_bytes'] / mb:.0f} MB, file pages +{s['file_delta_bytes'] / mb:.0f} MB); "
              f"{s['load_s']:.1f} s; process peak (ru_maxrss) {s['ru_maxrss_bytes'] / mb:.0f} MB")
    if len(runs) > 1:
        second = _summary(runs[1], loaded)
        result.update({"second": second, "speedup": first["load_s"] / second["load_s"]})
        print(f"second start {result['speedup']:.1f}x faster (cached store)")
    ok = all(result[k]["ratio_loaded"] <= BUDGET for k in ("first", "second") if k in result)
    result["pass"] = ok if args.expert_dtype != "auto" else None
    print(json.dumps(result))
    return 0 if ok or args.expert_dtype == "auto" else 1


if __name__ == "__main__":
    sys.exit(main())
