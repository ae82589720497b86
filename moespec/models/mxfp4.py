"""MXFP4 (OCP microscaling FP4), as GPT-OSS checkpoints store their experts.

Shapes: R rows (output features), G = C/32 blocks per row of C input columns.

blocks [R, G, 16] uint8: 32 FP4 (E2M1) codes per block, two per byte, low nibble first.
scales [R, G] uint8: one power-of-two exponent per block, biased by 127.
value = FP4[code] * 2**(scale - 127). One parameter costs 4 + 8/32 = 4.25 bits.

Dequantisation is plain torch (a 256-entry byte -> pair table, then ldexp), so it runs wherever the
experts are computed: on the device after the packed copy, or once at load (``--expert-dtype``).
"""

from __future__ import annotations

import torch

BLOCK = 32  # FP4 values per scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def packed_bytes(rows: int, cols: int) -> int:
    """Bytes of an MXFP4 matrix [rows, cols]: blocks (cols/2 per row) + scales (cols/32 per row)."""
    return rows * (cols // 2 + cols // BLOCK)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> values [..., G*32] in ``dtype`` (exact)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    pairs = torch.stack((lut.repeat(16), lut.repeat_interleave(16)), dim=-1)  # [256, 2]: (low, high) nibble
    vals = pairs[blocks.int()].flatten(-2)  # [..., G, 32]
    exp = scales.int().unsqueeze(-1) - 127  # [..., G, 1]
    return torch.ldexp(vals, exp).flatten(-2).to(dtype)  # [..., G*32]
