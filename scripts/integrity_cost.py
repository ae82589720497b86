"""What checking the quantised store's data costs: QuantStoreCache's checked read against the same
read without the checks, and the whole model load with and without them (in one run).

Run on the default model (built first by any command, e.g. `moespec chat --prompt hi`). A warm-up
load of the model with int4 experts builds (or verifies) its cached int4 store; the script then
writes a FRESH copy of that store with the current writer into a temp folder and times reads of
that copy (so a stale or older-format cache cannot skew the numbers):
  start      what of the checked read is on the model load's path: start_load until it returns
             (the rows read; the hash + scales check then run on a second thread, joined untimed)
  load_into  the whole checked read: start_load, then wait() for the check
  inline     the same checks inline after the read (one thread)
  unchecked  the same read (integrity.read_into), no checks: what loading costs without them
Every variant runs once untimed first (warm-up). Each round runs every variant once; the order is
reversed every 3 rounds so that no variant always runs first or last and order effects cancel.
Ratios are medians of the per-round ratios, with their range. ``--cold`` evicts the file from the
page cache before every run (posix_fadvise DONTNEED of that one file): the read from disk. Then
(not with --cold) the whole model load (load_offloaded with the int4 store from the cache) checked,
and with start_load swapped for the unchecked read, in the same reversed-every-3 order. Prints the
medians and ratios, and one JSON line last. Run it under the exclusive CPU lock (`cpulock ex`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from moespec.integrity import read_into
from moespec.paths import DEFAULT_MODEL_FOLDER, models_dir
from moespec.runtime.host.quant_store import QuantStoreCache
from moespec.runtime.host.source import SafetensorsSource
from moespec.runtime.host.store import ExpertStore


def unchecked(cache: QuantStoreCache, store: ExpertStore) -> None:
    """The checked read's read (integrity.read_into into the buffer) without the hash and the scales check."""
    offset, _ = cache._data_range(store.buffer)
    with open(cache.path, "rb", buffering=0) as fh:
        assert read_into(fh, offset, store.buffer.view(-1).numpy())


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def order(names: list[str], round_index: int) -> list[str]:
    """``names`` in round ``round_index``'s order: as given for 3 rounds, reversed for the next 3, ..."""
    return list(names) if (round_index // 3) % 2 == 0 else list(reversed(names))


def timed_rounds(variants: dict[str, Callable[[], object]], rounds: int, before: Callable[[], None] | None = None,
                 after: Callable[[str, object], None] | None = None) -> dict[str, list[float]]:
    """ms of each variant per round (one untimed warm-up run of each first), in :func:`order`."""
    names = list(variants)
    ms: dict[str, list[float]] = {n: [] for n in names}
    for i in range(-1, rounds):  # round -1: warm-up, not recorded
        for n in order(names, max(i, 0)):
            if before is not None:
                before()
            t = time.perf_counter()
            result = variants[n]()
            elapsed = (time.perf_counter() - t) * 1e3
            if after is not None:
                after(n, result)  # untimed (e.g. joining a background check)
            if i >= 0:
                ms[n].append(elapsed)
    return ms


def ratio(ms: dict[str, list[float]], a: str, b: str) -> dict[str, float]:
    """Median and range of the per-round ratios ms[a] / ms[b]."""
    r = [x / y for x, y in zip(ms[a], ms[b])]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


class _Unchecked:
    """start_load's stand-in for the model load without checks: the same read, nothing verified."""

    def __init__(self, cache: QuantStoreCache, store: ExpertStore) -> None:
        unchecked(cache, store)

    @staticmethod
    def start(cache: QuantStoreCache, store: ExpertStore) -> _Unchecked:
        return _Unchecked(cache, store)

    def wait(self) -> bool:
        return True


def model_load_ms(path: Path, rounds: int) -> dict:
    """load_offloaded of the default model with its int4 store read from the cache, checked and
    unchecked: per-arm medians (ms) and the per-round ratio."""
    from moespec.config import RuntimeConfig
    from moespec.runtime.load import load_offloaded

    checked_start = QuantStoreCache.start_load
    starts = {"checked": checked_start, "unchecked": _Unchecked.start}

    def load(name: str) -> Callable[[], None]:
        def run() -> None:
            QuantStoreCache.start_load = starts[name]
            try:
                load_offloaded(path, RuntimeConfig(expert_dtype="int4", predictor="none")).close()
            finally:
                QuantStoreCache.start_load = checked_start
        return run

    ms = timed_rounds({name: load(name) for name in starts}, rounds)
    return {"ms_median": {k: statistics.median(v) for k, v in ms.items()}, "ratio": ratio(ms, "checked", "unchecked"),
            "rounds": rounds}


def fresh_store(path: Path, folder: Path) -> tuple[QuantStoreCache, ExpertStore]:
    """A fresh copy of the default model's int4 store written into ``folder`` by the current writer,
    and an empty ExpertStore of its shape to read it into (after a warm-up load of the model)."""
    from moespec.config import RuntimeConfig
    from moespec.runtime.load import load_offloaded

    om = load_offloaded(path, RuntimeConfig(expert_dtype="int4", predictor="none"))  # builds the cache if needed
    try:
        loaded = om.store
        cache = QuantStoreCache.for_store(path, SafetensorsSource(path).fingerprint, loaded)
        fresh = dataclasses.replace(cache, path=folder / cache.path.name)
        assert fresh.save(loaded) is None, "could not write the fresh store"
        store = ExpertStore(loaded.moe_layers, loaded.num_experts, loaded.layout, om.dtype, pin=False,
                            device=torch.device("cpu"))
    finally:
        om.close()
    assert fresh.load_into(store), f"the fresh store at {fresh.path} does not verify"
    return fresh, store


def main(rounds: int, load_rounds: int, cold: bool) -> None:
    path = models_dir() / DEFAULT_MODEL_FOLDER
    with tempfile.TemporaryDirectory(prefix="moespec-integrity-cost-") as tmp:
        cache, store = fresh_store(path, Path(tmp))

        def joined(name: str, result) -> None:
            if name == "start":
                assert result is not None and result.wait()

        variants = {"start": lambda: cache.start_load(store), "load_into": lambda: cache.load_into(store),
                    "inline": lambda: cache.load_into(store, overlap=False),
                    "unchecked": lambda: unchecked(cache, store)}
        ms = timed_rounds(variants, rounds, (lambda: _evict(cache.path)) if cold else None, joined)
        assert cache.load_into(store)
    med = {n: statistics.median(v) for n, v in ms.items()}
    ratios = {f"{a}/{b}": ratio(ms, a, b) for a, b in
              [("start", "unchecked"), ("load_into", "unchecked"), ("inline", "unchecked")]}
    out = {"store_bytes": store.buffer.numel(), "rounds": rounds, "cold": cold, "ms_median": med,
           "ratio": ratios, "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    mb = out["store_bytes"] / 1e6
    print(f"int4 store {mb:.1f} MB, {'from disk' if cold else 'page cache'}, median of {rounds} rounds:")
    for n in variants:
        print(f"  {n:10} {med[n]:7.2f} ms  {mb / med[n]:5.2f} GB/s")
    for k, v in ratios.items():
        print(f"  {k:20} {v['median']:.3f} (rounds {v['min']:.2f}-{v['max']:.2f})")
    if not cold and load_rounds:
        load = out["model_load"] = model_load_ms(path, load_rounds)
        r = load["ratio"]
        print(f"  model load, median of {load_rounds}: checked {load['ms_median']['checked']:.0f} ms, "
              f"unchecked {load['ms_median']['unchecked']:.0f} ms")
        print(f"  checked/unchecked {r['median']:.3f} (rounds {r['min']:.2f}-{r['max']:.2f})")
    print(json.dumps(out))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21, help="rounds of the store reads")
    ap.add_argument("--load-rounds", type=int, default=12, help="rounds of the whole model load (0: skip)")
    ap.add_argument("--cold", action="store_true", help="evict the file before every run (read from disk)")
    args = ap.parse_args()
    main(args.rounds, args.load_rounds, args.cold)
