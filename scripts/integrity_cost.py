"""What checking the quantised store's data costs: QuantStoreCache.load_into with its checks against
the same read without them, and against the loop it replaced (before and after, in one run).

Variants, on the default model's cached int4 store (build it first with `moespec chat --expert-dtype
int4 --prompt hi`):
  load_into      the checked load: readinto chunks, then XXH3-128 + finite scales on a second thread
  start          what of it is on the model load's path: start_load until the last chunk is read
                 (load_offloaded joins the check after the dense weights; its wait is not timed)
  interleaved    start_load(interleave=True), the previous way: each chunk handed to the second
                 thread as soon as it is read, hashed while the next is read (its wait not timed)
  inline         the same checks inline after each chunk's read (one thread)
  unchecked      the same readinto loop, no checks (what loading costs without them)
  old_load_into  the earlier checked load: safetensors slices through a mapping, hashed after each block
  old_unchecked  that loop without the hash (what loading cost before the checks existed)
Each round runs every variant once, in an order that rotates from round to round, so no variant
always runs first; ratios are medians of the per-round ratios. ``--cold`` evicts the file from the
page cache before every run (posix_fadvise DONTNEED of that one file): the read from disk. Also
times the whole model load (load_offloaded with the int4 store from the cache), with the checks
with the interleaved checks, and with start_load swapped for the unchecked read, interleaved. Prints the medians
and ratios, and one JSON line. Run it under the exclusive CPU lock for numbers worth quoting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from moespec.integrity import new_hasher, read_hashed, tensor_header, update
from moespec.models.registry import adapter_for
from moespec.paths import DEFAULT_MODEL_FOLDER, models_dir
from moespec.runtime.host.checkpoint import WINDOW_BYTES, MappingWindow
from moespec.runtime.host.quant_store import TENSOR, QuantStoreCache, _scales_finite
from moespec.runtime.host.source import SafetensorsSource
from moespec.runtime.host.store import ExpertStore


def old_loop(cache: QuantStoreCache, store: ExpertStore, hash_inline: bool) -> None:
    """The earlier load_into's copy loop (16 MiB blocks of safetensors slices through a mapping),
    hashing each block after its copy as it did, or not at all (what loading cost before the checks)."""
    buf = store.buffer
    hasher = new_hasher()
    tensor_header(hasher, TENSOR, buf.dtype, buf.shape)
    step = max(1, WINDOW_BYTES // buf.shape[2])
    with MappingWindow(cache.path) as window:
        for m in range(buf.shape[0]):
            for e in range(0, buf.shape[1], step):
                block = buf[m, e: e + step]
                block.copy_(window.handle().get_slice(TENSOR)[m, e: e + block.shape[0]])
                window.count(block.numel())
                if hash_inline:
                    update(hasher, block)
    if hash_inline:
        hasher.hexdigest()
        assert _scales_finite(store)


def unchecked(cache: QuantStoreCache, store: ExpertStore) -> None:
    """load_into's read (readinto in the same chunks) without the hash and the scales check."""
    offset, _ = cache._data_range(store.buffer)
    with open(cache.path, "rb", buffering=0) as fh:
        assert read_hashed(fh, offset, store.buffer.view(-1).numpy(), None)


def _evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _Unchecked:
    """start_load's stand-in for the model load without checks: the same read, nothing verified."""

    def __init__(self, cache: QuantStoreCache, store: ExpertStore) -> None:
        unchecked(cache, store)

    @staticmethod
    def start(cache: QuantStoreCache, store: ExpertStore) -> _Unchecked:
        return _Unchecked(cache, store)

    def wait(self) -> bool:
        return True


def _model_load_ms(path, rounds: int = 6) -> dict[str, float]:
    """Median ms of load_offloaded of the default model with its int4 store read from the cache,
    checked and unchecked, interleaved; and the median of the per-round ratios."""
    from moespec.config import RuntimeConfig
    from moespec.runtime.load import load_offloaded

    checked_start = QuantStoreCache.start_load
    starts = {"checked": checked_start, "interleaved": lambda c, s: checked_start(c, s, interleave=True),
              "unchecked": _Unchecked.start}
    times: dict[str, list[float]] = {name: [] for name in starts}
    try:
        for i in range(rounds):
            names = list(starts)
            for name in names[i % 3:] + names[:i % 3]:
                QuantStoreCache.start_load = starts[name]
                t = time.perf_counter()
                om = load_offloaded(path, RuntimeConfig(expert_dtype="int4", predictor="none"))
                times[name].append((time.perf_counter() - t) * 1e3)
                om.close()
    finally:
        QuantStoreCache.start_load = checked_start
    out = {k: statistics.median(v) for k, v in times.items()}
    out["ratio"] = statistics.median([a / b for a, b in zip(times["checked"], times["unchecked"])])
    out["ratio_interleaved"] = statistics.median([a / b for a, b in zip(times["interleaved"], times["unchecked"])])
    return out


def main(rounds: int, cold: bool) -> None:
    from transformers import AutoConfig

    path = models_dir() / DEFAULT_MODEL_FOLDER
    config = AutoConfig.from_pretrained(path)
    adapter = adapter_for(config)
    layout = adapter.layout(torch.float32, "int4", None)
    store = ExpertStore(list(range(config.num_hidden_layers)), adapter.num_experts(), layout, torch.float32,
                        pin=False, device=torch.device("cpu"))
    cache = QuantStoreCache.for_store(path, SafetensorsSource(path).fingerprint, store)
    assert cache.load_into(store), f"no valid cached store at {cache.path}"
    variants = {"load_into": lambda: cache.load_into(store), "start": lambda: cache.start_load(store),
                "interleaved": lambda: cache.start_load(store, interleave=True),
                "inline": lambda: cache.load_into(store, overlap=False),
                "unchecked": lambda: unchecked(cache, store), "old_load_into": lambda: old_loop(cache, store, True),
                "old_unchecked": lambda: old_loop(cache, store, False)}
    names = list(variants)
    before = (lambda: _evict(cache.path)) if cold else None
    ms: dict[str, list[float]] = {n: [] for n in names}
    for i in range(rounds):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            if before is not None:
                before()
            t = time.perf_counter()
            result = variants[n]()
            ms[n].append((time.perf_counter() - t) * 1e3)
            if n in ("start", "interleaved"):
                assert result is not None and result.wait()  # joined outside the timing
    assert cache.load_into(store)
    med = {n: statistics.median(v) for n, v in ms.items()}

    def ratio(a: str, b: str) -> float:
        return statistics.median([x / y for x, y in zip(ms[a], ms[b])])

    pairs = [("load_into", "unchecked"), ("start", "unchecked"), ("interleaved", "unchecked"), ("inline", "unchecked"),
             ("start", "interleaved"), ("load_into", "old_unchecked"),
             ("old_load_into", "old_unchecked"), ("load_into", "old_load_into")]
    ratios = {f"{a}/{b}": ratio(a, b) for a, b in pairs}
    out = {"store_bytes": store.buffer.numel(), "rounds": rounds, "cold": cold, "ms_median": med,
           "ratio_median": ratios, "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    if not cold:
        out["model_load_ms"] = _model_load_ms(path)
    gb = out["store_bytes"] / 1e6
    print(f"store {gb:.1f} MB, {'from disk' if cold else 'page cache'}, median of {rounds} rounds:")
    for n in names:
        print(f"  {n:14} {med[n]:7.1f} ms  {gb / med[n]:5.2f} GB/s")
    for k, v in ratios.items():
        print(f"  {k:28} {v:.3f}")
    if "model_load_ms" in out:
        load = out["model_load_ms"]
        print(f"  the whole model load: checked {load['checked']:.0f} ms, interleaved {load['interleaved']:.0f} ms, "
              f"unchecked {load['unchecked']:.0f} ms; checked/unchecked {load['ratio']:.3f}, "
              f"interleaved/unchecked {load['ratio_interleaved']:.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--cold", action="store_true", help="evict the file before every run (read from disk)")
    args = ap.parse_args()
    main(args.rounds, args.cold)
