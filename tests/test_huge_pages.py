"""memory.huge_page_bytes: the CPU expert store's buffer, 2 MiB-aligned and advised to huge pages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from moespec.models.layout import ExpertLayout
from moespec.runtime.host.memory import HUGE_PAGE, huge_page_bytes
from moespec.runtime.host.store import ExpertStore


def _anon_huge_kib(addr: int) -> int | None:
    """AnonHugePages (KiB) of the mapping holding ``addr`` in /proc/self/smaps (None: not Linux)."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    inside = False
    for line in smaps.read_text().splitlines():
        if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


@pytest.mark.parametrize("nbytes", [0, 1, 4096 + 3, 3 * HUGE_PAGE + 17])
def test_huge_page_bytes_are_zeroed_aligned_and_exactly_sized(nbytes):
    t = huge_page_bytes(nbytes)
    assert t.dtype == torch.uint8 and t.numel() == nbytes
    if nbytes:
        assert t.data_ptr() % HUGE_PAGE == 0 and int(t.sum()) == 0
        t.fill_(7)
        assert int(t.sum()) == 7 * nbytes


def test_huge_page_bytes_get_huge_pages_where_the_kernel_gives_them():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("no transparent huge pages on this kernel")
    t = huge_page_bytes(8 * HUGE_PAGE)
    t.fill_(1)  # touched: the faults allocate the pages
    kib = _anon_huge_kib(t.data_ptr())
    if kib is None:
        pytest.skip("no /proc/self/smaps")
    assert kib >= 4 * HUGE_PAGE // 1024  # most of it (the kernel may split a page under memory pressure)


def test_a_cpu_store_lives_in_huge_page_memory_and_keeps_its_rows():
    layout = ExpertLayout(hidden=64, intermediate=32)
    store = ExpertStore([0, 1], 3, layout, torch.float32)
    assert store.buffer.data_ptr() % HUGE_PAGE == 0 and store.buffer.shape == (2, 3, layout.numel)
    store.expert(1, 2).fill_(2.5)
    assert float(store.buffer.sum()) == 2.5 * layout.numel
