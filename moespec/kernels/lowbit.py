"""Low-bit (int8 / int4) Linear weights in the CPU kernels' format: packing, unpacking, dequantisation.

Shapes: R rows (output features), C columns (input features), g group size, G = ceil(C / g) groups
per row, N = R * C weights.

A weight [R, C] is cut into groups of g consecutive columns of each row (groups along the input
dimension, as every fused low-bit GEMV reads them; the last group of a row is shorter when g does
not divide C). Each group has a float16 scale and a uint8 zero point: w = (code - zero) * scale.
Codes, row by row: int8 one byte each; int4 in blocks of 32 columns of 16 bytes, byte i holding
code i in its low nibble and code i + 16 in its high nibble, and when C % 32 == 16 a last block of
16 columns in 8 bytes (byte i: code i | code i + 8 << 4). One AND and one shift unpack a block
into columns in order, in SIMD registers (csrc/t1.c) and as whole-tensor torch ops
(:func:`unpack_codes`, on any device: the device path dequantises after the copy with it).

Constraints the kernels need: g in :data:`SUPPORTED_GROUPS` and C a multiple of 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_GROUPS = (32, 64, 128, 256)
COL_MULTIPLE = 16


@dataclass(frozen=True)
class LowBitWeight:
    """One low-bit weight [R, C] as views of its bytes (nothing is copied).

    Attributes:
        bits: 8 or 4.
        rows, cols: R and C.
        group_size: g (columns per scale and zero point).
        codes: uint8 [R * C * bits / 8] in the order above.
        scales: float16 [R * G]; zeros: uint8 [R * G] (row-major [R, G]).
    """

    bits: int
    rows: int
    cols: int
    group_size: int
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    @property
    def groups(self) -> int:
        """G, groups per row."""
        return -(-self.cols // self.group_size)

    @property
    def device(self) -> torch.device:
        return self.codes.device


def groups_per_row(cols: int, group_size: int) -> int:
    """G = ceil(C / g)."""
    return -(-cols // group_size)


def code_bytes(rows: int, cols: int, bits: int) -> int:
    """Bytes of the codes of a [rows, cols] weight."""
    return rows * cols * bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [R, C] uint8 (< 2**bits) -> packed [R * C * bits / 8] uint8 in the kernels' order."""
    r, c = codes.shape
    if bits == 8:
        return codes.contiguous().view(-1)
    full = c // 32 * 32
    main = codes[:, :full].reshape(r, -1, 2, 16)  # [R, blocks, (low, high), 16]
    parts = [(main[:, :, 0] | (main[:, :, 1] << 4)).reshape(r, -1)]  # [R, blocks * 16]
    if c > full:  # a last block of 16 columns
        tail = codes[:, full:].reshape(r, 2, 8)
        parts.append(tail[:, 0] | (tail[:, 1] << 4))  # [R, 8]
    return torch.cat(parts, dim=1).reshape(-1)


def unpack_codes(packed: torch.Tensor, bits: int, rows: int, cols: int) -> torch.Tensor:
    """packed [R * C * bits / 8] uint8 -> codes [R, C] uint8 (inverse of :func:`pack_codes`), any device."""
    if bits == 8:
        return packed.view(rows, cols)
    p = packed.view(rows, cols // 2)
    full = cols // 32 * 16  # bytes of the full blocks of a row
    main = p[:, :full].view(rows, -1, 1, 16)  # [R, blocks, 1, 16]
    out = torch.cat((main & 15, main >> 4), dim=2).view(rows, -1)  # [R, blocks * 32]
    if cols // 2 > full:
        tail = p[:, full:]  # [R, 8]
        out = torch.cat((out, tail & 15, tail >> 4), dim=1)
    return out


def unpack_codes_reference(packed: torch.Tensor, bits: int, rows: int, cols: int) -> torch.Tensor:
    """Slow reference of :func:`unpack_codes`: each code read from its byte and nibble, one at a time."""
    b = packed.tolist()
    if bits == 8:
        return torch.tensor(b, dtype=torch.uint8).view(rows, cols)
    out = []
    for r in range(rows):
        base = r * cols // 2
        for c in range(cols):
            block, i = divmod(c, 32)
            if cols - block * 32 >= 32:  # a block of 32: byte i holds codes i and i + 16
                byte = b[base + block * 16 + i % 16]
                out.append(byte & 15 if i < 16 else byte >> 4)
            else:  # the last block of 16: byte i holds codes i and i + 8
                byte = b[base + block * 16 + i % 8]
                out.append(byte & 15 if i < 8 else byte >> 4)
    return torch.tensor(out, dtype=torch.uint8).view(rows, cols)


def dequantize(w: LowBitWeight, dtype: torch.dtype) -> torch.Tensor:
    """Weights [R, C] in ``dtype`` on the codes' device: (code - zero) * scale in float32, one cast.

    The integer difference is exact and the product is rounded once, so this equals torchao's
    ``dequantize_affine`` and the C kernel's dequantisation bit for bit. A row whose last group is
    short is padded to whole groups for the arithmetic (zero-cost views when g divides C).
    """
    r, c, g, n = w.rows, w.cols, w.group_size, w.groups
    q = unpack_codes(w.codes, w.bits, r, c).float()  # [R, C], a fresh tensor: in place below
    if n * g != c:
        q = torch.nn.functional.pad(q, (0, n * g - c))  # [R, G*g]
    q = q.view(r, n, g)
    q.sub_(w.zeros.view(r, n, 1).float()).mul_(w.scales.view(r, n, 1).float())
    return q.view(r, n * g)[:, :c].to(dtype).contiguous()  # no copy when g divides C and dtype is float32
