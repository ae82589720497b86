"""Each of moespec's file writers, runnable alone: in a subprocess that a test SIGKILLs, then in-process.

``python tests/writers.py WRITER TARGET MOMENT MB`` writes TARGET with WRITER (a name in WRITERS)
and, at MOMENT, stops to be killed:
  locked   right after the temp folder is made and locked (nothing written yet)
  writing  never stops: the data is MB megabytes, so the test can kill it while safetensors writes
  written  the temp file is complete and synced, the rename onto TARGET has not happened
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

E, H = 4, 8


def calibration(target: Path, mb: float = 0) -> None:
    from moespec.predict.calibration_file import Calibration, save_calibration

    m = max(1, int(mb * 2**20 / (E * H * 4)))  # default-vector rows that make the file about mb large
    calib = Calibration(layers=list(range(m)), default_vectors={"mean": torch.randn(m, E, H)}, variant="mean",
                        frequencies=torch.ones(m, E, dtype=torch.int64), unrouted=torch.zeros(m, dtype=torch.int64),
                        metrics={"recall/router": torch.full((m,), math.nan)}, meta={"model": "tiny"})
    save_calibration(target, calib)


def estimator(target: Path, mb: float = 0) -> None:
    from moespec.predict.estimator_file import EstimatorFile, save_estimator
    from moespec.predict.estimator_net import EstimatorBank, EstimatorShape

    torch.manual_seed(0)
    bank = EstimatorBank(EstimatorShape(32, E, down=2, expand=2, shared=False), [0, 1])
    s = max(2, int(mb * 2**20 / (E * 32 * 4)))
    save_estimator(target, EstimatorFile(bank=bank.eval(), moe_layers=[0, 1, 2], input="quasi",
                                         vectors=torch.randn(s, E, 32), choice={0: "estimator"},
                                         metrics={"recall/router": torch.tensor([0.3, 0.9, math.nan])},
                                         meta={"model": "tiny"}))


class _Store:
    """What QuantStoreCache.save reads of an ExpertStore: its buffer [M, E, P] uint8."""

    def __init__(self, mb: float) -> None:
        shape = (2, E, max(64, int(mb * 2**20 / (2 * E))))
        self.buffer = torch.randint(0, 255, shape, dtype=torch.uint8) if mb < 1 else torch.ones(shape, dtype=torch.uint8)


def quant_store(target: Path, mb: float = 0) -> None:
    from moespec.runtime.host.quant_store import QuantStoreCache

    note = QuantStoreCache(target, {"format": 0}).save(_Store(mb))
    assert note is None, note


def disk_store(target: Path, mb: float = 0) -> None:
    """The disk tier's store file (moespec.runtime.host.disk_store): fallocated, filled through its
    mapping, then its header and row checksums, then renamed."""
    from moespec.models.base import ExpertLayout
    from moespec.runtime.host.disk_store import DiskStore

    layout = ExpertLayout(hidden=32, intermediate=16)  # 6 KiB of float32 a row, an 8 KiB stride
    experts = max(2, int(mb * 2**20 / 8192))
    header = DiskStore.header_for({"m": experts}, [0], experts, layout, torch.float32)

    def fill(store) -> None:
        store.buffer.copy_(torch.arange(store.buffer.numel(), dtype=torch.float32).view_as(store.buffer))

    DiskStore.write(target, header, layout, torch.float32, fill)


def states_shard(target: Path, mb: float = 0) -> None:
    from moespec.estimator.states import ShardWriter

    rows = max(4, int(mb * 2**20 / (H * 2)))
    writer = ShardWriter(target.parent, target.name.split("-")[0])
    writer.add({"state/0": torch.randn(rows, H).to(torch.bfloat16), "logits/0": torch.randn(rows, E)})
    writer.flush()


def build_checkpoint(target: Path, mb: float = 0) -> None:
    from moespec.default_model.checkpoints import LayerCheckpoints
    from moespec.default_model.convert import LayerFits, LayerReport

    state = LayerCheckpoints(target.parent, "digest")
    if not (target.parent / "state.json").is_file():
        state.open()
    n = max(16, int(mb * 2**20 / 4))
    fits = LayerFits(shared=torch.zeros(2), experts=torch.zeros(2), router=torch.zeros(2), recall=1.0)
    report = LayerReport(layer=0, recall=1.0, rel_err=0.0, random_rel_err=0.0, shared_only_rel_err=0.0, seconds=0.0)
    state.save(0, {"gate.weight": torch.randn(n)}, report, fits, torch.randn(4, 4))


def dense_cache(target: Path, mb: float = 0) -> None:
    """A GGUF's dense cache (moespec.gguf.dense_cache): written while tensors stream, not in one call."""
    from moespec.gguf.dense_cache import DenseCacheWriter

    n = max(16, int(mb * 2**20 / 4 / 2))
    specs = [("a", torch.float32, (n,)), ("b", torch.float32, (n,))]
    writer = DenseCacheWriter(target, specs, torch.float32, [["m.gguf", 1, 2]])
    for name, dt, shape in specs:
        writer.write(name, torch.ones(shape, dtype=dt))
    writer.finish()
    assert writer.note is None, writer.note


def text(target: Path, mb: float = 0) -> None:
    from moespec.fsutil import atomic_write_text

    atomic_write_text(target, json.dumps({"x": "y" * int(mb * 2**20)}))


# writer -> the target's file name (the folder is the test's)
WRITERS = {
    "calibration": (calibration, "model.safetensors"),
    "estimator": (estimator, "model.safetensors"),
    "quant_store": (quant_store, "int4-g64.safetensors"),
    "disk_store": (disk_store, "rows-float32.moerows"),
    "states_shard": (states_shard, "train-00000.safetensors"),
    "build_checkpoint": (build_checkpoint, "layer-00.safetensors"),
    "text": (text, "manifest.json"),
    "dense_cache": (dense_cache, "dense-float32.safetensors"),
}


def _stop_forever(*args, **kwargs):
    print("STOPPED", flush=True)
    time.sleep(600)


def main(writer: str, target: str, moment: str, mb: str) -> None:
    import os

    from moespec import tempfiles

    if moment == "locked":
        real = tempfiles.lock_fd

        def lock_then_stop(path):
            fd = real(path)
            _stop_forever()
            return fd

        tempfiles.lock_fd = lock_then_stop
    elif moment == "written":
        os.replace = _stop_forever  # fsutil calls os.replace(temp, target) last
    WRITERS[writer][0](Path(target), float(mb))


if __name__ == "__main__":
    main(*sys.argv[1:])
