"""Without the native CPU kernels (no AVX2, no compiler, a failed build, MOESPEC_CPU_KERNELS=0) the
reference path runs and native.status() says why in one line. These run everywhere, also where
tests/test_kernels.py is skipped because the kernels cannot be built."""

from __future__ import annotations

import pytest
import torch

from moespec.kernels import linear as L
from moespec.kernels import native
from moespec.kernels.lowbit import LowBitWeight, groups_per_row, pack_codes


def test_without_native_kernels_everything_takes_the_reference(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    gen = torch.Generator().manual_seed(0)
    n = groups_per_row(64, 64)
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8, generator=gen)
    w = LowBitWeight(4, 8, 64, 64, pack_codes(codes, 4), (torch.rand(8 * n, generator=gen) * 0.02).half(),
                     torch.randint(0, 16, (8 * n,), dtype=torch.uint8, generator=gen))
    x = torch.randn(1, 64, generator=gen)
    assert L.plan(x, w) == "gemm"
    assert torch.equal(L.linear(x, w), L.linear_reference(x, w))


@pytest.mark.parametrize("env,flags,match", [
    ({"MOESPEC_CPU_KERNELS": "0"}, None, "MOESPEC_CPU_KERNELS=0"),
    ({}, {"sse4_2", "avx"}, "this CPU lacks AVX2/FMA/F16C"),
    ({"CC": "/nonexistent/cc"}, set(native.NEEDED), "no C compiler (/nonexistent/cc)"),
    ({"CC": "false"}, set(native.NEEDED), "building the CPU kernels failed"),  # a compiler that fails
])
def test_status_says_why_there_are_no_kernels_in_one_line(monkeypatch, env, flags, match):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if flags is not None:
        monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    native.status.cache_clear()
    try:
        got = native.status()
        assert got.lib is None and match in got.note and "\n" not in got.note
        assert got.note.endswith("use the reference path (dequantise, then matmul)")
    finally:
        native.status.cache_clear()
