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


def test_a_damaged_or_unverified_library_is_compiled_again(tmp_path):
    """The .so's bytes are checked against the XXH3-128 written beside it before it is used: a flipped
    byte, or a missing checksum (a kill between the two writes), means a new build; an intact one is reused."""
    log = tmp_path / "builds.log"
    cc = tmp_path / "fake-cc"
    cc.write_text("#!/bin/sh\n"
                  "if [ \"$1\" = --version ]; then echo fake-cc 1.0; exit 0; fi\n"
                  "while [ $# -gt 0 ]; do [ \"$1\" = -o ] && out=$2; shift; done\n"
                  f"echo build >> {log}\nprintf 'a library of some bytes' > \"$out\"\n")
    cc.chmod(0o755)
    out = tmp_path / "kernels"

    def builds() -> int:
        return len(log.read_text().splitlines()) if log.exists() else 0

    lib = native._build(out, str(cc))
    mark = lib.with_name(lib.name + ".xxh3")
    good = lib.read_bytes()
    assert builds() == 1 and mark.is_file() and sorted(p.name for p in out.iterdir()) == [lib.name, mark.name]
    assert native._build(out, str(cc)) == lib and builds() == 1  # intact: reused
    lib.write_bytes(bytes([good[0] ^ 1]) + good[1:])
    assert native._build(out, str(cc)) == lib and builds() == 2 and lib.read_bytes() == good
    mark.unlink()
    assert native._build(out, str(cc)) == lib and builds() == 3 and mark.is_file()
    assert sorted(p.name for p in out.iterdir()) == [lib.name, mark.name]  # no temp left
