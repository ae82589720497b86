"""GPU check, step 2 and 3 of scripts/gpu_check.sh: H2D bandwidth, then a Qwen3-30B-A3B-shaped profile.

1. Pinned vs pageable host-to-device bandwidth (one expert, and 256 MiB), CUDA events, 5 repeats.
2. A random-weight bf16 slice of Qwen3-30B-A3B (its real hidden size 2048, expert intermediate 768,
   128 experts, top-8, attention shapes and vocabulary; ``--layers`` decoder layers) written as a
   checkpoint to a RAM-backed folder, then ``moespec profile`` on it with ``--gpu-memory`` equal to two
   layers of experts, strategies none / router / oracle. Random weights make recall meaningless:
   this run is for the transfer/overlap mechanics and absolute times.

``--smoke`` runs the same steps on CPU with a tiny shape and an emulated link (to test the script).

Usage: python scripts/gpu_check.py --out-dir profiles [--layers 8] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                     norm_topk_prob=True, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
SMOKE = dict(QWEN3_30B_A3B, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=16,
             num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
             max_position_embeddings=4096)


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def h2d_bandwidth(nbytes: int, pinned: bool, repeats: int = 5) -> float:
    """GB/s of a host-to-device copy of ``nbytes`` (median of ``repeats``), timed with CUDA events."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=pinned)  # first copy pays one-time costs
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=pinned)
        b.record()
        torch.cuda.synchronize()  # why: elapsed_time needs both events completed
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return nbytes / times[len(times) // 2] / 1e9


def build_slice(folder: Path, shape: dict, layers: int, device: str) -> int:
    """Write a random bf16 Qwen3-MoE checkpoint of ``layers`` layers; returns bytes of one expert."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(num_hidden_layers=layers, **shape)
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds instead of minutes on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return 3 * shape["hidden_size"] * shape["moe_intermediate_size"] * 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="profiles")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--prompt-len", default="128,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU with an emulated link")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: nothing to do (use --smoke to test the script on CPU)")
        return 1
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu-smoke"
    tag = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    shape = SMOKE if args.smoke else QWEN3_30B_A3B
    expert_bytes = 3 * shape["hidden_size"] * shape["moe_intermediate_size"] * 2

    if device == "cuda":
        log(f"device: {name}")
        bw = {"device": name, "torch": torch.__version__, "unit": "GB/s (1e9 bytes/s), median of 5",
              "sizes": {}}
        for label, nbytes in (("one_expert", expert_bytes), ("256MiB", 256 << 20)):
            bw["sizes"][label] = {"bytes": nbytes, "pinned": h2d_bandwidth(nbytes, True),
                                  "pageable": h2d_bandwidth(nbytes, False)}
            log(f"H2D {label}: pinned {bw['sizes'][label]['pinned']:.1f} GB/s, "
                f"pageable {bw['sizes'][label]['pageable']:.1f} GB/s")
        (out / f"gpu-{tag}-h2d-bandwidth.json").write_text(json.dumps(bw, indent=1) + "\n")

    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as tmp:
        ckpt = Path(tmp) / "qwen3-30b-a3b-slice"
        t0 = time.perf_counter()
        build_slice(ckpt, shape, args.layers, device)
        log(f"checkpoint: {args.layers} layers × {shape['num_experts']} experts written in {time.perf_counter() - t0:.0f} s")
        stem = out / f"gpu-{tag}-qwen3-30b-a3b-slice{args.layers}"
        cmd = [sys.executable, "-m", "moespec", "profile", str(ckpt), "--device", device, "--dtype", "bfloat16",
               "--gpu-memory", str(2 * shape["num_experts"] * expert_bytes), "--strategies", "none,router,oracle",
               "--prompt-len", args.prompt_len, "--gen", str(args.gen), "--repeats", str(args.repeats),
               "--out", f"{stem}.json", "--trace", f"{stem}.trace.json", "--force"]
        if args.smoke:
            cmd += ["--link-gbps", "1", "--threads", "1"]
        try:
            import matplotlib  # noqa: F401

            cmd += ["--plot", f"{stem}.png"]
        except ImportError:
            log("matplotlib absent: no plot (pip install 'moespec[plot]')")
        log("running: " + " ".join(cmd))
        env = dict(os.environ, COLUMNS="160")
        rc = subprocess.call(cmd, env=env)
    log(f"profile exit code {rc}; files in {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
