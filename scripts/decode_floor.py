"""Decode TPOT against the memory floor, arms interleaved step by step in one process.

    python scripts/decode_floor.py [MODEL] [--arms off:auto:1,off:auto:2] [--rounds 3] [--gen 24]

An arm is ``COMPILE:EXPERT_DTYPE:THREADS`` (COMPILE as ``--compile`` on|off, EXPERT_DTYPE as
``--expert-dtype``, THREADS torch's intra-op threads set before each of its steps); an optional
fourth part is ``--dense-dtype`` (auto, bf16, int8, or ref: auto with the dense linears on F.linear, the
reference path of runtime/dense.py and the code before the native dense path). Every expert resident (no offloading pressure), CPU, --predictor
none, exact. Each (compile, dtypes) pair is loaded once; each decode step runs once on each arm, the
order rotating every step, so a burst of load hits every arm alike.

The floor is the bytes one decode token reads from memory over the memory-read bandwidth measured
in the same run at the same thread count: every dense parameter but the embedding table (one row of
it is read), lm_head whole (dense linears as ``--dense-dtype`` stores them), and per MoE layer the top-k routed experts' packed rows (the shared
expert is a dense parameter). Bandwidth: the fastest of a sum and a matrix-vector product over a
256 MiB float32 tensor on the weights' 2 MB pages (bigger than any cache here), best of 7. KV-cache reads are left out (a
short context: a few hundred KB). Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def read_gbps(threads: int, reps: int = 7) -> dict[str, float]:
    """Memory-read GB/s (10^9 bytes/s) at ``threads`` intra-op threads: sum and matrix-vector product."""
    import torch

    from moespec.runtime.host import hugepages

    torch.set_num_threads(threads)
    # On the pages the weights lie on (2 MB where the kernel gives them, runtime/host/hugepages.py):
    # 4 KB pages read ~10 % slower here, which would flatter every "x floor" figure.
    w = hugepages.empty((8192, 8192), torch.float32).fill_(1.0)  # 256 MiB float32
    x = torch.ones(8192)
    out = {}
    for name, fn in (("sum", lambda: w.sum()), ("mv", lambda: torch.mv(w, x))):
        fn()
        best = min(_timed(fn) for _ in range(reps))
        out[name] = w.numel() * 4 / best / 1e9
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bytes_per_token(om) -> int:
    """Weight bytes one decode token reads (module docstring): dense params less the embedding table
    (plus one row of it), lm_head, top-k routed rows per MoE layer."""
    model = om.model
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or p.device.type == "meta":
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    total -= emb.numel() * emb.element_size() - emb[0].numel() * emb.element_size()
    if head.data_ptr() == emb.data_ptr():  # tied: lm_head reads the whole table
        total += head.numel() * head.element_size()
    dense = getattr(om, "dense", None)
    if dense is not None:  # the stored (bf16 / int8) weights are what a token reads
        for module in dense.weights:
            held = 0 if module.weight.device.type == "meta" else module.weight.numel() * module.weight.element_size()
            total += dense.bytes_read(module) - held  # a weight freed to meta was not counted above
    store = om.store
    row = store.buffer[0, 0].numel() * store.buffer.element_size()
    return total + len(store.moe_layers) * om.adapter.top_k() * row


def _load(model: str, compile_mode: str, expert_dtype: str, dense_dtype: str):
    from moespec.config import Predictor, RuntimeConfig
    from moespec.runtime.engine import Engine
    from moespec.runtime.load import load_offloaded

    reference = dense_dtype == "ref"
    cfg = RuntimeConfig(device="cpu", predictor=Predictor.NONE, expert_dtype=expert_dtype,
                        dense_dtype="auto" if reference else dense_dtype)
    t0 = time.perf_counter()
    om = load_offloaded(model, cfg)
    om.dense.reference = reference
    if compile_mode != "off":
        from moespec.runtime.compile import compile_dense

        compile_dense(om)
    return Engine(om), time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--arms", default="off:auto:1,off:auto:2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen", type=int, default=24)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    if args.model is None:
        from moespec.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    arms = args.arms.split(",")
    keys = {a: tuple((a.split(":") + ["auto"])[:4]) for a in arms}  # compile, expert, threads, dense
    engines, load_s = {}, {}
    for a, (c, e, _, d) in keys.items():
        if (c, e, d) not in engines:
            engines[(c, e, d)], load_s[f"{c}:{e}:{d}"] = _load(args.model, c, e, d)
    threads = sorted({int(k[2]) for k in keys.values()})
    gbps = {t: read_gbps(t) for t in threads}
    mb = {a: bytes_per_token(engines[(c, e, d)].om) / 1e6 for a, (c, e, _, d) in keys.items()}
    vocab = int(next(iter(engines.values())).om.config.get_text_config().vocab_size)
    ids = torch.randint(0, vocab, (args.prompt_len + args.gen,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt, decode = ids[: args.prompt_len], ids[args.prompt_len:]

    def one_round(decode_ids):
        for eng in engines.values():
            eng.reset()
        times = {a: [] for a in arms}
        for i, tok in enumerate(decode_ids):
            for a in arms[i % len(arms):] + arms[: i % len(arms)]:
                c, e, t, d = keys[a]
                eng = engines[(c, e, d)]
                torch.set_num_threads(int(t))
                if not eng.cached_ids:
                    eng.forward(prompt, "prefill")
                eng.truncate(len(prompt) + i)  # arms sharing an engine: the same context each step
                t0 = time.perf_counter()
                eng.forward([tok], "decode")
                times[a].append((time.perf_counter() - t0) * 1e3)
        return {a: statistics.median(v) for a, v in times.items()}

    one_round(decode[:4])  # warm-up (compiles, first-touch), untimed
    rounds = [one_round(decode) for _ in range(args.rounds)]
    tpot = {a: statistics.median(r[a] for r in rounds) for a in arms}
    rows = {}
    for a in arms:
        t = int(keys[a][2])
        bw = max(gbps[t].values())
        floor_ms = mb[a] / bw  # MB / (GB/s) = ms
        rows[a] = {"tpot_ms": tpot[a], "tok_s": 1e3 / tpot[a], "mb_per_token": mb[a], "floor_ms": floor_ms,
                   "x_floor": tpot[a] / floor_ms, "share_of_floor": floor_ms / tpot[a]}
        print(f"{a:>22}: {tpot[a]:6.2f} ms ({1e3 / tpot[a]:5.1f} tok/s), {mb[a]:.0f} MB/token, floor "
              f"{floor_ms:.2f} ms at {bw:.1f} GB/s: {tpot[a] / floor_ms:.2f}x floor", file=sys.stderr)
    for eng in engines.values():
        eng.om.close()
    print(json.dumps({"model": args.model, "arms": arms, "gbps": gbps, "rounds": rounds, "rows": rows,
                      "load_s": load_s, "prompt_len": args.prompt_len, "gen": args.gen, "cpus": os.cpu_count(),
                      "load_avg": os.getloadavg(), "torch": torch.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
