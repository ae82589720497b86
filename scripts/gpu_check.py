"""The steps of scripts/gpu_check.sh (one subcommand each, so the shell gives each its own timeout).

  preflight  versions, CUDA, free host RAM and disk; exit 3 on a mismatch (a few seconds)
  bandwidth  H2D GB/s: exact-size pinned (moespec's store), caching-allocator pinned, pageable; and
             how long a demand copy waits behind 16 queued prefetches: moespec's engine vs one FIFO stream
  build      a random bf16 slice of Qwen3-30B-A3B (real H=2048, I=768, 128 experts, top-8, attention
             and vocabulary; --layers decoder layers) written as a checkpoint, after checking free space
  syncs      host syncs per decode token (torch.cuda.set_sync_debug_mode) for none/router, exact and
             speculative, with stats on
  report     one JSON + one text report from the pieces (and the `moespec profile` JSON)

Random weights make recall meaningless: the slice measures the transfer/overlap mechanics and times.
``--smoke`` runs the same steps on CPU with a tiny shape (to test the script without a GPU).

Usage: python scripts/gpu_check.py STEP --work DIR --out-dir DIR [--layers 4] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import resource
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                     rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False, decoder_sparse_step=1,
                     mlp_only_layers=[])
SMOKE = dict(QWEN3_30B_A3B, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=16,
             num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
             max_position_embeddings=4096)
# The image of the lent GPU machine (device README): what this check was written against.
EXPECTED = {"python": "3.12", "torch": "2.11", "transformers": ("5.17", "5.24")}
GIB = 2**30


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")


def slice_sizes(shape: dict, layers: int):
    """moespec's size model of the slice (bytes of experts, dense part) from its config alone."""
    from moespec.hub.sizes import model_sizes

    return model_sizes(dict(shape, num_hidden_layers=layers, torch_dtype="bfloat16"))


def available_ram() -> int:
    from moespec.runtime.host.memory import available_bytes

    return available_bytes()


# --- preflight ---------------------------------------------------------------------------------
def preflight(args) -> int:
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "cuda_available": torch.cuda.is_available()}
    problems = []
    if not args.smoke:
        if not info["python"].startswith(EXPECTED["python"]):
            problems.append(f"python {info['python']}, expected {EXPECTED['python']}")
        if not info["torch"].startswith(EXPECTED["torch"]) or not info["cuda"]:
            problems.append(f"torch {info['torch']} (cuda {info['cuda']}), expected {EXPECTED['torch']} with CUDA")
        if not info["transformers"].startswith(EXPECTED["transformers"]):
            problems.append(f"transformers {info['transformers']}, expected one of {EXPECTED['transformers']}")
        if not info["cuda_available"]:
            problems.append("no CUDA device visible")
        else:
            info["device"] = torch.cuda.get_device_name(0)
    for mod in ("accelerate", "safetensors", "typer", "rich", "moespec.cli.app"):
        try:
            __import__(mod)
        except ImportError as exc:
            problems.append(f"cannot import {mod}: {exc}")
    sizes = slice_sizes(SMOKE if args.smoke else QWEN3_30B_A3B, args.layers)
    ckpt = sizes.total_bytes
    # Peak host memory of the slice: the checkpoint (in RAM when the work dir is tmpfs), the pinned
    # store (its experts), and the build's transient (one 1 GB shard) plus each process' own ~2 GB.
    need_ram = ckpt * (2 if args.work.startswith("/dev/shm") else 1) + sizes.experts_bytes + 3 * GIB
    info.update(ram_available_gib=available_ram() / GIB, ram_needed_gib=need_ram / GIB,
                work=args.work, work_free_gib=shutil.disk_usage(args.work).free / GIB, checkpoint_gib=ckpt / GIB)
    if available_ram() < need_ram:
        problems.append(f"{info['ram_available_gib']:.1f} GiB host RAM available, the slice needs "
                        f"{info['ram_needed_gib']:.1f} GiB (lower --layers)")
    if shutil.disk_usage(args.work).free < ckpt * 1.1:
        problems.append(f"{info['work_free_gib']:.1f} GiB free in {args.work}, the checkpoint needs {ckpt / GIB:.1f}")
    info["problems"] = problems
    write_json(Path(args.work) / "preflight.json", info)
    for k, v in info.items():
        log(f"{k}: {v}")
    if problems:
        log("STOP: " + "; ".join(problems))
        return 3
    return 0


# --- bandwidth -----------------------------------------------------------------------------------
def _h2d_gbps(torch, src, dst, repeats: int = 5) -> float:
    """Median GB/s of dst.copy_(src) timed with CUDA events (the first copy is untimed)."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(dst.device)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()  # why: elapsed_time needs both events completed
        times.append(a.elapsed_time(b) / 1e3)
    return src.numel() * src.element_size() / sorted(times)[len(times) // 2] / 1e9


def _demand_wait_ms(torch, engine, slots, rows, prefetches: int) -> float:
    """ms from submitting one demand copy (behind ``prefetches`` queued prefetches) until it landed."""
    for i in range(prefetches):
        engine.submit(slots[i], rows[i], i, prefetch=True)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()  # the compute stream is idle: this completes when the demand copy is submitted
    t = engine.submit(slots[prefetches], rows[prefetches], prefetches)
    engine.wait(t)
    b.record()
    engine.synchronize()
    return a.elapsed_time(b)


def bandwidth(args) -> int:
    import torch

    from moespec.runtime.host.memory import PinnedBuffer
    from moespec.runtime.transfer.cuda import CudaTransferEngine

    dev = torch.device("cuda", 0)
    shape = QWEN3_30B_A3B
    expert_bytes = 3 * shape["hidden_size"] * shape["moe_intermediate_size"] * 2
    out = {"device": torch.cuda.get_device_name(dev), "unit": "GB/s (1e9 bytes/s), median of 5", "sizes": {}}
    for label, nbytes in (("one_expert", expert_bytes), ("256MiB", 256 << 20)):
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        exact = PinnedBuffer(nbytes, dev)
        row = {"bytes": nbytes,
               "pinned_exact": _h2d_gbps(torch, exact.tensor, dst),
               "pinned_caching_allocator": _h2d_gbps(
                   torch, torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), dst),
               "pageable": _h2d_gbps(torch, torch.empty(nbytes, dtype=torch.uint8), dst)}
        exact.close()
        out["sizes"][label] = row
        log(f"H2D {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k != "bytes"))
    # Copy priority: one demand copy submitted behind 16 queued prefetches of one expert each.
    n = 16
    store = PinnedBuffer((n + 1) * expert_bytes, dev)
    rows = store.tensor.view(n + 1, expert_bytes)
    slots = torch.empty(n + 1, expert_bytes, dtype=torch.uint8, device=dev)
    engine = CudaTransferEngine(dev, n + 1)
    _demand_wait_ms(torch, engine, slots, rows, n)  # warm-up
    ours = min(_demand_wait_ms(torch, engine, slots, rows, n) for _ in range(3))
    engine.close()
    fifo = torch.cuda.Stream(dev)
    times = []
    for _ in range(3):  # the same copies on one FIFO stream (what moespec did before)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(fifo):
            for i in range(n):
                slots[i].copy_(rows[i], non_blocking=True)
            a.record(torch.cuda.default_stream(dev))  # idle stream: marks when the demand copy is submitted
            slots[n].copy_(rows[n], non_blocking=True)
            b.record(fifo)
        b.synchronize()
        times.append(a.elapsed_time(b))
    store.close()
    one_copy_ms = expert_bytes / out["sizes"]["one_expert"]["pinned_exact"] / 1e6
    out["demand_behind_16_prefetches_ms"] = {"moespec_engine": ours, "one_fifo_stream": min(times),
                                            "one_expert_copy_ms": one_copy_ms}
    log(f"demand copy behind 16 prefetches: {ours:.2f} ms (moespec), {min(times):.2f} ms (one FIFO stream)")
    write_json(Path(args.work) / "bandwidth.json", out)
    return 0


# --- build ---------------------------------------------------------------------------------------
def build(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    shape = dict(SMOKE if args.smoke else QWEN3_30B_A3B)
    shape.pop("model_type")
    sizes = slice_sizes(SMOKE if args.smoke else QWEN3_30B_A3B, args.layers)
    folder = Path(args.work) / "qwen3-30b-a3b-slice"
    free = shutil.disk_usage(args.work).free
    if free < sizes.total_bytes * 1.1:  # checked before anything is written
        log(f"STOP: {free / GIB:.1f} GiB free in {args.work}, the checkpoint needs {sizes.total_bytes / GIB:.1f} GiB")
        return 4
    device = "cpu" if args.smoke else "cuda:0"
    config = Qwen3MoeConfig(num_hidden_layers=args.layers, **shape)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):  # random init on the GPU: seconds instead of minutes on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    # 1 GB shards bound the host copy save_pretrained makes of GPU tensors.
    model.save_pretrained(folder, max_shard_size="1GB")
    written = sum(f.stat().st_size for f in folder.iterdir())
    log(f"checkpoint: {args.layers} layers x {shape['num_experts']} experts, {written / GIB:.2f} GiB "
        f"in {time.perf_counter() - t0:.0f} s -> {folder}")
    write_json(Path(args.work) / "build.json", {"layers": args.layers, "bytes": written,
                                                "seconds": time.perf_counter() - t0,
                                                "expert_bytes": sizes.expert_bytes,
                                                "num_experts": shape["num_experts"],
                                                "max_rss_gib": _max_rss_gib()})
    return 0


def _max_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux: KiB


# --- syncs ---------------------------------------------------------------------------------------
def syncs(args) -> int:
    import torch

    from moespec.config import ExecuteMode, Predictor, RuntimeConfig, SamplingConfig
    from moespec.predict.base import NoPredictor, RouterPredictor
    from moespec.runtime.engine import Engine
    from moespec.runtime.load import load_offloaded
    from moespec.runtime.stats import StatsRecorder

    folder = Path(args.work) / "qwen3-30b-a3b-slice"
    build_info = json.loads((Path(args.work) / "build.json").read_text())
    device = "cpu" if args.smoke else "cuda:0"
    two_layers = 2 * build_info["num_experts"] * build_info["expert_bytes"]
    om = load_offloaded(folder, RuntimeConfig(device=device, dtype="bfloat16", predictor=Predictor.ROUTER,
                                              gpu_memory_bytes=two_layers), StatsRecorder())
    refs = om.layer_refs()
    main = threading.get_ident()
    out = {"method": "torch.cuda.set_sync_debug_mode('warn'), warnings of the compute thread per decode token",
           "moe_layers": len(om.store.moe_layers), "runs": []}
    try:
        for name, pred, mode in (("none", NoPredictor, ExecuteMode.EXACT),
                                 ("router", RouterPredictor, ExecuteMode.EXACT),
                                 ("router", RouterPredictor, ExecuteMode.SPECULATIVE)):
            om.use_policy(dataclasses.replace(om.policy, predictor=pred(om.adapter, refs), execute=mode))
            engine = Engine(om)
            counts, n = [], 0
            gen = engine.generate(list(range(100, 132)), SamplingConfig(max_new_tokens=9))
            next(gen)  # prefill: not counted
            seen: list[int] = []

            def show(message, category, filename, lineno, file=None, line=None):
                # The pump thread's waits are not the compute thread's syncs: count the main thread only.
                if threading.get_ident() == main and "synchroniz" in str(message):
                    seen.append(1)

            try:
                with warnings.catch_warnings():  # restores showwarning and the filters on exit
                    warnings.simplefilter("always")
                    warnings.showwarning = show
                    if not args.smoke:
                        torch.cuda.set_sync_debug_mode("warn")
                    for _ in gen:  # each count: one decode step (+ reading the sampled token)
                        counts.append(len(seen))
                        seen.clear()
                        n += 1
            finally:
                if not args.smoke:
                    torch.cuda.set_sync_debug_mode("default")
            # On CPU there is nothing to count (the debug mode is CUDA's): None, not a misleading 0.
            per_token = None if args.smoke else sum(counts) / max(n, 1)
            out["runs"].append({"predictor": name, "execute": mode.value, "tokens": n, "syncs_per_token": per_token,
                                "syncs_per_moe_layer": None if per_token is None else per_token / out["moe_layers"]})
            log(f"syncs/token {name} {mode.value}: {per_token} ({out['moe_layers']} MoE layers)")
    finally:
        om.close()
    out["max_rss_gib"] = _max_rss_gib()
    write_json(Path(args.work) / "syncs.json", out)
    return 0


# --- report --------------------------------------------------------------------------------------
def report(args) -> int:
    work, out_dir = Path(args.work), Path(args.out_dir)
    pieces = {}
    for name in ("preflight", "bandwidth", "build", "syncs"):
        p = work / f"{name}.json"
        pieces[name] = json.loads(p.read_text()) if p.is_file() else None
    prof_path = out_dir / args.profile_name
    prof = json.loads(prof_path.read_text()) if prof_path.is_file() else None
    strategies = []
    if prof is not None:
        for r in prof["results"]:
            keys = ("strategy", "prompt_len", "tpot_ms", "ttft_ms", "stall_ms_per_token", "h2d_bytes_per_token",
                    "overlap_fraction", "tpot_ratio_vs_none", "link_gbps_achieved", "on_miss",
                    "tpot_ratio_vs_fetch", "host")
            strategies.append({k: r.get(k) for k in keys})
    rss = [p.get("max_rss_gib", 0.0) for p in (pieces["build"], pieces["syncs"]) if p]
    ckpt_gib = (pieces["build"] or {}).get("bytes", 0) / GIB
    peak = {"max_process_rss_gib": max(rss, default=None), "checkpoint_gib": ckpt_gib,
            "checkpoint_in_ram": args.work.startswith("/dev/shm"),
            "note": "peak host memory ~ checkpoint (when in /dev/shm) + the largest process' RSS "
                    "(the profile process is about the syncs process: same model, same store)"}
    # Issue 17: router prefetch + auto against auto alone (TPOT means, same prompt length): on CPU the
    # prediction costs more than the host work it saves; a GPU predicts for ~nothing beside the pool.
    tpot = {(s["strategy"], s["prompt_len"]): s["tpot_ms"]["mean"] for s in strategies}
    router_vs_auto = {str(plen): ms / tpot[("none+auto", plen)] for (name, plen), ms in tpot.items()
                      if name == "router+auto" and tpot.get(("none+auto", plen))}
    rep = {"schema": 1, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "smoke": args.smoke, **pieces,
           "profile_file": args.profile_name if prof else None, "strategies": strategies, "peak_host_memory": peak,
           "router_auto_vs_none_auto": router_vs_auto, "step_seconds": args.step_seconds}
    stem = out_dir / "gpu-check-report"
    write_json(stem.with_suffix(".json"), rep)
    lines = [f"moespec GPU check ({'smoke, CPU' if args.smoke else (pieces['preflight'] or {}).get('device', '?')})"]
    pf = pieces["preflight"] or {}
    lines.append(f"python {pf.get('python')} torch {pf.get('torch')} cuda {pf.get('cuda')} "
                 f"transformers {pf.get('transformers')}")
    bw = pieces["bandwidth"]
    if bw:
        for label, row in bw["sizes"].items():
            lines.append(f"H2D {label}: exact-pinned {row['pinned_exact']:.1f}, caching-pinned "
                         f"{row['pinned_caching_allocator']:.1f}, pageable {row['pageable']:.1f} GB/s")
        d = bw["demand_behind_16_prefetches_ms"]
        lines.append(f"demand copy behind 16 prefetches: {d['moespec_engine']:.2f} ms, one FIFO stream "
                     f"{d['one_fifo_stream']:.2f} ms (one expert copy {d['one_expert_copy_ms']:.2f} ms)")
    for s in strategies:
        host = s.get("host") or {}
        where = (f", host {host['experts_per_token']:.1f} experts/token ({host['ms_per_token']:.1f} ms), "
                 f"x fetch {s['tpot_ratio_vs_fetch']:.3f}") if s.get("on_miss", "fetch") != "fetch" else ""
        lines.append(f"{s['strategy']:>11} prompt {s['prompt_len']}: TPOT {s['tpot_ms']['mean']:.2f} ms, "
                     f"TTFT {s['ttft_ms']['mean']:.0f} ms, stall {s['stall_ms_per_token']:.2f} ms/token, "
                     f"H2D {s['h2d_bytes_per_token'] / 1e6:.1f} MB/token{where}")
    for plen, r in router_vs_auto.items():
        lines.append(f"router+auto x none+auto prompt {plen}: TPOT {r:.3f} (issue 17 asks <= 0.95)")
    for r in (pieces["syncs"] or {}).get("runs", []):
        if r["syncs_per_token"] is None:
            lines.append(f"syncs/token {r['predictor']} {r['execute']}: n/a on CPU ({r['tokens']} tokens ran)")
            continue
        lines.append(f"syncs/token {r['predictor']} {r['execute']}: {r['syncs_per_token']:.1f} "
                     f"({r['syncs_per_moe_layer']:.2f} per MoE layer, incl. reading the sampled token)")
    lines.append(f"peak host memory: largest process {peak['max_process_rss_gib'] or 0:.1f} GiB "
                 f"+ checkpoint {ckpt_gib:.1f} GiB{' in RAM (/dev/shm)' if peak['checkpoint_in_ram'] else ' on disk'}")
    lines.append(f"steps (s): {args.step_seconds}")
    stem.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["preflight", "bandwidth", "build", "syncs", "report"])
    ap.add_argument("--work", required=True, help="scratch folder (removed by gpu_check.sh)")
    ap.add_argument("--out-dir", default="profiles")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU (to test the script)")
    ap.add_argument("--profile-name", default="gpu-check-profile.json")
    ap.add_argument("--step-seconds", default="", help="report: the shell's per-step timings")
    args = ap.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    return {"preflight": preflight, "bandwidth": bandwidth, "build": build, "syncs": syncs,
            "report": report}[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
