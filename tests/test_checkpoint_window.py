"""Reading a checkpoint keeps at most a window of its file mapping resident (what `ps` counts as RSS).

safetensors' tensors view the file mapping; pages read stay resident while the mapping lives. The
resident bytes of one file's mappings are read from /proc/self/smaps (Linux), so these tests
measure the bound itself rather than count calls.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moespec.config import RuntimeConfig
from moespec.runtime.host.checkpoint import iter_tensors
from moespec.runtime.load import load_offloaded

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")

MB = 2**20


def mapped_resident_bytes(path: Path) -> int:
    """Resident bytes of every mapping of ``path`` in this process (sum of smaps Rss)."""
    total, inside, want = 0, False, str(Path(path).resolve())
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's header
            inside = len(head) >= 6 and head[5] == want
        elif inside and head and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({f"t{i:02d}": torch.full((256, 1024), float(i)) for i in range(16)}, str(path))  # 16 x 1 MiB
    return path


def _peak_while_reading(path: Path, window_bytes: int) -> tuple[int, int]:
    peak, total = 0, 0.0
    for _, tensor, _ in iter_tensors([path], window_bytes=window_bytes):
        total += float(tensor.sum())  # touches every page of the tensor
        peak = max(peak, mapped_resident_bytes(path))
    return peak, total


def test_reading_keeps_no_more_than_the_window_resident(shard):
    peak, total = _peak_while_reading(shard, window_bytes=2 * MB)
    assert total == sum(range(16)) * 256 * 1024
    # the window, the tensor that opens the next one, and fault-around pages at the edges
    assert 0 < peak <= 3 * MB + 256 * 1024
    assert mapped_resident_bytes(shard) == 0  # nothing left mapped afterwards


def test_without_a_window_the_whole_file_stays_resident(shard):
    """The measurement sees what the window prevents: one mapping for the file keeps all 16 MiB."""
    peak, _ = _peak_while_reading(shard, window_bytes=1 << 40)
    assert peak >= 15 * MB


@pytest.mark.parametrize("expert_dtype", ["auto", "int4"])
def test_loaded_model_keeps_no_page_of_the_checkpoint_mapped(tiny_models, tmp_path, monkeypatch, expert_dtype):
    """Dense weights on the CPU are copies, not views of the checkpoint mapping."""
    monkeypatch.setenv("MOESPEC_HOME", str(tmp_path / "home"))
    folder = tiny_models["qwen3_moe"]
    om = load_offloaded(folder, RuntimeConfig(cache_experts=4, predictor="none", expert_dtype=expert_dtype))
    try:
        for f in sorted(Path(folder).glob("*.safetensors")):
            assert mapped_resident_bytes(f) == 0
            assert str(f.resolve()) not in open("/proc/self/maps").read()
    finally:
        om.close()


def test_second_start_keeps_no_page_of_the_cached_store_mapped(tiny_models, tmp_path, monkeypatch):
    """The cached quantised store is read through the same window: it leaves nothing mapped."""
    from moespec.runtime.host.quant_store import cache_path

    monkeypatch.setenv("MOESPEC_HOME", str(tmp_path / "home"))
    cfg = RuntimeConfig(cache_experts=4, predictor="none", expert_dtype="int4")
    load_offloaded(tiny_models["qwen3_moe"], cfg).close()  # quantises and writes the store
    import moespec.models.quant_layout as quant_layout

    monkeypatch.setattr(quant_layout, "quantize", None)  # the second start must read the store
    om = load_offloaded(tiny_models["qwen3_moe"], cfg)
    try:
        saved = cache_path(Path(tiny_models["qwen3_moe"]), om.store.layout)
        assert saved.is_file()
        assert str(saved.resolve()) not in open("/proc/self/maps").read()
    finally:
        om.close()
