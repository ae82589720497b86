"""The dense path's int8 one-token kernel (csrc/avx512_dense.c, through bound weights: spin.c).

  - a bound int8 product at one token equals the reference (F.linear on the dequantised weight)
    within float32 rounding, and the experts' kernel (kernels.linear.linear) within the rounding of
    another sum order, for row counts that are not a multiple of its row block, the default model's
    shapes and the group sizes it has no kernel for (they take the experts' kernel: equal bit for bit);
  - under AVX2 (no AVX-512 kernel) the bound product is the experts' kernel's, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from lowbit_weights import random_lowbit

from moespec.kernels import linear as L
from moespec.kernels import native, spin

needs_kernels = pytest.mark.skipif(native.library() is None, reason=native.status().note or "")
has_512 = native.library() is not None and native.current_isa() == "avx512"

# (rows, cols, group): lm_head-like and q/k/v-like rows, odd row counts, g = 128, and C or g the
# kernel leaves to the experts' kernel (C % 64 != 0, g = 32)
SHAPES = [(1003, 576, 64), (961, 576, 64), (37, 1024, 128), (6, 64, 64), (13, 256, 32), (11, 336, 64)]


@needs_kernels
@pytest.mark.parametrize("rows,cols,group", SHAPES)
def test_bound_int8_one_token_equals_the_reference(rows, cols, group):
    w = random_lowbit(8, rows, cols, group, seed=rows)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(cols))
    got = spin.BoundWeight(w).linear(x)
    ref = L.linear_reference(x, w)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, L.linear_serial(x, w), rtol=1e-5, atol=2e-5)
    if group == 32 or cols % 64:
        assert torch.equal(got, L.linear_serial(x, w))  # no dense kernel for these: the experts' one


@needs_kernels
@pytest.mark.skipif(not has_512, reason="needs the AVX-512 kernels")
def test_under_avx2_the_bound_int8_product_is_the_experts_kernel():
    w = random_lowbit(8, 1003, 576, 64, seed=1)
    x = torch.randn(1, 576)
    b = spin.BoundWeight(w)
    try:
        native.set_isa("avx2")
        assert torch.equal(b.linear(x), L.linear_serial(x, w))
    finally:
        native.set_isa("avx512")
