"""MXFP4: the fast dequantisation (cached tables, straight to the compute dtype) equals the reference."""

from __future__ import annotations

import pytest
import torch

from moespec.models import mxfp4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_fast_dequantize_equals_reference(dtype):
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 24, 5, 16), dtype=torch.uint8, generator=g)  # every byte value occurs
    scales = torch.randint(100, 140, (3, 24, 5), dtype=torch.uint8, generator=g)  # realistic exponents
    scales[0, 0] = torch.arange(5, dtype=torch.uint8)  # the smallest (subnormal in bf16) ...
    scales[0, 1] = torch.arange(250, 255, dtype=torch.uint8)  # ... and the largest finite ones
    fast = mxfp4.dequantize(blocks, scales, dtype)
    ref = mxfp4.dequantize_reference(blocks, scales, dtype)
    assert fast.dtype == dtype and fast.shape == (3, 24, 160)
    assert torch.equal(fast, ref)  # bit-exact, signed zeros included
    assert torch.equal(torch.signbit(fast), torch.signbit(ref))


def test_tables_are_cached_per_device_and_dtype():
    a = mxfp4._tables(torch.device("cpu"), torch.bfloat16)
    assert mxfp4._tables(torch.device("cpu"), torch.bfloat16) is a
    assert mxfp4._tables(torch.device("cpu"), torch.float32)[0].dtype == torch.float32


def test_known_values():
    blocks = torch.tensor([[[0x21] + [0] * 15]], dtype=torch.uint8)  # low nibble 1 (0.5), high 2 (1.0)
    scales = torch.tensor([[128]], dtype=torch.uint8)  # x 2
    out = mxfp4.dequantize(blocks, scales, torch.bfloat16)
    assert out[0, :2].tolist() == [1.0, 2.0] and out[0, 2:].abs().sum() == 0
