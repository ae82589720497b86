"""Measure the disk tier on a Qwen3-30B-A3B-shaped random slice (README, "Experts on disk").

    python scripts/disk_tier_bench.py make /tmp/q30 --layers 8          # 9.7 GB of bf16 experts
    python scripts/disk_tier_bench.py arm /tmp/q30 --predictor router --host-memory 1GiB --tokens 12
    python scripts/disk_tier_bench.py reader /tmp/q30 --inflight 8 --seconds 6

``make`` writes config.json and one safetensors shard per layer (experts as mlp.experts.N.*_proj, as
the Hub's checkpoint names them), never more than one layer in RAM. ``arm`` loads the model with the
experts on disk, decodes greedily from a fixed random prompt and prints one JSON line (TPOT, the
disk tier's numbers, peak RSS). ``reader`` reads random rows of the model's store file with the
disk tier's reader and ``--inflight`` reads in flight, nothing else running: the O_DIRECT GB/s the
disk floor divides by. Run each arm in its own process under scripts/memcap.sh with the page cache
dropped before it (scripts/disk_hold.sh does both). ``accelerate-prep`` writes accelerate's offload folder
once; ``accelerate`` decodes with accelerate's disk offload from it.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from pathlib import Path

import torch


def make(folder: Path, layers: int, vocab: int) -> None:
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
                         tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, dtype="bfloat16")
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    gen = torch.Generator().manual_seed(0)

    pool = (torch.randn(1 << 26, generator=gen) * 0.02).to(torch.bfloat16)  # 128 MB of N(0, 0.02) values

    def rnd(*shape, scale=0.02):
        """Random-looking weights cheaply: a copy of the pool at a random offset (the disk tier's timing
        does not depend on the values; the routers get fresh random weights, so routing varies)."""
        n = int(torch.tensor(shape).prod())
        if scale != 0.02 or n > pool.numel():
            return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)
        start = int(torch.randint(0, pool.numel() - n + 1, (1,), generator=gen))
        return pool[start : start + n].clone().view(*shape)

    H, I, E = 2048, 768, 128
    index = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
             p + "self_attn.q_proj.weight": rnd(4096, H), p + "self_attn.k_proj.weight": rnd(512, H),
             p + "self_attn.v_proj.weight": rnd(512, H), p + "self_attn.o_proj.weight": rnd(H, 4096),
             p + "self_attn.q_norm.weight": torch.ones(128, dtype=torch.bfloat16),
             p + "self_attn.k_norm.weight": torch.ones(128, dtype=torch.bfloat16),
             p + "mlp.gate.weight": rnd(E, H, scale=0.5)}
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"], t[q + "up_proj.weight"], t[q + "down_proj.weight"] = rnd(I, H), rnd(I, H), rnd(H, I)
        name = f"model-{i:05d}.safetensors"
        save_file(t, folder / name, metadata={"format": "pt"})
        index.update({k: name for k in t})
        del t
    t = {"model.embed_tokens.weight": rnd(vocab, H), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
         "lm_head.weight": rnd(vocab, H)}
    save_file(t, folder / "model-dense.safetensors", metadata={"format": "pt"})
    index.update({k: "model-dense.safetensors" for k in t})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def structure_routing(om, scale: float) -> None:
    """Make the slice's routing predictable, as a trained model's is: the token embedding scaled by
    ``scale`` carries the residual stream (random attention and experts add N(0, ~1) per layer, the
    random embedding only N(0, 0.02)), so router_{l+1}(r_l) is near router_{l+1}(r_{l+1}). Exact mode
    is unchanged (every arm decodes the same scaled model); 1.0 leaves the slice as written."""
    if scale != 1.0:
        with torch.no_grad():
            om.model.get_input_embeddings().weight.mul_(scale)


def arm(folder: Path, predictor: str, host_memory: str, tokens: int, prompt_len: int, disk_reads: str,
        embed_scale: float = 1.0, tune: dict | None = None, expert_dtype: str = "auto",
        floor_seconds: float = 0.0) -> None:
    from moespec.config import Predictor, RuntimeConfig, SamplingConfig, parse_bytes
    from moespec.runtime.disk_tier import disk_numbers
    from moespec.runtime.engine import Engine
    from moespec.runtime.load import load_offloaded
    from moespec.runtime.stats import StatsRecorder, summarize

    tune = tune or {}
    if tune.get("readers"):  # reads in flight: the loader's disk reader with that many threads
        from moespec.runtime import disk_tier

        make = disk_tier.make_engine
        disk_tier.make_engine = lambda store, readers=None: make(store, tune["readers"])
    t0 = time.perf_counter()
    host = None if host_memory == "auto" else parse_bytes(host_memory)  # auto: the loader's default (disk_tier.py)
    cfg = RuntimeConfig(predictor=Predictor(predictor), host_memory_bytes=host, disk_reads=disk_reads,
                        expert_dtype=expert_dtype)
    om = load_offloaded(folder, cfg, StatsRecorder())
    load_s = time.perf_counter() - t0
    structure_routing(om, embed_scale)
    engine = om.cache.engine
    if tune.get("chunk_mib"):
        engine.chunk_bytes = int(tune["chunk_mib"] * 2**20)
    if tune.get("no_verify"):  # the A/B of the rows' checksums (DiskReadEngine.verify)
        engine.verify = False
    if tune.get("prefetch_beside") is not None:
        engine.prefetch_beside = tune["prefetch_beside"]
    if tune.get("switch_ms"):
        __import__("sys").setswitchinterval(tune["switch_ms"] / 1e3)
    if tune.get("torch_threads"):
        torch.set_num_threads(tune["torch_threads"])
    om.ledger.promote_kept = tune.get("kept_promote", True)
    om.ledger.cut_started = tune.get("cut", True)
    if tune.get("ahead") is not None:  # l+2 ahead reads once the lookahead's recall is >= this (runtime/layer/ahead.py)
        from dataclasses import replace

        om.use_policy(replace(om.runner.policy, ahead_recall=tune["ahead"]))
    prompt = random.Random(1).choices(range(om.config.vocab_size), k=prompt_len)
    # The disk floor's divisor in the same process, just before the prefill and just after the
    # decode (the model idle, 8 reads in flight, the same file): this virtual disk drifts 1.5x
    # within minutes, so a reader arm minutes away misjudges an arm's floor by as much.
    floor = {}
    if floor_seconds > 0:
        floor["reader_gbps_before"] = read_rate(store_file(folder, expert_dtype), 8, floor_seconds, 1)["gbps"]
    try:
        # Sampled with a fixed seed: the same tokens in every arm (exact mode), not greedy's repeats.
        out, mark = [], None
        for tok in Engine(om).generate(prompt, SamplingConfig(max_new_tokens=tokens, temperature=1.0, seed=0)):
            out.append(tok)
            if mark is None:  # the prefill is done: decode's disk time starts here
                mark = (time.perf_counter(), engine.busy_seconds(), engine.bytes_moved)
        end = (time.perf_counter(), engine.busy_seconds(), engine.bytes_moved)
        summary = summarize(om.recorder.steps)
        disk = disk_numbers(summary, om.cache)
        ahead = {"ahead_recall": om.runner.ahead.recall, "ahead_issued": getattr(om.runner.ahead, "issued", None)}
        gate = getattr(om.runner.prefetcher, "gate", None)
        gate = None if gate is None else [int(g["open"]) for g in gate.report().values()]
        if floor_seconds > 0:
            floor["reader_gbps_after"] = read_rate(store_file(folder, expert_dtype), 8, floor_seconds, 2)["gbps"]
    finally:
        om.close()
    wall_s, busy_s, nbytes = (b - a for a, b in zip(mark, end))
    decode = {"decode_disk_gbps": round(nbytes / busy_s / 1e9, 3) if busy_s > 0 else None,
              "decode_disk_busy_share": round(busy_s / wall_s, 3) if wall_s > 0 else None,
              "decode_disk_mb_per_token": round(nbytes / 1e6 / max(len(out) - 1, 1), 1)}
    print(json.dumps({"predictor": predictor, "host_memory": host_memory, "reads_via": disk_reads,
                      "expert_dtype": expert_dtype, "load_s": round(load_s, 2),
                      "tpot_ms": round(summary.tpot_ms, 1), "ttft_ms": round(summary.ttft_ms, 1),
                      "recall": summary.recall, "tokens": out[:4], **(disk or {}),
                      **decode, **floor, "embed_scale": embed_scale, "tune": tune, "gate_open": gate,
                      "prefetch_wasted_per_token": round(summary_per_token(om, "prefetch_wasted"), 2),
                      "prefetched_per_token": round(summary_per_token(om, "prefetched"), 2),
                      # a prefetch never evicts what would hit: hits not from a prefetch vs on-demand's hits
                      "hits_per_token": round(summary_per_token(om, "hits"), 2),
                      "prefetch_used_per_token": round(summary_per_token(om, "prefetch_used"), 2),
                      "compute_ms_per_token": round(summary.compute_ms_per_token, 1),
                      "cut_reads": getattr(engine, "cut_reads", None), **ahead,
                      "prefetched_ahead_per_token": round(summary_per_token(om, "prefetched_ahead"), 2),
                      "major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt,
                      "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))


def summary_per_token(om, field: str) -> float:
    """A LayerStats counter summed over the decode steps' layers, per decode step."""
    steps = [s for s in om.recorder.steps if s.kind == "decode"]
    return sum(getattr(ls, field) for s in steps for ls in s.layers.values()) / max(len(steps), 1)


def _offload_map(cfg) -> dict:
    """accelerate's device map of the slice: every layer's fused experts on "disk", the rest on the CPU."""
    dm = {name: "cpu" for name in ("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head")}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        dm.update({p + part: "cpu" for part in ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp.gate")})
        dm[p + "mlp.experts"] = "disk"
    return dm


def accelerate_prep(folder: Path, offload: Path) -> None:
    """The offload folder accelerate reads from, written once (outside any cap): each layer's experts
    fused as transformers 5 holds them (gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]),
    one safetensors file per tensor, and index.json (accelerate's offload index). One layer in RAM."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    offload.mkdir(parents=True, exist_ok=True)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    index = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        with safe_open(folder / weight_map[p + "0.gate_proj.weight"], framework="pt") as f:
            E = cfg.num_experts
            gate_up = torch.stack([torch.cat([f.get_tensor(f"{p}{e}.gate_proj.weight"),
                                              f.get_tensor(f"{p}{e}.up_proj.weight")]) for e in range(E)])  # [E, 2I, H]
            down = torch.stack([f.get_tensor(f"{p}{e}.down_proj.weight") for e in range(E)])  # [E, H, I]
        for name, t in ((p + "gate_up_proj", gate_up), (p + "down_proj", down)):
            path = offload / f"{name}.safetensors"
            save_file({name: t}, path)
            index[name] = {"safetensors_file": str(path), "weight_name": name, "dtype": "bfloat16"}
        del gate_up, down
    (offload / "index.json").write_text(json.dumps(index))
    print(json.dumps({"accelerate_offload": str(offload), "tensors": len(index)}))


def accelerate_arm(folder: Path, offload: Path, tokens: int, prompt_len: int) -> None:
    """transformers + accelerate's disk offload (dispatch_model, experts "disk", the offload folder of
    ``accelerate-prep``): every forward reads each layer's E experts in full. Greedy decode, TPOT."""
    from accelerate import dispatch_model, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    t0 = time.perf_counter()
    cfg = AutoConfig.from_pretrained(folder)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    for shard in sorted(folder.glob("model-*.safetensors")):  # the dense part into RAM, the experts stay on disk
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                if ".mlp.experts." not in key:
                    set_module_tensor_to_device(model, key, "cpu", value=f.get_tensor(key))
    index = json.loads((offload / "index.json").read_text())
    model = dispatch_model(model, device_map=_offload_map(cfg), offload_dir=str(offload), offload_index=index)
    model.eval()
    load_s = time.perf_counter() - t0
    ids = torch.tensor([random.Random(1).choices(range(model.config.vocab_size), k=prompt_len)])
    times = []
    with torch.inference_mode():
        kv = DynamicCache(config=model.config)
        out = model(ids, past_key_values=kv, use_cache=True)
        read0 = _read_bytes()
        for _ in range(tokens):
            nxt = out.logits[:, -1:].argmax(-1)
            t = time.perf_counter()
            out = model(nxt, past_key_values=kv, use_cache=True)
            times.append(time.perf_counter() - t)
        read_mb = (_read_bytes() - read0) / 1e6 / tokens
    print(json.dumps({"predictor": "accelerate", "arm": "accelerate offload (dispatch_model, experts on disk)",
                      "load_s": round(load_s, 2), "tpot_ms": round(1e3 * sum(times) / len(times), 1),
                      "decode_disk_mb_per_token": round(read_mb, 1),
                      "decode_disk_gbps": round(read_mb * len(times) / 1e3 / sum(times), 3),
                      "tokens": tokens, "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))


def _read_bytes() -> int:
    """Bytes this process has read from the block device so far (page_cache.read_bytes: page cache
    misses and O_DIRECT reads, not page cache hits); 0 where the kernel does not count them."""
    from moespec.runtime.host.page_cache import read_bytes

    return read_bytes() or 0


def _slot_memory(nbytes: int):
    """Memory as the RAM tier's slots get it (DiskStore.slot_rows: private, on 2 MB pages unless
    MOESPEC_HUGE_PAGES=0): O_DIRECT into 4 KB pages ran 1.06-1.11 GB/s in decode against 1.84-2.06
    into 2 MB pages (docs/decisions.md), so the floor's reader must read into the same kind."""
    import mmap

    from moespec.runtime.host import hugepages

    raw = mmap.mmap(-1, nbytes, flags=hugepages.PRIVATE)
    if hugepages.enabled():
        try:
            raw.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP off: 4 KB pages, as the slots
    return raw


def store_file(folder: Path, expert_dtype: str = "auto") -> Path:
    """The store file the arms of ``expert_dtype`` read (rows-int8-g64..., rows-<layout>-bfloat16)."""
    from moespec.artifacts import model_key, sanitize_model_id
    from moespec.paths import moespec_home

    files = (moespec_home() / "experts" / sanitize_model_id(model_key(folder))).glob("rows-*.moerows")
    quantised = expert_dtype.startswith("int")
    (path,) = [f for f in files if f.name.startswith(f"rows-{expert_dtype}-") or (not quantised and "-int" not in f.name)]
    return path


def read_rate(path: Path, inflight: int, seconds: float, seed: int = 0) -> dict:
    """The disk tier's reader (DiskReadEngine, its chunks and checksums) reading random rows of the
    store file ``path`` with ``inflight`` reads in flight and nothing else, for ``seconds``: GB/s
    (the disk floor's divisor), bytes, seconds, whether O_DIRECT."""
    from moespec.runtime.host.disk_store import DiskRow, DiskStore, round_up
    from moespec.runtime.transfer.disk import DiskReadEngine

    with open(path, "rb") as fh:  # the file's own header: the bench reads whatever the loader wrote
        head = fh.read(24)
        meta = json.loads(fh.read(int.from_bytes(head[16:24], "little")))["meta"]
    store = DiskStore.open(path, meta)
    engine = DiskReadEngine(path, readers=inflight)
    rows = len(store.moe_layers) * store.num_experts
    stride = store.stride
    buf = torch.frombuffer(_slot_memory(inflight * stride), dtype=torch.uint8).view(inflight, stride)
    rng = random.Random(seed)

    itemsize = torch.empty((), dtype=getattr(torch, store.header["dtype"].removeprefix("torch."))).element_size()
    nbytes = int(store.header["numel"]) * itemsize  # every layer's rows are whole here (no GGUF mix)

    def row():
        i = rng.randrange(rows)
        key = (store.moe_layers[i // store.num_experts], i % store.num_experts)
        return DiskRow(key, store.data_offset + i * stride, nbytes, round_up(nbytes), store.digests[i])

    tickets = [engine.submit(buf[s], row(), s) for s in range(inflight)]
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for s in range(inflight):
            engine.wait(tickets[s])
            n += tickets[s].nbytes
            tickets[s] = engine.submit(buf[s], row(), s)
    wall = time.perf_counter() - t0
    engine.close()  # waits for the reads still in flight (not counted: past the window)
    return {"inflight": inflight, "gbps": round(n / wall / 1e9, 3), "o_direct": engine.direct,
            "bytes": n, "seconds": round(wall, 2)}


def reader(folder: Path, inflight: int, seconds: float, expert_dtype: str = "auto") -> None:
    print(json.dumps(read_rate(store_file(folder, expert_dtype), inflight, seconds)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("folder", type=Path)
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--vocab", type=int, default=4096)
    a = sub.add_parser("arm")
    a.add_argument("folder", type=Path)
    a.add_argument("--predictor", default="router")
    a.add_argument("--host-memory", default="1GiB", help="the RAM tier, or auto (what fits under the cap)")
    a.add_argument("--tokens", type=int, default=12)
    a.add_argument("--prompt-len", type=int, default=8)
    a.add_argument("--disk-reads", default="direct", choices=["direct", "mmap"])
    a.add_argument("--expert-dtype", default="auto", help="auto (the checkpoint's bf16), int8, int4: the store's rows")
    a.add_argument("--embed-scale", type=float, default=1.0, help="structured routing (structure_routing)")
    a.add_argument("--chunk-mib", type=float, help="the reader's chunk (DiskReadEngine.chunk_bytes)")
    a.add_argument("--prefetch-beside", type=int, help="DiskReadEngine.prefetch_beside")
    a.add_argument("--switch-ms", type=float, help="sys.setswitchinterval (the GIL's hand-over), ms")
    a.add_argument("--torch-threads", type=int)
    a.add_argument("--no-kept-promote", action="store_true", help="PrefetchLedger.promote_kept off (the A/B)")
    a.add_argument("--no-cut", action="store_true", help="PrefetchLedger.cut_started off (the A/B)")
    a.add_argument("--no-verify", action="store_true", help="DiskReadEngine.verify off (the checksums' A/B)")
    a.add_argument("--readers", type=int, help="the disk reader's threads (reads in flight; default 8)")
    a.add_argument("--ahead", type=float, help="read l+2's predicted rows at this lookahead recall (LayerPolicy.ahead_recall)")
    a.add_argument("--floor-seconds", type=float, default=0.0,
                   help="run the reader (8 in flight) this long before the prefill and after the decode")
    hp = sub.add_parser("accelerate-prep")
    hp.add_argument("folder", type=Path)
    hp.add_argument("--offload", type=Path, required=True)
    h = sub.add_parser("accelerate")
    h.add_argument("folder", type=Path)
    h.add_argument("--offload", type=Path, required=True, help="written by accelerate-prep")
    h.add_argument("--tokens", type=int, default=2)
    h.add_argument("--prompt-len", type=int, default=8)
    r = sub.add_parser("reader")
    r.add_argument("folder", type=Path)
    r.add_argument("--inflight", type=int, default=8)
    r.add_argument("--seconds", type=float, default=6.0)
    r.add_argument("--expert-dtype", default="auto", help="which store file: the one the arms of this dtype read")
    args = ap.parse_args()
    if args.cmd == "make":
        make(args.folder, args.layers, args.vocab)
    elif args.cmd == "arm":
        arm(args.folder, args.predictor, args.host_memory, args.tokens, args.prompt_len, args.disk_reads, args.embed_scale,
            {"chunk_mib": args.chunk_mib, "prefetch_beside": args.prefetch_beside, "switch_ms": args.switch_ms,
             "torch_threads": args.torch_threads, "kept_promote": not args.no_kept_promote,
             "cut": not args.no_cut, "readers": args.readers, "ahead": args.ahead,
             "no_verify": args.no_verify}, args.expert_dtype,
            args.floor_seconds)
    elif args.cmd == "accelerate-prep":
        accelerate_prep(args.folder, args.offload)
    elif args.cmd == "accelerate":
        accelerate_arm(args.folder, args.offload, args.tokens, args.prompt_len)
    else:
        reader(args.folder, args.inflight, args.seconds, args.expert_dtype)


if __name__ == "__main__":
    main()
