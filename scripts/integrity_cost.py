"""What checking the quantised store's data costs: QuantStoreCache.load_into with its checks (XXH3-128
of every row as it is copied in, finite scales) against the same copy loop without them.

Interleaved, one pair per round, on the default model's cached int4 store (build it first with
`moespec chat --expert-dtype int4 --prompt hi`). Prints the median ms of each and their ratio, and
one JSON line. Run it under the exclusive CPU lock for numbers worth quoting.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from moespec.models.registry import adapter_for
from moespec.paths import DEFAULT_MODEL_FOLDER, models_dir
from moespec.runtime.host.checkpoint import WINDOW_BYTES, MappingWindow, safetensors_files
from moespec.runtime.host.quant_store import TENSOR, QuantStoreCache
from moespec.runtime.host.store import ExpertStore


def unchecked(cache: QuantStoreCache, store: ExpertStore) -> None:
    """load_into's copy loop alone (the reference: what loading cost before the checks)."""
    buf = store.buffer
    step = max(1, WINDOW_BYTES // buf.shape[2])
    with MappingWindow(cache.path) as window:
        for m in range(buf.shape[0]):
            for e in range(0, buf.shape[1], step):
                block = buf[m, e: e + step]
                block.copy_(window.handle().get_slice(TENSOR)[m, e: e + block.shape[0]])
                window.count(block.numel())


def main(rounds: int = 15) -> None:
    from transformers import AutoConfig

    path = models_dir() / DEFAULT_MODEL_FOLDER
    adapter = adapter_for(AutoConfig.from_pretrained(path))
    layout = adapter.layout(torch.float32, "int4", None)
    moe_layers = list(range(AutoConfig.from_pretrained(path).num_hidden_layers))
    store = ExpertStore(moe_layers, adapter.num_experts(), layout, torch.float32, pin=False, device=torch.device("cpu"))
    cache = QuantStoreCache.for_store(path, safetensors_files(path), store)
    assert cache.load_into(store), f"no valid cached store at {cache.path}"
    checked_ms, plain_ms = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        assert cache.load_into(store)
        checked_ms.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        unchecked(cache, store)
        plain_ms.append((time.perf_counter() - t) * 1e3)
    ratios = [c / p for c, p in zip(checked_ms, plain_ms)]
    out = {"store_bytes": store.buffer.numel(), "rounds": rounds, "checked_ms_median": statistics.median(checked_ms),
           "unchecked_ms_median": statistics.median(plain_ms), "ratio_median": statistics.median(ratios),
           "ratio_min": min(ratios), "ratio_max": max(ratios)}
    print(f"store {out['store_bytes'] / 1e6:.1f} MB: load_into {out['checked_ms_median']:.1f} ms with checks, "
          f"{out['unchecked_ms_median']:.1f} ms without; ratio {out['ratio_median']:.3f} "
          f"({out['ratio_min']:.3f}-{out['ratio_max']:.3f})")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
