"""Host expert speed against the machine's memory read speed, per row format, tokens and threads.

Shapes: t tokens per expert, H hidden, I expert intermediate, k experts per dispatch (one layer).

For each expert shape (Qwen3-30B-A3B: H 2048, I 768, k 8; GPT-OSS: H 2880, I 2880, k 4) and row
format (float32, bfloat16, int8, int4 with float32 activations = exact; w8a8 / w4a8 = int8 / int4
rows with int8 activations, not exact), it fills an expert store with enough distinct random
experts that they are not cache-resident (>= 256 MB, 8..24 experts), and times the host pool
(moespec.runtime.misses.host_pool.HostExpertPool: one dispatch of k experts per layer, split by experts
or rows) computing them for t tokens with 1..cores threads (N threads: N - 1 workers and the caller,
which runs the units no worker took; 1: one worker, the caller only waits). Per row it prints ms per expert
(median of --reps passes over every expert), GB/s of row bytes, the memory read GB/s of the same
run with the same threads (``torch.sum`` over a 1 GB float32 tensor with that many intra-op
threads, best of 3, measured right before the row's timing) and the share (row GB/s / memory read).
``--reference`` adds, at one thread, the slow reference (dequantise, then F.linear) for comparison.

Honest numbers: warm-up pass untimed, the same inputs for every arm, one process; run it on an
otherwise idle machine (the memory read GB/s moves with what else runs).
The last line of stdout is one JSON object (the config, versions and every row).

Usage:
    python scripts/host_expert_bench.py
    python scripts/host_expert_bench.py --shapes qwen3 --formats int4,w4a8 --tokens 1 --threads 1
    python scripts/host_expert_bench.py --shapes qwen3 --tokens 1 --threads 1 --isa avx2,avx512
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moespec.kernels import native  # noqa: E402
from moespec.kernels.expert_batch import Split  # noqa: E402
from moespec.models.layout import ExpertLayout  # noqa: E402
from moespec.models.quant_layout import QuantLayout  # noqa: E402
from moespec.runtime.misses.host_pool import HostExpertPool  # noqa: E402
from moespec.runtime.host import hugepages  # noqa: E402
from moespec.runtime.host.store import ExpertStore  # noqa: E402

SHAPES = {"qwen3": (2048, 768, 8), "gpt-oss": (2880, 2880, 4)}  # H, I, experts per dispatch (top-k)
FORMATS = ("float32", "bfloat16", "int8", "int4", "w8a8", "w4a8")
LOWBIT = {"int8": (8, False), "int4": (4, False), "w8a8": (8, True), "w4a8": (4, True)}  # bits, int8 activations
STORE_BYTES = 256e6  # enough distinct experts that the weights come from memory, not the L3 cache
MAX_EXPERTS = 24


def memory_read_gbs(threads: int, gib: float = 1.0) -> float:
    """Best of 3 ``torch.sum`` over ``gib`` GiB of float32 with ``threads`` intra-op threads (GB/s).

    The tensor lives in memory of the expert store's kind (host/hugepages.py: 2 MiB pages where
    the kernel gives them), so the share compares reads of the same pages."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = hugepages.empty((int(gib * 2**30) // 4,), torch.float32).fill_(1.0)
        a.sum()
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            a.sum()
            best = max(best, a.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        return best
    finally:
        torch.set_num_threads(before)


def make_store(fmt: str, hidden: int, inter: int, k: int, seed: int = 0) -> tuple[ExpertStore, torch.dtype]:
    """A one-layer store of random experts of ``fmt`` (valid float16 scales), and the compute dtype."""
    if fmt in ("float32", "bfloat16"):
        layout, dtype = ExpertLayout(hidden, inter), getattr(torch, fmt)
    else:
        bits, act_int8 = LOWBIT[fmt]
        layout = QuantLayout(hidden, inter, bits=bits, act_int8=act_int8)
        dtype = torch.float32
    per = ExpertStore.bytes_needed(1, 1, layout, dtype)
    n = min(MAX_EXPERTS, max(k, math.ceil(STORE_BYTES / per)))
    store = ExpertStore([0], n, layout, dtype)
    gen = torch.Generator().manual_seed(seed)
    for e in range(n):
        row = store.expert(0, e)
        if fmt in ("float32", "bfloat16"):
            row.copy_(torch.randn(row.numel(), generator=gen) * 0.02)
            continue
        row.copy_(torch.randint(0, 256, (row.numel(),), dtype=torch.uint8, generator=gen))
        v = layout.views(row)
        for name in ("gate_up_scales", "down_scales"):
            v[name].view(torch.float16).copy_(torch.rand(v[name].numel() // 2, generator=gen) * 0.02 + 1e-3)
    return store, dtype


def time_pool(store: ExpertStore, dtype: torch.dtype, tokens: int, threads: int, k: int, reps: int,
              split: Split, path: str = "kernels") -> float:
    """Median ms per expert over ``reps`` passes over every expert, k experts per dispatch.

    ``path``: "kernels" (the host pool), "reference" (dequantise, then F.linear, on the calling
    thread) or "direct" (the pool's own per-expert forward, called on the calling thread: the pool's
    overhead is kernels - direct at one thread), "waits" (the host pool, the caller only waiting:
    HostExpertPool(caller_helps=False)), "python" (the host pool with its Python batch units,
    moespec.kernels.expert_batch, instead of the native batch: what the native batch saves)."""
    reference = path == "reference"
    act = torch.nn.functional.silu
    n = store.num_experts
    x = torch.randn(tokens, store.layout.hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    batches = [[(e % n, x) for e in range(b, b + k)] for b in range(0, n, k)]
    if reference:  # the slow reference on the calling thread: dequantise, then F.linear
        from moespec.kernels import linear as kl

        layout = store.layout
        before = torch.get_num_threads()
        torch.set_num_threads(1)

        def one_pass() -> None:
            for batch in batches:
                for e, xe in batch:
                    w1, w2 = layout.linear_weights(store.expert(0, e))
                    h = layout.act_and_mul(kl.linear_reference(xe, w1), act)
                    kl.linear_reference(h, w2)
    elif path == "direct":  # the layout's forward, as a pool unit runs it, without the pool
        layout = store.layout
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        reference = True  # restore the thread count below

        def one_pass() -> None:
            for batch in batches:
                for e, xe in batch:
                    layout.forward(xe, store.expert(0, e), act)
    else:
        # ``threads`` threads compute, as many as the memory read uses: the helping caller is one of
        # them (threads - 1 workers); one thread: one worker and a caller that only waits ("waits":
        # ``threads`` workers, the caller waits)
        helps = path != "waits" and threads > 1
        pool = HostExpertPool(store, torch.device("cpu"), threads - 1 if helps else threads, split,
                              caller_helps=helps)
        if path == "python":
            pool._native_batch = lambda *args: None  # every batch an ExpertBatch

        def one_pass() -> None:
            for batch in batches:
                for job in pool.submit_layer(0, batch, act):
                    job.result()
    try:
        with torch.inference_mode():
            one_pass()  # warm-up: allocations, first touch
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                one_pass()
                times.append((time.perf_counter() - t0) / (len(batches) * k))
    finally:
        if reference:
            torch.set_num_threads(before)
        else:
            pool.close()
    return statistics.median(times) * 1e3


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="qwen3, gpt-oss")
    ap.add_argument("--formats", default=",".join(FORMATS), help=", ".join(FORMATS))
    ap.add_argument("--tokens", default="1,4,16", help="tokens per expert (comma list)")
    ap.add_argument("--threads", default=",".join(map(str, range(1, cores + 1))), help="computing threads, the caller included (comma list)")
    ap.add_argument("--split", default="auto", choices=[s.value for s in Split], help="how a batch is cut")
    ap.add_argument("--reps", type=int, default=5, help="timed passes over every expert")
    ap.add_argument("--per-dispatch", type=int, default=0,
                    help="experts per dispatch (default: the shape's top-k, 8 or 4)")
    ap.add_argument("--reference", action="store_true", help="also time the slow reference at one thread")
    ap.add_argument("--direct", action="store_true",
                    help="also time the experts' forward on the calling thread, no pool (its overhead)")
    ap.add_argument("--python-batch", action="store_true",
                    help="also time the pool with Python batch units instead of the native batch")
    ap.add_argument("--waits", action="store_true",
                    help="also time the pool with a caller that only waits (caller_helps=False)")
    ap.add_argument("--isa", default="", help="kernel instruction sets to compare (comma list of avx2, avx512; "
                    "default: the one in use)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    status = native.status()
    isas = [v for v in args.isa.split(",") if v] or [native.current_isa() or "-"]
    if status.lib is not None and "avx512" in isas and status.isa != "avx512":
        ap.error(f"--isa avx512: {status.isa_note}")
    print(f"kernels: {'native (moespec/kernels/csrc)' if status.lib else status.note}")
    if status.lib is not None:
        print(f"isa: {status.isa_note or status.isa}")
    print(f"cpu: {platform.processor() or platform.machine()}, {cores} cores, torch {torch.__version__}")
    rows, mem_cache = [], {}
    head = (f"{'shape':7} {'rows':9} {'isa':6} {'t':>3} {'thr':>3} {'ms/expert':>9} {'row GB/s':>8} "
            f"{'mem GB/s':>8} {'share':>5}")
    print(head)
    print("-" * len(head))
    for shape in args.shapes.split(","):
        hidden, inter, k = SHAPES[shape]
        k = args.per_dispatch or k
        for fmt in args.formats.split(","):
            store, dtype = make_store(fmt, hidden, inter, k)
            row_bytes = store.expert_bytes
            arms = [(threads, "kernels", isa) for threads in _ints(args.threads) for isa in isas]
            if args.waits:
                arms = [(t, p, i) for t, _, i in arms for p in ("waits", "kernels")]
            if args.python_batch:
                arms = [(t, p, i) for t, q, i in arms for p in (("python", q) if q == "kernels" else (q,))]
            if args.direct:
                arms.insert(0, (1, "direct", isas[0]))
            if args.reference and fmt not in ("w8a8", "w4a8"):
                arms.insert(0, (1, "reference", "-"))
            for threads, path, isa in arms:
                for tokens in _ints(args.tokens):
                    mem = memory_read_gbs(threads)
                    mem_cache.setdefault(threads, []).append(mem)
                    before = native.set_isa(isa) if isa in native.ISAS else None
                    try:
                        ms = time_pool(store, dtype, tokens, threads, k, args.reps, Split(args.split), path)
                    finally:
                        if before is not None:
                            native.set_isa(before)
                    gbs = row_bytes / ms / 1e6
                    name = fmt + {"reference": " ref", "direct": " dir", "waits": " wait", "python": " py", "kernels": ""}[path]
                    print(f"{shape:7} {name:9} {isa:6} {tokens:3d} {threads:3d} {ms:9.3f} {gbs:8.1f} {mem:8.1f} "
                          f"{gbs / mem:5.0%}", flush=True)
                    rows.append({"shape": shape, "hidden": hidden, "intermediate": inter, "format": fmt,
                                 "path": path, "isa": isa, "tokens": tokens,
                                 "threads": threads, "ms_per_expert": round(ms, 4), "row_bytes": row_bytes,
                                 "row_gbs": round(gbs, 2), "memory_read_gbs": round(mem, 2),
                                 "share": round(gbs / mem, 3)})
            del store
    print(json.dumps({"bench": "host_expert", "kernels": "native" if status.lib else status.note,
                      "isa": status.isa, "isa_note": status.isa_note,
                      "machine": platform.machine(), "cores": cores, "torch": torch.__version__,
                      "split": args.split, "reps": args.reps,
                      "experts_per_dispatch": {s: args.per_dispatch or SHAPES[s][2] for s in SHAPES},
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
