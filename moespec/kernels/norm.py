"""RMSNorm of float32 rows by the native kernel (csrc/norm.c), with its reference beside it.

Shapes: x [..., H] float32 (rows: every leading index), weight [H] float32.

:func:`rms_norm` is one ctypes call (the GIL released) where transformers' RMSNorm runs five tensor
ops; :func:`rms_norm_reference` is transformers' formula in torch ops (the families this project
runs all compute it the same way in float32). They agree within a few ulp (tests/test_norm_call.py).
"""

from __future__ import annotations

import torch

from moespec.kernels import native


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when :func:`rms_norm` takes x and weight: the kernels are loaded, both float32 on the CPU,
    weight [H] contiguous with H = x's last dimension."""
    return (native.library() is not None and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and weight.device.type == "cpu" and weight.dim() == 1
            and weight.is_contiguous() and x.shape[-1] == weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)): [..., H] float32 (callers check :func:`applies`)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    native.library().rms_norm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], weight.data_ptr(), eps,
                              y.data_ptr())
    return y


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference: transformers' RMSNorm in float32 torch ops."""
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))
