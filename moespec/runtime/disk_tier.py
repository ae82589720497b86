"""The disk tier in the loader: when experts stay on disk, how many rows the RAM tier holds, the store file.

On CPU the RAM tier IS the device cache (one tier fewer): the ExpertCache's slots are RAM rows
filled from the store file by the disk reader (transfer/disk.py), so the cache's eviction rules
(``--cache-policy``), its prefetch rule (a prefetch never evicts what would have hit) and the
router predictor's layer l+1 prefetch drive the disk reads unchanged.

When: ``--host-memory SIZE`` is given, or the experts (+ the dense part on CPU) do not fit in the
available RAM (at most what the process's memory cgroup allows: host/cgroup.py); then the RAM tier
is by default what fits beside the dense part with a margin left free (host/memory.headroom_bytes:
512 MiB, hub.sizes, or a tenth of a cgroup's limit when that is less). Only on CPU for now (a CUDA device keeps the
host store; the pinned RAM tier between disk and device is not built yet).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from moespec.config import Predictor, RuntimeConfig, format_binary
from moespec.errors import BudgetError, CheckpointError, OptionError
from moespec.models.base import ExpertLayout
from moespec.runtime.host.disk_store import DiskStore, check_on_miss, store_path
from moespec.runtime.host.memory import available_bytes, headroom_bytes
from moespec.runtime.host.store import ExpertStore
from moespec.runtime.transfer.disk import DiskReadEngine


def wanted(cfg: RuntimeConfig, device: torch.device, host_bytes: int) -> bool:
    """True when the experts are read from disk: ``--host-memory`` given, or ``host_bytes`` (experts +
    dense on CPU) do not fit in the available RAM, on CPU.

    Raises:
        OptionError: ``--host-memory`` with a CUDA device (not built yet).
    """
    if device.type != "cpu":
        if cfg.host_memory_bytes is not None:
            raise OptionError("--host-memory (experts on disk) runs on the CPU only so far",
                              "use --device cpu, or leave out --host-memory")
        return False
    return cfg.host_memory_bytes is not None or host_bytes + headroom_bytes() > available_bytes()


def ram_slots(cfg: RuntimeConfig, top_k: int, total_experts: int, stride: int, dense_bytes: int) -> int:
    """Rows the RAM tier holds: ``--host-memory`` // the row stride (default: the available RAM less the
    dense part and the margin), at most every expert, and at most ``--cache-experts`` when given.

    Raises:
        BudgetError: below the minimum (K rows for the running layer, + K for prefetch when predicting),
            naming the minimum in MiB and a --host-memory value that works.
        OptionError: --on-miss other than fetch (a host-computed miss needs its row in RAM already).
    """
    check_on_miss(cfg.on_miss)
    need = top_k * (1 if cfg.predictor == Predictor.NONE else 2)
    if cfg.host_memory_bytes is not None:
        have, asked = cfg.host_memory_bytes, f"--host-memory {format_binary(cfg.host_memory_bytes)}"
    else:
        have = available_bytes() - dense_bytes - headroom_bytes()
        asked = f"the available RAM ({format_binary(max(have, 0))} beside the dense part)"
    slots = max(have, 0) // stride
    if slots < need:
        mib = -(-need * stride // 2**20)
        raise BudgetError(f"{asked} is below the minimum of {mib} MiB ({need} expert rows of "
                          f"{format_binary(stride)})", f"use --host-memory {mib}MiB or more")
    if cfg.cache_experts is not None:
        slots = min(slots, max(cfg.cache_experts, need))
    return min(slots, total_experts)


def store_meta(source, layout: ExpertLayout, dtype: torch.dtype, moe_layers: list[int], num_experts: int) -> dict:
    """What a store file must carry to be used: the row format and the checkpoint's fingerprint."""
    import json

    settings = {k: getattr(layout, k) for k in ("bits", "group_size") if hasattr(layout, k)}
    meta = {"layout": type(layout).__name__, "row_numel": layout.numel, "dtype": str(layout.storage_dtype(dtype)),
            "layers_numel": [layout.for_layer(i).numel for i in moe_layers], **settings,
            "checkpoint": source.fingerprint()}
    return json.loads(json.dumps(meta))


def format_name(layout: ExpertLayout, dtype: torch.dtype) -> str:
    """The file name's format part: the storage dtype, with the quantisation settings (int4-g64)."""
    if hasattr(layout, "bits") and hasattr(layout, "group_size"):
        return f"int{layout.bits}-g{layout.group_size}"
    return f"{type(layout).__name__.lower()}-{str(layout.storage_dtype(dtype)).removeprefix('torch.')}"


def open_store(folder: Path, source, layout: ExpertLayout, dtype: torch.dtype, moe_layers: list[int],
               num_experts: int, fill: Callable[[ExpertStore], None]) -> tuple[DiskStore, bool]:
    """The model's store file, written first when absent or stale; (store, written now).

    ``fill`` writes every expert row into the ExpertStore it gets (the loader reads the checkpoint).

    Raises:
        OutputError: the disk is full or the home unwritable while writing (one line; no partial file).
        CheckpointError: the checkpoint lacks expert tensors.
    """
    meta = store_meta(source, layout, dtype, moe_layers, num_experts)
    path = store_path(folder, format_name(layout, dtype))
    store = DiskStore.open(path, meta)
    if store is not None:
        return store.bind(layout, dtype), False
    header = DiskStore.header_for(meta, moe_layers, num_experts, layout, dtype)
    return DiskStore.write(path, header, layout, dtype, fill).bind(layout, dtype), True


def fill_experts(source, adapter, device: torch.device, dtype: torch.dtype) -> Callable[[ExpertStore], None]:
    """What writes the store file's rows: every expert tensor of ``source`` into the store (dense ones skipped).

    Raises (when called): CheckpointError naming the expert tensors the checkpoint lacks.
    """
    def fill(store: ExpertStore) -> None:
        for key, target, tensor, _where, _mapped in source.tensors(adapter, store.layout, device, dtype, True):
            if key is not None:
                store.write(key.layer, key.expert, key.part, tensor, target)
        gaps = store.missing()
        if gaps:
            raise CheckpointError(f"the checkpoint lacks {len(gaps)} expert tensor(s), e.g. {', '.join(gaps[:3])}",
                                  "the download is incomplete or the config does not match the weights")

    return fill


def make_engine(store: DiskStore, readers: int | None = None) -> DiskReadEngine:
    """The disk reader of ``store``'s file (readers: reads in flight; None = the default)."""
    kw = {} if readers is None else {"readers": readers}
    return DiskReadEngine(store.path, store.forget, **kw)


def disk_numbers(summary, cache) -> dict | None:
    """The disk tier's numbers beside ``summary`` (runtime.stats.Summary of the last answer), or None when
    ``cache``'s rows come from RAM. On CPU the RAM tier is the cache, so its hits are the RAM tier's
    hits, its copy bytes and stall are the disk's; GB/s is the reader's since the model loaded (bytes
    read / seconds with at least one read running)."""
    engine = cache.engine
    if not isinstance(engine, DiskReadEngine):
        return None
    busy = engine.busy_seconds()
    return {"disk_mb_per_token": summary.h2d_mb_per_token, "ram_tier_hit_rate": summary.hit_rate,
            "disk_stall_ms_per_token": summary.stall_ms_per_token,
            "disk_read_gbps": engine.bytes_moved / busy / 1e9 if busy > 0 else None,
            "disk_reads": engine.reads, "o_direct": engine.direct, "ram_tier_rows": cache.num_slots}
