"""What checking the quantised store's data costs: QuantStoreCache.load_into with its checks (XXH3-128
of every row as it is copied in, finite scales) against the same copy loop without them.

Interleaved, one pair per round in alternating order (ABBA: neither side always runs first), on the
default model's cached int4 store (build it first with `moespec chat --expert-dtype int4 --prompt hi`).
Also times the checks alone (the XXH3-128 of the rows and the finite-scales check, over the loaded
store), which is what the checked load adds. Prints the medians and their ratio, and one JSON line.
Run it under the exclusive CPU lock for numbers worth quoting.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from moespec.models.registry import adapter_for
from moespec.paths import DEFAULT_MODEL_FOLDER, models_dir
from moespec.runtime.host.checkpoint import WINDOW_BYTES, MappingWindow, safetensors_files
from moespec.integrity import new_hasher, tensor_header, update
from moespec.runtime.host.quant_store import TENSOR, QuantStoreCache, _scales_finite
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


def checks_alone(store: ExpertStore) -> None:
    """What load_into does beyond the copy: hash the rows in file order, check the scales."""
    buf = store.buffer
    hasher = new_hasher()
    tensor_header(hasher, TENSOR, buf.dtype, buf.shape)
    for m in range(buf.shape[0]):
        update(hasher, buf[m])
    hasher.hexdigest()
    assert _scales_finite(store)


def _ms(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t) * 1e3


def main(rounds: int = 20) -> None:
    from transformers import AutoConfig

    path = models_dir() / DEFAULT_MODEL_FOLDER
    adapter = adapter_for(AutoConfig.from_pretrained(path))
    layout = adapter.layout(torch.float32, "int4", None)
    moe_layers = list(range(AutoConfig.from_pretrained(path).num_hidden_layers))
    store = ExpertStore(moe_layers, adapter.num_experts(), layout, torch.float32, pin=False, device=torch.device("cpu"))
    cache = QuantStoreCache.for_store(path, safetensors_files(path), store)
    assert cache.load_into(store), f"no valid cached store at {cache.path}"
    checked_ms, plain_ms, checks_ms = [], [], []
    for i in range(rounds):
        if i % 2 == 0:
            checked_ms.append(_ms(cache.load_into, store))
            plain_ms.append(_ms(unchecked, cache, store))
        else:
            plain_ms.append(_ms(unchecked, cache, store))
            checked_ms.append(_ms(cache.load_into, store))
        checks_ms.append(_ms(checks_alone, store))
    ratios = [c / p for c, p in zip(checked_ms, plain_ms)]
    out = {"store_bytes": store.buffer.numel(), "rounds": rounds, "checked_ms_median": statistics.median(checked_ms),
           "unchecked_ms_median": statistics.median(plain_ms), "ratio_median": statistics.median(ratios),
           "ratio_min": min(ratios), "ratio_max": max(ratios), "checks_alone_ms_median": statistics.median(checks_ms),
           "checks_alone_share": statistics.median(checks_ms) / statistics.median(plain_ms)}
    print(f"store {out['store_bytes'] / 1e6:.1f} MB: load_into {out['checked_ms_median']:.1f} ms with checks, "
          f"{out['unchecked_ms_median']:.1f} ms without; ratio {out['ratio_median']:.3f} "
          f"({out['ratio_min']:.3f}-{out['ratio_max']:.3f}); the checks alone {out['checks_alone_ms_median']:.1f} ms "
          f"({100 * out['checks_alone_share']:.1f} % of the unchecked load)")
    out["model_load_ms_median"] = _model_load_ms(path)
    print(f"the whole model load (load_offloaded, int4 store from the cache): {out['model_load_ms_median']:.0f} ms; "
          f"the checks are {100 * out['checks_alone_ms_median'] / out['model_load_ms_median']:.1f} % of it")
    print(json.dumps(out))


def _model_load_ms(path, rounds: int = 3) -> float:
    """Median ms of load_offloaded of the default model with its int4 store read from the cache."""
    from moespec.config import RuntimeConfig
    from moespec.runtime.load import load_offloaded

    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        om = load_offloaded(path, RuntimeConfig(expert_dtype="int4", predictor="none"))
        times.append((time.perf_counter() - t) * 1e3)
        om.close()
    return statistics.median(times)


if __name__ == "__main__":
    main()
