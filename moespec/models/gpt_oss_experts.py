"""GPT-OSS expert layouts: clamped SwiGLU with biases, dense or MXFP4-packed rows.

Shapes: t tokens, H hidden, I expert intermediate, G = H/32 or I/32 MXFP4 blocks per row.

Differs from the SwiGLU default (layout.py) in three ways, as transformers' GptOssExperts:
  - the fused weights are transposed, gate_up [H, 2I] and down [I, H] (x @ W, not F.linear);
  - gate and up are INTERLEAVED columns of gate_up (gate = [..., ::2], up = [..., 1::2]), not halves;
  - act = (clamp(up, ±limit) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit), and both
    projections carry biases.
The MXFP4 layout keeps the checkpoint's blocks/scales as bytes (one uint8 row, ~4x fewer bytes than
bf16), so a copy moves the packed expert and ``forward`` dequantises on the device after the copy (mxfp4.dequantize: cached tables, straight to the compute dtype, no sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moespec.models import mxfp4
from moespec.models.layout import ExpertLayout


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation of gate [t, I] and up [t, I] -> [t, I]: (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g),
    g = clamp(gate, max=limit)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass(frozen=True)
class GptOssLayout(ExpertLayout):
    """Dense GPT-OSS expert [gate_up (H*2I) | gate_up_bias (2I) | down (I*H) | down_bias (H)] in the model dtype.

    Attributes:
        alpha, limit: config.swiglu_alpha and config.swiglu_limit.
    """

    alpha: float = 1.702
    limit: float = 7.0

    def part_shapes(self) -> dict[str, tuple[int, ...]]:
        h, i = self.hidden, self.intermediate
        return {"gate_up": (h, 2 * i), "gate_up_bias": (2 * i,), "down": (i, h), "down_bias": (h,)}

    @property
    def disk_parts(self) -> tuple[str, ...]:
        return tuple(p for p in self.part_shapes() if p != "pad")

    def disk_view(self, row: torch.Tensor, part: str) -> torch.Tensor | None:
        return self.views(row).get(part)

    def covers(self, part: str) -> tuple[str, ...]:
        return (part,)

    def linear_weights(self, row: torch.Tensor) -> None:
        """None: transposed weights with biases and an interleaved GLU; :meth:`forward` computes the expert."""
        return None

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[t, 2I] interleaved gate/up -> [t, I] clamped SwiGLU (transformers' GptOssExperts._apply_gate)."""
        return clamped_swiglu(gate_up[..., ::2], gate_up[..., 1::2], self.alpha, self.limit)

    def weights(self, row: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """gate_up [H, 2I], gate_up_bias [2I], down [I, H], down_bias [H] of a row."""
        return self.views(row)

    def forward(self, x: torch.Tensor, row: torch.Tensor, act=None) -> torch.Tensor:
        """Raw output [t, H] for tokens x [t, H]; ``act`` is unused (the activation is the layout's)."""
        w = self.weights(row, x.dtype)
        gate_up = x @ w["gate_up"] + w["gate_up_bias"]  # [t, 2I]
        return self.glu(gate_up) @ w["down"] + w["down_bias"]  # [t, H]


@dataclass(frozen=True)
class GptOssMxfp4Layout(GptOssLayout):
    """MXFP4 GPT-OSS expert as one uint8 row: [gate_up_bias | down_bias | gate_up blocks+scales | down blocks+scales].

    Biases (in ``bias_dtype``, first so their views stay aligned) are stored as bytes. Blocks and
    scales keep the checkpoint's orientation: gate_up rows are the 2I outputs over G = H/32 blocks,
    down rows the H outputs over I/32 blocks.

    Attributes:
        bias_dtype: the model dtype (biases are added in it).
    """

    bias_dtype: torch.dtype = torch.bfloat16

    def part_shapes(self) -> dict[str, tuple[int, ...]]:
        h, i, b = self.hidden, self.intermediate, torch.finfo(self.bias_dtype).bits // 8
        parts = {"gate_up_bias": (2 * i * b,), "down_bias": (h * b,),
                 "gate_up_blocks": (2 * i, h // mxfp4.BLOCK, 16), "gate_up_scales": (2 * i, h // mxfp4.BLOCK),
                 "down_blocks": (h, i // mxfp4.BLOCK, 16), "down_scales": (h, i // mxfp4.BLOCK)}
        used = (2 * i + h) * b + mxfp4.packed_bytes(2 * i, h) + mxfp4.packed_bytes(h, i)
        if used % 16:  # keep every row 16-byte aligned, so the bias views of any row are aligned
            parts["pad"] = (16 - used % 16,)
        return parts

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def views(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        v = super().views(row)
        v.pop("pad", None)
        for name in ("gate_up_bias", "down_bias"):
            v[name] = v[name].view(self.bias_dtype)
        return v

    def weights(self, row: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Dequantised on the row's device: gate_up [H, 2I], down [I, H] (transposed views), biases."""
        v = self.views(row)
        return {"gate_up": mxfp4.dequantize(v["gate_up_blocks"], v["gate_up_scales"], dtype).T,  # [H, 2I]
                "gate_up_bias": v["gate_up_bias"],
                "down": mxfp4.dequantize(v["down_blocks"], v["down_scales"], dtype).T,  # [I, H]
                "down_bias": v["down_bias"]}
