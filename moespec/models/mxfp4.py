"""MXFP4 (OCP microscaling FP4), as GPT-OSS checkpoints store their experts.

Shapes: R rows (output features), G = C/32 blocks per row of C input columns.

blocks [R, G, 16] uint8: 32 FP4 (E2M1) codes per block, two per byte, low nibble first.
scales [R, G] uint8: one power-of-two exponent per block, biased by 127.
value = FP4[code] * 2**(scale - 127). One parameter costs 4 + 8/32 = 4.25 bits.

Dequantisation is plain torch, so it runs wherever the experts are computed: on the device after the
packed copy, or once at load (``--expert-dtype``). The fast path (:func:`dequantize`) looks every byte
up in a 256-entry table of (low, high) nibble values and multiplies each block by its power of two
from a 256-entry scale table, both already in the compute dtype and cached per (device, dtype), so a
use makes no host->device copy (no sync) and no float32 temporary of the expert: its temporaries are
an int32 index (4 bytes per packed byte) and the output. Exact: an FP4 value times a power of two is
representable in bfloat16 and float32 wherever the result is (one rounding, as the reference).
float16 cannot hold the scales' range, so it goes through float32 and is cast once.
:func:`dequantize_reference` is the slow reference the fast path is tested against.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 32  # FP4 values per scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def packed_bytes(rows: int, cols: int) -> int:
    """Bytes of an MXFP4 matrix [rows, cols]: blocks (cols/2 per row) + scales (cols/32 per row)."""
    return rows * (cols // 2 + cols // BLOCK)


@functools.lru_cache(maxsize=None)
def _tables(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [256, 2], pow2 [256]) in ``dtype`` on ``device``: a byte's (low, high) nibble values and
    2**(s - 127) for each scale byte s (s = 255 gives inf: E8M0's NaN code). Built once per key (the
    only host->device copy); cached for the process."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    pairs = torch.stack((lut.repeat(16), lut.repeat_interleave(16)), dim=-1)  # [256, 2]: (low, high) nibble
    pow2 = torch.ldexp(torch.ones(256), torch.arange(256) - 127)  # [256]
    return pairs.to(device=device, dtype=dtype), pow2.to(device=device, dtype=dtype)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> values [..., G*32] in ``dtype`` (exact).

    No sync and no float32 temporary (except for float16, see the module docstring); the tables come
    from a per-(device, dtype) cache. Scale byte 255 (NaN in E8M0) gives inf/NaN.
    """
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    pairs, pow2 = _tables(blocks.device, work)
    lead = blocks.shape[:-1]  # [..., G]
    vals = pairs.index_select(0, blocks.reshape(-1).int()).view(*lead, 2 * blocks.shape[-1])  # [..., G, 32]
    vals.mul_(pow2.index_select(0, scales.reshape(-1).int()).view(*lead, 1))  # x 2**(scale - 127)
    vals = vals.flatten(-2)  # [..., G*32]
    return vals if work == dtype else vals.to(dtype)


def dequantize_reference(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The slow reference: blocks [..., G, 16] uint8, scales [..., G] uint8 -> values [..., G*32] in ``dtype``.

    Builds the table on every call and goes through float32 (ldexp), then casts.
    """
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    pairs = torch.stack((lut.repeat(16), lut.repeat_interleave(16)), dim=-1)  # [256, 2]: (low, high) nibble
    vals = pairs[blocks.int()].flatten(-2)  # [..., G, 32]
    exp = scales.int().unsqueeze(-1) - 127  # [..., G, 1]
    return torch.ldexp(vals, exp).flatten(-2).to(dtype)  # [..., G*32]


def dequantize_gguf(qs: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """GGUF's MXFP4 blocks (ggml's block_mxfp4): qs [..., 16] uint8, exps [...] uint8 -> values [..., 32].

    Differs from :func:`dequantize` only in the nibble order: byte j holds value j in its low nibble
    and value j + 16 in its high nibble (not 2j and 2j + 1). Same tables, so the same values for the
    same codes (ggml's doubled E2M1 table times 2**(e - 128) is this table times 2**(e - 127); the one
    difference is exponent byte 255, E8M0's NaN, which gives NaN here and +-inf or 0 in ggml).
    """
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    pairs, pow2 = _tables(qs.device, work)
    lead = qs.shape[:-1]
    vals = pairs.index_select(0, qs.reshape(-1).int()).view(*lead, 16, 2)  # [..., 16, (low, high)]
    vals.mul_(pow2.index_select(0, exps.reshape(-1).int()).view(*lead, 1, 1))  # x 2**(e - 127)
    vals = vals.transpose(-1, -2).reshape(*lead, 2 * 16)  # [..., 32]: the low nibbles, then the high ones
    return vals if work == dtype else vals.to(dtype)
