"""The AVX-512 kernels (csrc/avx512.c) against the slow reference and against the AVX2 kernels.

Tolerances (relative to the largest output): float32 activations 2e-6 (the same exact products,
another order of the float32 sum; int4 rows at one token: activations as 24-bit integers per group,
within 2**-24 of each group's largest |x|, then integer dots); bfloat16 rows and activations after the one rounding to
bfloat16: one bf16 ulp (2**-8), before it (float32) 2e-6 against AVX2; int8 activations against
their own reference (the same integer codes) 2e-6. The ISA switch and its one-line notes run
everywhere; the kernels only where the CPU has AVX-512.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from lowbit_weights import random_lowbit

from moespec.kernels import linear as L
from moespec.kernels import native

has_512 = native.library() is not None and native.status().isa == "avx512"
needs_512 = pytest.mark.skipif(not has_512, reason=native.status().isa_note or native.status().note or "")


@contextlib.contextmanager
def isa(name: str):
    before = native.set_isa(name)
    try:
        assert native.current_isa() == name
        yield
    finally:
        native.set_isa(before)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _raw(x: torch.Tensor, w, act_int8: bool = False) -> torch.Tensor:
    """The kernel's float32 output [T, R] before the cast to x's dtype."""
    p = L.prepare(x, w, act_int8)
    y = L.new_output(p, L.rows_of(w))
    L.run_rows(p, w, y, 0, L.rows_of(w))
    return y


# short last groups (80 = 64 + 16, 176 = 128 + 48), one group of 16 (g > C), int8 activations' 64 / 32 / 16
# column steps (208 = 3 * 64 + 16, 112 = 64 + 48), odd row counts, the Qwen3 and GPT-OSS widths; int4
# chunks of 128 columns with groups of 256 (640) and a 16-column tail (400 = 3 * 128 + 16)
SHAPES = [(40, 80, 64), (33, 48, 32), (9, 16, 64), (17, 96, 256), (6, 2048, 128), (7, 208, 64), (11, 176, 128),
          (5, 112, 64), (3, 768, 32), (4, 2880, 64), (5, 640, 256), (3, 400, 32)]


@needs_512
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows,cols,group", SHAPES)
# t > 1: tiles of 4 tokens x 4 rows (2, 4), of 8 tokens x 2 rows and a shorter last tile (9, 16)
@pytest.mark.parametrize("tokens", [1, 2, 4, 9, 16])
def test_lowbit_avx512_equals_the_reference_and_avx2(bits, rows, cols, group, tokens):
    w = random_lowbit(bits, rows, cols, group, seed=rows + cols)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(cols))
    with isa("avx2"):
        exact2, a8_2 = _raw(x, w), _raw(x, w, act_int8=True)
    with isa("avx512"):
        exact5, a8_5 = _raw(x, w), _raw(x, w, act_int8=True)
    assert _rel(exact5, L.linear_reference(x, w)) < 2e-6
    assert _rel(exact5, exact2) < 2e-6
    assert _rel(a8_5, L.linear_reference(x, w, act_int8=True)) < 2e-6
    assert _rel(a8_5, a8_2) < 2e-6


@needs_512
@pytest.mark.parametrize("rows,cols", [(37, 80), (5, 13), (64, 576), (9, 2048), (6, 33)])
def test_bf16_rows_avx512_equal_linear_and_avx2(rows, cols):
    gen = torch.Generator().manual_seed(rows)
    w, x = torch.randn(rows, cols, generator=gen).bfloat16(), torch.randn(1, cols, generator=gen).bfloat16()
    with isa("avx2"):
        y2 = _raw(x, w)
    with isa("avx512"):
        y5, out = _raw(x, w), L.linear(x, w)
    assert _rel(y5, y2) < 2e-6
    assert out.dtype == torch.bfloat16 and _rel(out, L.linear_reference(x, w)) < 2**-8


@needs_512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols,tokens", [(37, 80, 2), (9, 2048, 4), (6, 768, 16), (5, 2880, 11), (7, 13, 3)])
def test_float_rows_several_tokens_avx512_equal_the_reference_and_avx2(dtype, rows, cols, tokens):
    """t > 1 float rows (avx512_tokens.c; C % 16 != 0 stays AVX2) with float32 activations."""
    gen = torch.Generator().manual_seed(rows * cols)
    w, x = torch.randn(rows, cols, generator=gen).to(dtype), torch.randn(tokens, cols, generator=gen)
    with isa("avx2"):
        y2 = _raw(x, w)
    with isa("avx512"):
        y5 = _raw(x, w)
    assert _rel(y5, y2) < 2e-6
    assert _rel(y5, F.linear(x, w.float())) < 2e-6


def _a8_by_token(x: torch.Tensor, w) -> torch.Tensor:
    """The int8-activation output [T, R], one kernel call per token (csrc/avx512.c's t = 1 kernels;
    the activations are quantised per token, so each call sees the codes the T-token call sees)."""
    return torch.cat([_raw(x[t:t + 1], w, act_int8=True) for t in range(x.shape[0])])


@needs_512
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows,cols,group", SHAPES)
@pytest.mark.parametrize("tokens", [2, 3, 8, 9, 16])
def test_int8_activations_several_tokens_equal_token_by_token_bit_for_bit(bits, rows, cols, group, tokens):
    """avx512_a8_tokens.c (2 <= t <= 16: each row's codes once, vpdpbusd against every token) gives
    the one-token kernels' float32 y exactly (the same integer dots, lanes and float32 steps)."""
    w = random_lowbit(bits, rows, cols, group, seed=rows * cols)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens + cols))
    with isa("avx512"):
        assert torch.equal(_raw(x, w, act_int8=True), _a8_by_token(x, w))


@needs_512
@pytest.mark.parametrize("rows,cols,group", [(6, 2048, 64), (5, 2880, 256), (7, 400, 32), (4, 80, 64)])
@pytest.mark.parametrize("case", ["outlier", "zero_group", "tiny", "inf", "nan"])
def test_int4_one_token_integer_kernel_within_the_float_tolerance(rows, cols, group, case):
    """int4, one token (avx512.c q4_t1_int_g: activations as 24-bit integers per group): an outlier
    10**4 times the rest, an all-zero group and tiny activations stay within 2e-6 of the reference
    (the error is at most 2**-24 of each group's largest |x|, float32's own rounding there);
    activations that are not finite take the float kernel, which propagates them as AVX2 does."""
    w = random_lowbit(4, rows, cols, group, seed=cols)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(rows))
    if case == "outlier":
        x[0, 5] = 3e4
    elif case == "zero_group":
        x[0, :group] = 0
    elif case == "tiny":
        x *= 1e-30
    elif case in ("inf", "nan"):
        x[0, 7] = float(case)
    with isa("avx2"):
        y2 = _raw(x, w)
    with isa("avx512"):
        y5 = _raw(x, w)
    if case in ("inf", "nan"):
        assert torch.equal(y5.isnan(), y2.isnan()) and torch.equal(y5.isinf(), y2.isinf())
        return
    assert _rel(y5, L.linear_reference(x, w)) < 2e-6
    assert _rel(y5, y2) < 2e-6


@needs_512
def test_bf16_rows_with_float32_activations_run_the_avx2_kernel():
    """vdpbf16ps multiplies bfloat16 activations: others (a float32 model's x) stay on AVX2, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(24, 96, generator=gen).bfloat16(), torch.randn(1, 96, generator=gen)
    with isa("avx2"):
        y2 = _raw(x, w)
    with isa("avx512"):
        y5 = _raw(x, w)
    assert torch.equal(y5, y2)


@pytest.mark.skipif(native.library() is None, reason=native.status().note or "")
@pytest.mark.parametrize("seed", range(40))
def test_int8_activation_codes_equal_the_reference_bit_for_bit(seed):
    """quantize_act (C) and quantize_act_codes_reference (torch) give the same codes and scales for
    many inputs, ties included (values on a grid of halves of the step hit x * 127 / max|x| = n + 0.5)."""
    gen = torch.Generator().manual_seed(seed)
    cols, group = (2880, 64) if seed % 2 else (2048, 128)
    x = torch.randn(16, cols, generator=gen)
    if seed % 4 >= 2:  # exact ties: multiples of max/254 with max = 127 * 2**-4
        x = torch.randint(-254, 255, (16, cols), generator=gen).float() * 2**-5
        x[:, ::group] = 127 * 2**-4
    w = random_lowbit(8, 4, cols, group)
    xq, d, _ = L.prepare(x, w, act_int8=True).a8
    want_q, want_d = L.quantize_act_codes_reference(x, group)
    assert torch.equal(xq, want_q) and torch.equal(d, want_d)


@pytest.mark.skipif(native.library() is None, reason=native.status().note or "")
def test_set_isa_switches_and_names_the_choices():
    with pytest.raises(ValueError, match="one of avx2, avx512"):
        native.set_isa("sse")
    with isa("avx2"):
        assert native.current_isa() == "avx2"
    assert native.current_isa() == native.status().isa


@pytest.mark.skipif(native.library() is None, reason=native.status().note or "")
@pytest.mark.parametrize("env,flags,match", [
    ({"MOESPEC_CPU_ISA": "avx2"}, None, "MOESPEC_CPU_ISA=avx2: the CPU kernels use AVX2"),
    ({"MOESPEC_CPU_ISA": "sse9"}, None, "MOESPEC_CPU_ISA=sse9 is not auto, avx2 or avx512"),
    ({}, set(native.NEEDED) | {"avx512f"}, "this CPU lacks AVX512BW/AVX512VL/AVX512_VNNI/AVX512_BF16"),
])
def test_without_avx512_the_avx2_kernels_run_with_a_one_line_note(monkeypatch, env, flags, match):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if flags is not None:
        monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    native.status.cache_clear()
    try:
        s = native.status()
        assert s.lib is not None and s.note is None and s.isa == "avx2" and native.current_isa() == "avx2"
        assert s.isa_note.startswith(match) and "\n" not in s.isa_note
        w, x = random_lowbit(4, 9, 96, 32), torch.randn(1, 96)
        assert _rel(L.linear(x, w), L.linear_reference(x, w)) < 2e-6
    finally:
        monkeypatch.undo()
        native.status.cache_clear()
        native.status()  # the default choice again (the library is one process-wide handle)


@pytest.mark.skipif(native.library() is None, reason=native.status().note or "")
@pytest.mark.parametrize("env,has_512,shown", [
    ({"MOESPEC_CPU_ISA": "avx2"}, True, "MOESPEC_CPU_ISA=avx2: the CPU kernels use AVX2"),
    ({"MOESPEC_CPU_ISA": "x" * 60}, True, "MOESPEC_CPU_ISA=" + "x" * 8 + " is not auto, avx2 or avx512"),
    ({"MOESPEC_CPU_ISA": "avx2"}, False, None),  # no AVX-512 to turn off: AVX2 is this CPU's best, no note
    ({}, False, None),
])
def test_the_loader_shows_the_isa_note_once_only_where_avx512_is_turned_off(monkeypatch, env, has_512, shown):
    from types import SimpleNamespace

    from moespec.config import OnMiss
    from moespec.runtime import load

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    flags = set(native.NEEDED) | (set(native.NEEDED_512) if has_512 else {"avx512f"})
    monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    native.status.cache_clear()
    try:
        note = load._kernel_note(torch.device("cpu"), SimpleNamespace(on_miss=OnMiss.HOST))
        if shown is None:
            assert note is None
        else:
            assert note is not None and note.startswith(shown) and "\n" not in note and len(note) <= 80
        assert load._kernel_note(torch.device("cuda"), SimpleNamespace(on_miss=OnMiss.FETCH)) is None
    finally:
        monkeypatch.undo()
        native.status.cache_clear()
        native.status()
