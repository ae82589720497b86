"""moespec's torch dequantisers against gguf's numpy reference (bit for bit in float32) and
transformers' torch ones, on random blocks: every byte pattern is a valid block."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from moespec.gguf.dequant import dequantize, dequantize_reference, supported_types

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4, Q.IQ4_XS, Q.BF16,
         Q.F16]


def _blocks(t, n: int = 48) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[t]
    return np.random.default_rng(int(t)).integers(0, 256, size=n * size, dtype=np.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN equal to NaN (random fp16 scales include inf and NaN)."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_float32_equals_gguf_numpy_reference(ggml_type):
    raw = _blocks(ggml_type)
    n = raw.size // GGML_QUANT_SIZES[ggml_type][1] * GGML_QUANT_SIZES[ggml_type][0]
    got = dequantize(torch.from_numpy(raw.copy()), ggml_type, (n,), torch.float32)
    assert _same(got, dequantize_reference(raw, ggml_type, (n,)))
    assert _same(dequantize(torch.from_numpy(raw.copy()), ggml_type, (n,), torch.bfloat16), got.to(torch.bfloat16))


@pytest.mark.parametrize("ggml_type", [t for t in TYPES if t not in (Q.MXFP4, Q.BF16, Q.F16)], ids=lambda t: t.name)
def test_equal_to_transformers_torch_dequantisers(ggml_type):
    from transformers.integrations.gguf import dequant

    if int(ggml_type) not in dequant.GGML_BLOCK:
        pytest.skip(f"transformers has no {ggml_type.name}")
    raw = torch.from_numpy(_blocks(ggml_type).copy())
    ours = dequantize(raw, ggml_type, (raw.numel() // GGML_QUANT_SIZES[ggml_type][1] * GGML_QUANT_SIZES[ggml_type][0],),
                      torch.float32)
    assert _same(ours, dequant.dequantize(raw, int(ggml_type), torch.float32))


def test_supported_types_name_the_common_quants():
    assert {"Q4_K", "Q6_K", "Q8_0", "Q4_0", "MXFP4", "F32", "BF16"} <= set(supported_types())
    assert "TQ2_0" not in supported_types()
