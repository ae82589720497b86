"""What checking the quantised store's data costs: QuantStoreCache.load_into with its checks (XXH3-128
of every block of rows as it is copied in; finite scales) against the same copy loop without them,
and the same loop hashing inline (equal to load_into: a check that the script times what it means to).

Interleaved on the default model's cached int4 store (build it first with `moespec chat --expert-dtype
int4 --prompt hi`): each round runs the three once, in an order that rotates from round to round, so
no variant always runs first. Also times the checks alone (hash + scales over the loaded store) and
the whole model load (load_offloaded with the int4 store from the cache). Prints the medians and
ratios, and one JSON line. Run it under the exclusive CPU lock for numbers worth quoting.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from moespec.integrity import new_hasher, tensor_header, update
from moespec.models.registry import adapter_for
from moespec.paths import DEFAULT_MODEL_FOLDER, models_dir
from moespec.runtime.host.checkpoint import WINDOW_BYTES, MappingWindow, safetensors_files
from moespec.runtime.host.quant_store import TENSOR, QuantStoreCache, _scales_finite
from moespec.runtime.host.store import ExpertStore


def copy_loop(cache: QuantStoreCache, store: ExpertStore, hash_inline: bool) -> None:
    """load_into's copy loop, hashing each block as load_into does, or not at all (the reference:
    what loading cost before the checks)."""
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


def checks_alone(store: ExpertStore) -> None:
    """What load_into does beyond the copy: hash the rows in file order, check the scales."""
    buf = store.buffer
    hasher = new_hasher()
    tensor_header(hasher, TENSOR, buf.dtype, buf.shape)
    for m in range(buf.shape[0]):
        update(hasher, buf[m])
    hasher.hexdigest()
    assert _scales_finite(store)


def _ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


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


def main(rounds: int = 21) -> None:
    from transformers import AutoConfig

    path = models_dir() / DEFAULT_MODEL_FOLDER
    config = AutoConfig.from_pretrained(path)
    adapter = adapter_for(config)
    layout = adapter.layout(torch.float32, "int4", None)
    store = ExpertStore(list(range(config.num_hidden_layers)), adapter.num_experts(), layout, torch.float32,
                        pin=False, device=torch.device("cpu"))
    cache = QuantStoreCache.for_store(path, safetensors_files(path), store)
    assert cache.load_into(store), f"no valid cached store at {cache.path}"
    variants = {"load_into": lambda: cache.load_into(store), "inline": lambda: copy_loop(cache, store, True),
                "unchecked": lambda: copy_loop(cache, store, False)}
    names = list(variants)
    ms: dict[str, list[float]] = {n: [] for n in names}
    checks = []
    for i in range(rounds):
        for n in names[i % 3:] + names[: i % 3]:
            ms[n].append(_ms(variants[n]))
        checks.append(_ms(lambda: checks_alone(store)))
    med = {n: statistics.median(v) for n, v in ms.items()}
    ratio = {n: statistics.median([a / b for a, b in zip(ms[n], ms["unchecked"])]) for n in ("load_into", "inline")}
    out = {"store_bytes": store.buffer.numel(), "rounds": rounds, "ms_median": med, "ratio_median": ratio,
           "load_into_ratio_range": [min(a / b for a, b in zip(ms["load_into"], ms["unchecked"])),
                                     max(a / b for a, b in zip(ms["load_into"], ms["unchecked"]))],
           "checks_alone_ms_median": statistics.median(checks), "model_load_ms_median": _model_load_ms(path)}
    print(f"store {out['store_bytes'] / 1e6:.1f} MB, median of {rounds} rounds: unchecked copy "
          f"{med['unchecked']:.1f} ms ({out['store_bytes'] / med['unchecked'] / 1e6:.2f} GB/s); load_into {med['load_into']:.1f} ms, ratio "
          f"{ratio['load_into']:.3f}; hashing inline {med['inline']:.1f} ms, ratio {ratio['inline']:.3f}; "
          f"the checks alone {out['checks_alone_ms_median']:.1f} ms; the whole model load "
          f"{out['model_load_ms_median']:.0f} ms")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
