"""Dequantising GGUF blocks with torch, wherever the bytes are (a host row or a device slot).

Shapes: nb blocks of QK values (32 or 256) of B bytes each (ggml's block_q* structs); values come
out flat [nb * QK] in the order ggml stores them, then take the tensor's [rows, cols] shape.

Why these and not transformers' integrations/gguf/dequant.py (the tests compare the two): its
functions build small constant tensors on the data's device at every call
(``torch.tensor(shifts, device=...)``), a pageable host->device copy that synchronises the CUDA
stream once per expert per layer, and in bfloat16 they round intermediate products. Here every
shift is a Python int (no device constant, no sync) and the arithmetic runs in float32 in the
order of gguf's numpy reference (``gguf.quants.dequantize``), so float32 results equal it bit for
bit (tested); other dtypes are one cast of that. MXFP4 goes through moespec.models.mxfp4 (cached
tables, no float32 temporary in bfloat16). The IQ grid types, which have no function here, go
through transformers' (right, but they synchronise on CUDA).
"""

from __future__ import annotations

import math

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moespec.errors import CheckpointError
from moespec.models import mxfp4

Q = GGMLQuantizationType
FLOAT_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """One float16 field per block at byte ``at``, as float32 [nb, 1]."""
    return b[:, at : at + 2].view(torch.float16).float()


def _planes(q: torch.Tensor, shifts: tuple[int, ...], mask: int, dim: int) -> torch.Tensor:
    """(q >> s) & mask for each shift, stacked at ``dim``: numpy's broadcast shift without a device
    constant, each plane written straight into the output (no stack copy; a mask that keeps every
    bit left after the shift is skipped)."""
    shape = list(q.shape)
    shape.insert(dim % (len(shape) + 1), len(shifts))
    out = torch.empty(shape, dtype=q.dtype, device=q.device)
    for k, shift in enumerate(shifts):
        dst = out.select(dim, k)
        if shift == 0:
            torch.bitwise_and(q, mask, out=dst)
        elif mask >= 0xFF >> shift:
            torch.bitwise_right_shift(q, shift, out=dst)
        else:
            torch.bitwise_and(q >> shift, mask, out=dst)
    return out


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[nb, 4] bytes of a little-endian uint32 -> its 32 bits [nb, 32] (bit j at j)."""
    return _planes(qh, tuple(range(8)), 1, dim=-1).reshape(qh.shape[0], 32)


# Integer codes meet their float32 scales inside one multiply (the promotion is exact), so no code
# tensor is converted to float32 on its own: one pass less than numpy, the same values.
def _q4_0(b):
    q = _planes(b[:, 2:18], (0, 4), 0xF, dim=1).reshape(-1, 32).to(torch.int8) - 8
    return _f16(b, 0) * q


def _q4_1(b):
    q = _planes(b[:, 4:20], (0, 4), 0xF, dim=1).reshape(-1, 32)
    return (_f16(b, 0) * q).add_(_f16(b, 2))


def _q5_0(b):
    q = _planes(b[:, 6:22], (0, 4), 0xF, dim=1).reshape(-1, 32) | (_bits32(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.to(torch.int8) - 16)


def _q5_1(b):
    q = _planes(b[:, 8:24], (0, 4), 0xF, dim=1).reshape(-1, 32) | (_bits32(b[:, 4:8]) << 4)
    return (_f16(b, 0) * q).add_(_f16(b, 2))


def _q8_0(b):
    return b[:, 2:34].view(torch.int8) * _f16(b, 0)


def _q2_k(b):
    nb, scales = b.shape[0], b[:, 0:16]
    dl = (_f16(b, 80) * (scales & 0xF)).reshape(nb, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4)).reshape(nb, 16, 1)
    q = _planes(b[:, 16:80].reshape(nb, 2, 32), (0, 2, 4, 6), 3, dim=2).reshape(nb, 16, 16)
    return (dl * q).sub_(ml).reshape(nb, 256)


def _q3_k(b):
    nb, scales = b.shape[0], b[:, 96:108]
    low = _planes(scales[:, :8], (0, 4), 0xFF, dim=1).reshape(nb, 16)
    high = _planes(scales[:, 8:12], (0, 2, 4, 6), 0xFF, dim=1).reshape(nb, 16)
    sc = ((low & 0xF) | ((high & 3) << 4)).to(torch.int8) - 32
    dl = (_f16(b, 108) * sc).reshape(nb, 16, 1)
    ql = _planes(b[:, 32:96].reshape(nb, 2, 32), (0, 2, 4, 6), 3, dim=2).reshape(nb, 16, 16)
    qh = _planes(b[:, 0:32].reshape(nb, 1, 32), tuple(range(8)), 1, dim=2).reshape(nb, 16, 16) ^ 1
    # the high bit is an inverted borrow: the offset applies where the mask bit is clear
    return (dl * (ql.to(torch.int8) - (qh << 2).to(torch.int8))).reshape(nb, 256)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins [nb, 8] packed in 12 bytes (Q4_K, Q5_K; ggml's get_scale_min_k4)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b):
    nb = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d, dm = (_f16(b, 0) * sc).reshape(nb, 8, 1), (_f16(b, 2) * mn).reshape(nb, 8, 1)
    q = _planes(b[:, 16:144].reshape(nb, 4, 32), (0, 4), 0xF, dim=2).reshape(nb, 8, 32)
    return (d * q).sub_(dm).reshape(nb, 256)


def _q5_k(b):
    nb = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d, dm = (_f16(b, 0) * sc).reshape(nb, 8, 1), (_f16(b, 2) * mn).reshape(nb, 8, 1)
    ql = _planes(b[:, 48:176].reshape(nb, 4, 32), (0, 4), 0xF, dim=2).reshape(nb, 8, 32)
    qh = _planes(b[:, 16:48].reshape(nb, 1, 32), tuple(range(8)), 1, dim=2).reshape(nb, 8, 32)
    return (d * ql.bitwise_or_(qh << 4)).sub_(dm).reshape(nb, 256)


def _q6_k(b):
    nb = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8)).reshape(nb, 16, 1)
    ql = _planes(b[:, 0:128].reshape(nb, 2, 64), (0, 4), 0xF, dim=2).reshape(nb, 8, 32)
    qh = _planes(b[:, 128:192].reshape(nb, 2, 32), (0, 2, 4, 6), 3, dim=2).reshape(nb, 8, 32)
    q = ql.bitwise_or_(qh << 4).view(torch.int8).sub_(32).reshape(nb, 16, 16)
    return (d * q).reshape(nb, 256)


_BLOCKS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0, Q.Q2_K: _q2_k,
           Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}


def _transformers_types() -> dict[int, object]:
    """ggml type -> transformers' torch dequantiser, for the types without a function here (IQ grids)."""
    try:
        from transformers.integrations.gguf import dequant
    except ImportError:  # an older transformers: those types are simply unsupported
        return {}
    return {t: dequant.dequantize for t in dequant.GGML_BLOCK if t not in _BLOCKS}


def supported_types() -> list[str]:
    """Names of the GGUF tensor types moespec can dequantise with torch (experts need one of these)."""
    types = [*FLOAT_TYPES, *_BLOCKS, Q.MXFP4, *_transformers_types()]
    return [Q(t).name for t in sorted(set(types))]


def type_name(ggml_type: int) -> str:
    """"Q4_K", "MXFP4", ... or "type 99" for an id gguf does not know."""
    try:
        return Q(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def tensor_bytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``shape`` (torch order; blocks run along the last dimension) in ``ggml_type``.

    Raises:
        CheckpointError: a type gguf does not know, or a last dimension that is not whole blocks.
    """
    try:
        block, size = GGML_QUANT_SIZES[Q(ggml_type)]
    except (ValueError, KeyError):
        raise CheckpointError(f"GGUF tensor type id {ggml_type} is unknown to gguf {_gguf_version()}",
                              "upgrade the gguf package (pip install -U gguf) or use another quant of the model") from None
    if shape and shape[-1] % block:
        raise CheckpointError(f"a {type_name(ggml_type)} tensor of shape {tuple(shape)} is not whole blocks of {block}")
    return math.prod(shape) // block * size


def check_supported(ggml_type: int, what: str) -> None:
    """Raise unless torch can dequantise ``ggml_type`` (``what`` names the tensor for the message).

    Raises:
        CheckpointError: names the type and lists the supported ones.
    """
    if type_name(ggml_type) not in supported_types():
        raise CheckpointError(f"{what} is stored as {type_name(ggml_type)}, which moespec cannot dequantise on the "
                              f"device (supported: {', '.join(supported_types())})",
                              "use a quant of this model in one of the supported types, e.g. Q4_K_M or Q8_0")


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """GGUF bytes -> values, on ``raw``'s device, without a host sync.

    Args:
        raw: uint8 [nbytes] (a view of a row or a buffer; 2-byte aligned for float16 fields).
        ggml_type: the tensor's GGMLQuantizationType.
        shape: the tensor's shape in torch order (blocks along the last dimension).
        dtype: the output dtype (float32 results are gguf's reference bit for bit; others one cast of them).

    Returns:
        A new tensor of ``shape`` in ``dtype`` (float types may return a view of ``raw`` when no cast is needed).

    Raises:
        CheckpointError: a type with no torch dequantiser (names it).
    """
    if ggml_type in FLOAT_TYPES:
        return raw.view(FLOAT_TYPES[ggml_type]).view(shape).to(dtype)
    if ggml_type == Q.MXFP4:
        blocks = raw.view(-1, 17)  # [nb, 17]: exponent byte, then 16 bytes of two FP4 codes
        return mxfp4.dequantize_gguf(blocks[:, 1:], blocks[:, 0], dtype).view(shape)
    fn = _BLOCKS.get(ggml_type)
    size = GGML_QUANT_SIZES[Q(ggml_type)][1] if ggml_type in list(Q) else 0
    if fn is not None:
        return fn(raw.view(-1, size)).view(shape).to(dtype)
    other = _transformers_types().get(ggml_type)
    if other is None:
        check_supported(ggml_type, "a tensor")
    return other(raw.reshape(-1), int(ggml_type), torch.float32).view(shape).to(dtype)


def dequantize_reference(raw, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """gguf's numpy reference (slow: ~10-20 ms per MB on one core): bytes -> float32 [shape] on the CPU."""
    import numpy as np
    from gguf.quants import dequantize as np_dequantize

    data = raw.cpu().numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw, dtype=np.uint8)
    if ggml_type in (Q.F32, Q.F16):  # gguf reads these as values, the others as bytes
        data = data.view(np.float32 if ggml_type == Q.F32 else np.float16)
    return torch.from_numpy(np.ascontiguousarray(np_dequantize(data, Q(ggml_type)), dtype=np.float32)).view(shape)


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")
