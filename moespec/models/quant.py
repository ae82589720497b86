"""Group-wise affine int8 / int4 quantisation of expert weights (``--expert-dtype int8|int4``).

Shapes: R rows (output features), C columns (input features), N = R*C weights, G = N/g groups of g.

A projection [R, C] is cut into groups of g CONSECUTIVE weights of its row-major order (HQQ's
grouping, as mixtral-offloading uses), so g only has to divide R*C, not C: the default model's
down projection has rows of I = 80 weights, which no power-of-two group of 64 divides. Each group
has an asymmetric affine map with a float16 scale and a uint8 zero point:

    code = clamp(round(w / scale) + zero, 0, 2**bits - 1),   w' = (code - zero) * scale

int8 keeps one code per byte. int4 packs two codes per byte in halves: byte k of a projection of N
weights holds code k in its low nibble and code k + N/2 in its high nibble, so unpacking is two
whole-tensor bit operations and one concatenation (interleaving low/high nibbles of neighbouring
bytes was a strided stack, ~5x slower than the rest of dequantisation together). The arithmetic of
choosing scale/zero and rounding is torchao's affine quantisation primitives (``choose_qparams_affine``,
``quantize_affine``, run at load on the CPU); dequantisation is the same formula in plain torch
(:func:`dequantize`, so it runs on any device after the packed copy without importing torchao), and
:func:`dequantize_reference` is torchao's ``dequantize_affine`` beside it (tests compare the two).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import warnings
from dataclasses import dataclass

import torch

from moespec.errors import OptionError

SCALE_DTYPE = torch.float16  # 2 bytes per group; fp16's 11-bit mantissa is finer than bf16's 8
ZERO_DTYPE = torch.uint8
DEFAULT_GROUP_SIZE = 64  # measured on the default model: see README "Low-bit experts"


class ExpertQuant(str, enum.Enum):
    """Low-bit expert formats ``--expert-dtype`` accepts beside the float dtypes."""

    INT8 = "int8"
    INT4 = "int4"

    @property
    def bits(self) -> int:
        """Bits per weight code."""
        return 8 if self is ExpertQuant.INT8 else 4


@dataclass(frozen=True)
class QuantSpec:
    """How expert weights are quantised.

    Attributes:
        bits: 8 or 4 bits per code.
        group_size: g, consecutive weights sharing one scale and zero point.
    """

    bits: int
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise OptionError(f"{self.bits}-bit experts are not supported", "use --expert-dtype int8 or int4")
        if self.group_size < 2 or self.group_size % 2:
            raise OptionError(f"--group-size {self.group_size} must be an even number of at least 2",
                              f"use --group-size {DEFAULT_GROUP_SIZE}")

    @property
    def qmax(self) -> int:
        """Largest code (255 or 15)."""
        return 2**self.bits - 1

    def code_bytes(self, numel: int) -> int:
        """Bytes of the codes of ``numel`` weights."""
        return numel * self.bits // 8

    def packed_bytes(self, numel: int) -> int:
        """Bytes of ``numel`` quantised weights: codes + a float16 scale and a uint8 zero per group."""
        groups = numel // self.group_size
        return self.code_bytes(numel) + groups * (SCALE_DTYPE.itemsize + ZERO_DTYPE.itemsize)

    def check_divides(self, numel: int, what: str) -> None:
        """Refuse a group size that does not divide ``numel`` weights (``what`` names them).

        Raises:
            OptionError: names the group size, the count and the flag.
        """
        if numel % self.group_size:
            fits = [g for g in (64, 128, 32, 256, 16, 8) if numel % g == 0]  # nearest the default first
            hint = f"use --group-size {fits[0]}" if fits else "use a --group-size that divides it"
            raise OptionError(f"--group-size {self.group_size} does not divide the {numel} weights of {what}", hint)


@dataclass(frozen=True)
class Quantized:
    """One projection quantised: codes [N*bits/8] uint8, scales [G] float16, zeros [G] uint8."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor


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
    """Quantise one projection ``weight`` (any shape, N elements; row-major groups of g).

    Computed in float32 on the weight's device with torchao's ASYMMETRIC mapping (min/max per group,
    zero exactly representable).

    Raises:
        OptionError: g does not divide N (call :meth:`QuantSpec.check_divides` first for a better name).
    """
    spec.check_divides(weight.numel(), "a projection")
    qp = _primitives()
    flat = weight.detach().reshape(-1, spec.group_size).float()  # [G, g]
    block = (1, spec.group_size)
    scales, zeros = qp.choose_qparams_affine(flat, qp.MappingType.ASYMMETRIC, block, torch.uint8, quant_min=0,
                                             quant_max=spec.qmax, scale_dtype=SCALE_DTYPE, zero_point_dtype=ZERO_DTYPE)
    codes = qp.quantize_affine(flat, block, scales, zeros, torch.uint8, quant_min=0, quant_max=spec.qmax)  # [G, g]
    return Quantized(pack(codes.reshape(-1), spec.bits), scales.reshape(-1), zeros.reshape(-1))


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N] uint8 (< 2**bits) -> packed [N*bits/8] uint8 (int4: byte k = code k | code k+N/2 << 4)."""
    if bits == 8:
        return codes.contiguous()
    half = codes.numel() // 2
    return codes[:half] | (codes[half:] << 4)


def unpack(packed: torch.Tensor, bits: int, parts: int = 1) -> torch.Tensor:
    """packed [N*bits/8] uint8 -> codes [N] uint8 (inverse of :func:`pack`).

    ``parts`` projections packed one after another (each by :func:`pack`, equal sizes) unpack in one call.
    """
    if bits == 8:
        return packed
    p = packed.view(parts, 1, -1)  # [parts, 1, n/2]: each projection's low and high halves
    return torch.cat((p & 15, p >> 4), dim=1).view(-1)  # [N]


def unpack_reference(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Slow reference of :func:`unpack` for one projection: code k read from its byte, one at a time."""
    if bits == 8:
        return packed.clone()
    half, b = packed.numel(), packed.tolist()
    codes = [b[k] & 15 if k < half else b[k - half] >> 4 for k in range(2 * half)]
    return torch.tensor(codes, dtype=torch.uint8)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, spec: QuantSpec,
               shape: tuple[int, ...], dtype: torch.dtype, parts: int = 1) -> torch.Tensor:
    """Weights [*shape] in ``dtype`` from packed codes, scales [G] and zeros [G], on their device.

    (code - zero) * scale in float32 (exact for the integer difference, one rounding for the
    product), then one cast to ``dtype``: bit for bit torchao's ``dequantize_affine``. Scales and
    zeros are made float32 first (G values): a float32 tensor with a float32 [G, 1] operand runs
    torch's vectorised broadcast loop, mixed dtypes its slower casting loop. ``parts`` equal
    projections packed back to back (e.g. a whole expert row) dequantise in one call.
    """
    w = unpack(codes, spec.bits, parts).view(-1, spec.group_size).float()  # [G, g], a fresh tensor: in place below
    w.sub_(zeros.float()[:, None]).mul_(scales.float()[:, None])
    return w.view(shape).to(dtype)


def dequantize_reference(q: Quantized, spec: QuantSpec, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Slow reference of :func:`dequantize`: torchao's ``dequantize_affine`` on codes unpacked one by one."""
    qp = _primitives()
    codes = unpack_reference(q.codes, spec.bits).view(-1, spec.group_size)  # [G, g]
    w = qp.dequantize_affine(codes, (1, spec.group_size), q.scales.view(-1, 1), q.zeros.view(-1, 1), torch.uint8,
                             quant_min=0, quant_max=spec.qmax, output_dtype=torch.float32)
    return w.view(shape).to(dtype)


def fake_quantize(weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``weight`` quantised and dequantised (same shape and dtype): what the runtime computes with."""
    q = quantize(weight, spec)
    return dequantize(q.codes, q.scales, q.zeros, spec, tuple(weight.shape), weight.dtype)
