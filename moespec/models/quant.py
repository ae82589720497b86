"""Group-wise affine int8 / int4 quantisation of expert weights (``--expert-dtype int8|int4|w8a8|w4a8``).

Shapes: R rows (output features), C columns (input features), g group size, G = ceil(C / g) groups
per row.

A projection [R, C] is cut into groups of g consecutive columns of each row (groups along the
input dimension, the layout fused dequantise-and-multiply kernels read; the last group of a row is
shorter when g does not divide C, e.g. the default model's down projection, C = I = 80, g = 64:
groups of 64 and 16). Each group has an asymmetric affine map with a float16 scale and a uint8 zero:

    code = clamp(round(w / scale) + zero, 0, 2**bits - 1),   w' = (code - zero) * scale

The codes' byte order (int4: two codes per byte, in blocks of 32 columns) is the CPU kernels' format,
moespec.kernels.lowbit. The arithmetic of choosing scale/zero and rounding is torchao's affine
quantisation primitives (``choose_qparams_affine``, ``quantize_affine``, run at load on the CPU);
dequantisation is the same formula in plain torch (:func:`dequantize`, any device, after the packed
copy, without torchao), and :func:`dequantize_reference` is torchao's ``dequantize_affine`` beside it.

Format history: 2 = groups of g consecutive weights of the whole projection (row-major, spanning
rows) and int4 halves of the projection; 3 = groups along each row and int4 blocks of 32 (the CPU
kernels need both). runtime.host.quant_store.FORMAT follows it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moespec.errors import OptionError
from moespec.kernels.lowbit import (COL_MULTIPLE, SUPPORTED_GROUPS, LowBitWeight, code_bytes, groups_per_row,
                                    pack_codes, unpack_codes_reference)
from moespec.kernels.lowbit import dequantize as lowbit_dequantize

SCALE_DTYPE = torch.float16  # 2 bytes per group; fp16's 11-bit mantissa is finer than bf16's 8
ZERO_DTYPE = torch.uint8
DEFAULT_GROUP_SIZE = 64  # measured on the default model: see README "Low-bit experts"


class ExpertQuant(str, enum.Enum):
    """Low-bit expert formats ``--expert-dtype`` accepts beside the float dtypes.

    ``w8a8`` / ``w4a8`` store the same rows as int8 / int4; where the CPU kernels compute them (the
    host path, a CPU run) each token's activations are quantised to int8 per group too, so the
    products are integer (as llama.cpp does): faster, NOT exact (moespec.kernels.linear).
    """

    INT8 = "int8"
    INT4 = "int4"
    W8A8 = "w8a8"
    W4A8 = "w4a8"

    @property
    def bits(self) -> int:
        """Bits per weight code."""
        return 8 if self in (ExpertQuant.INT8, ExpertQuant.W8A8) else 4

    @property
    def act_int8(self) -> bool:
        """Activations quantised to int8 where the CPU kernels run."""
        return self in (ExpertQuant.W8A8, ExpertQuant.W4A8)


@dataclass(frozen=True)
class QuantSpec:
    """How expert weights are quantised.

    Attributes:
        bits: 8 or 4 bits per code.
        group_size: g, consecutive columns of a row sharing one scale and zero point.

    Raises:
        OptionError: bits not 4/8, or g not one of the sizes the kernels take (names them).
    """

    bits: int
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise OptionError(f"{self.bits}-bit experts are not supported", "use --expert-dtype int8 or int4")
        if self.group_size not in SUPPORTED_GROUPS:
            sizes = ", ".join(map(str, SUPPORTED_GROUPS[:-1])) + f" or {SUPPORTED_GROUPS[-1]}"
            raise OptionError(f"--group-size {self.group_size} is not supported: the low-bit kernels take {sizes}",
                              f"use --group-size {DEFAULT_GROUP_SIZE}")

    @property
    def qmax(self) -> int:
        """Largest code (255 or 15)."""
        return 2**self.bits - 1

    def groups(self, rows: int, cols: int) -> int:
        """Groups of a [rows, cols] projection (rows x ceil(cols / g))."""
        return rows * groups_per_row(cols, self.group_size)

    def packed_bytes(self, rows: int, cols: int) -> int:
        """Bytes of a quantised [rows, cols] projection: codes + a float16 scale and a uint8 zero per group."""
        return code_bytes(rows, cols, self.bits) + self.groups(rows, cols) * (SCALE_DTYPE.itemsize + ZERO_DTYPE.itemsize)

    @staticmethod
    def check_cols(cols: int, what: str) -> None:
        """Refuse a projection whose input dimension the kernels cannot take (``what`` names it).

        Raises:
            OptionError: ``cols`` is not a multiple of 16.
        """
        if cols % COL_MULTIPLE:
            raise OptionError(f"int8/int4 experts need input sizes that are multiples of {COL_MULTIPLE}: "
                              f"{what} is {cols}", "use --expert-dtype auto")


@dataclass(frozen=True)
class Quantized:
    """One projection [R, C] quantised: codes uint8 [R*C*bits/8] (kernel order), scales float16 [R*G], zeros uint8 [R*G]."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def weight(self, spec: QuantSpec, rows: int, cols: int) -> LowBitWeight:
        """The kernels' view of it."""
        return LowBitWeight(spec.bits, rows, cols, spec.group_size, self.codes, self.scales, self.zeros)


@contextlib.contextmanager
def _quiet_import():
    # torchao logs a warning for each optional CUDA extension it cannot load (on a CPU-only torch)
    # and torch warns about its enums; neither concerns the primitives used here.
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _primitives():
    """torchao's affine quantisation primitives (imported on first use: ~1-4 s).

    Raises:
        OptionError: torchao is not installed (names the extra that provides it).
    """
    try:
        with _quiet_import():
            from torchao.quantization import quant_primitives as qp
    except ImportError:
        raise OptionError("--expert-dtype int8/int4 needs torchao to quantise the experts",
                          "pip install 'moespec[quant]' (or torchao), or use --expert-dtype auto") from None
    return qp


def quantize(weight: torch.Tensor, spec: QuantSpec) -> Quantized:
    """Quantise one projection ``weight`` [R, C] (groups of g columns of each row).

    Computed in float32 on the weight's device with torchao's ASYMMETRIC mapping (min/max per group,
    zero exactly representable). A row whose last group is short is padded with zeros to whole
    groups: the range of every group includes 0 already, so the padding changes no scale or zero.

    Raises:
        OptionError: C is not a multiple of 16.
    """
    rows, cols = weight.shape
    spec.check_cols(cols, "a projection")
    qp = _primitives()
    g, n = spec.group_size, groups_per_row(cols, spec.group_size)
    flat = F.pad(weight.detach().float(), (0, n * g - cols)).view(rows * n, g)  # [R*G, g]
    block = (1, g)
    scales, zeros = qp.choose_qparams_affine(flat, qp.MappingType.ASYMMETRIC, block, torch.uint8, quant_min=0,
                                             quant_max=spec.qmax, scale_dtype=SCALE_DTYPE, zero_point_dtype=ZERO_DTYPE)
    codes = qp.quantize_affine(flat, block, scales, zeros, torch.uint8, quant_min=0, quant_max=spec.qmax)
    codes = codes.view(rows, n * g)[:, :cols]  # [R, C]
    return Quantized(pack_codes(codes, spec.bits), scales.reshape(-1), zeros.reshape(-1))


def dequantize(q: Quantized, spec: QuantSpec, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Weights [R, C] in ``dtype`` on the codes' device: (code - zero) * scale in float32, one cast
    (bit for bit torchao's ``dequantize_affine``; moespec.kernels.lowbit.dequantize)."""
    return lowbit_dequantize(q.weight(spec, rows, cols), dtype)


def dequantize_reference(q: Quantized, spec: QuantSpec, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Slow reference of :func:`dequantize`: torchao's ``dequantize_affine`` on codes unpacked one by one."""
    qp = _primitives()
    g, n = spec.group_size, groups_per_row(cols, spec.group_size)
    codes = F.pad(unpack_codes_reference(q.codes, spec.bits, rows, cols), (0, n * g - cols)).view(rows * n, g)
    w = qp.dequantize_affine(codes, (1, g), q.scales.view(-1, 1), q.zeros.view(-1, 1), torch.uint8,
                             quant_min=0, quant_max=spec.qmax, output_dtype=torch.float32)
    return w.view(rows, n * g)[:, :cols].to(dtype)


def fake_quantize(weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``weight`` [R, C] quantised and dequantised (same shape and dtype): what the runtime computes with."""
    q = quantize(weight, spec)
    return dequantize(q, spec, *weight.shape, weight.dtype)
