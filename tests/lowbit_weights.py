"""Random group-wise low-bit weights for the kernel tests (test_kernels, test_thread_plan)."""

from __future__ import annotations

import torch

from moespec.kernels.lowbit import LowBitWeight, groups_per_row, pack_codes


def random_lowbit(bits: int, rows: int, cols: int, group: int, seed: int = 0) -> LowBitWeight:
    """A [rows, cols] int8/int4 weight: random codes, fp16 scales in [0.001, 0.021), random zeros."""
    gen = torch.Generator().manual_seed(seed)
    n = groups_per_row(cols, group)
    codes = torch.randint(0, 2**bits, (rows, cols), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(rows * n, generator=gen) * 0.02 + 0.001).half()
    zeros = torch.randint(0, 2**bits, (rows * n,), dtype=torch.uint8, generator=gen)
    return LowBitWeight(bits, rows, cols, group, pack_codes(codes, bits), scales, zeros)
