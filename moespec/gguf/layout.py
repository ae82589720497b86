"""Expert rows in their GGUF block format: one uint8 row per expert, dequantised where it is computed.

Shapes: t tokens, H hidden, I expert intermediate, E experts.

A GGUF stores each MoE layer's experts as ffn_{gate,up,down}_exps [E, I, H] / [E, I, H] / [E, H, I]
(GPT-OSS: also [E, I], [E, I], [E, H] biases), quantised along the last dimension; expert e of each
is one contiguous byte range. A row is those ranges side by side, each padded to 16 bytes (so float
fields inside the blocks stay aligned and every part starts on a boundary): the bytes one copy moves
are the expert's bytes in the file plus at most 15 per part. ``forward`` dequantises the row where
it is (moespec.gguf.dequant: a device slot after the copy, or a host row for host compute), then
computes like transformers: SwiGLU halves, or GPT-OSS's clamped SwiGLU with biases.

Files may give a tensor kind different types in different layers (llama-quantize's Q4_K_M makes
some layers' ffn_down Q6_K); a :class:`LayeredLayout` then holds each layer's layout in rows of the
largest one's size, and ``for_layer`` picks it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moespec.gguf.dequant import dequantize, tensor_bytes, type_name
from moespec.models.gpt_oss_experts import clamped_swiglu
from moespec.models.layout import ExpertLayout

ALIGN = 16  # bytes every part of a row starts on


@dataclass(frozen=True)
class GgufPart:
    """One expert's slice of a GGUF expert tensor.

    Attributes:
        name: "gate", "up", "down" or "gate_bias", "up_bias", "down_bias".
        ggml_type: its GGMLQuantizationType id.
        shape: one expert's shape in torch order ([I, H], [H, I], [I], [H]).
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.ggml_type, self.shape)

    @property
    def padded(self) -> int:
        return -(-self.nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class GgufLayout(ExpertLayout):
    """SwiGLU expert (Qwen, Mixtral, OLMoE, DeepSeek) as the GGUF blocks of gate [I, H], up [I, H], down [H, I].

    Attributes:
        parts: the row's parts in packing order.
    """

    parts: tuple[GgufPart, ...] = ()

    def part_shapes(self) -> dict[str, tuple[int, ...]]:
        return {p.name: (p.padded,) for p in self.parts}

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    @functools.cached_property
    def _spans(self) -> dict[str, tuple[int, int, GgufPart]]:
        at, out = 0, {}
        for p in self.parts:
            out[p.name] = (at, at + p.nbytes, p)
            at += p.padded
        return out

    def views(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each part's bytes (without its padding), views of ``row``."""
        return {name: row[a:b] for name, (a, b, _) in self._spans.items()}

    @property
    def disk_parts(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parts)

    def disk_view(self, row: torch.Tensor, part: str) -> torch.Tensor | None:
        return self.views(row).get(part)

    def covers(self, part: str) -> tuple[str, ...]:
        return (part,)

    def types(self) -> dict[str, str]:
        """Part -> GGUF type name ("Q4_K"), for reports."""
        return {p.name: type_name(p.ggml_type) for p in self.parts}

    def part(self, row: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Part ``name`` of ``row`` dequantised on the row's device, in its shape and ``dtype``."""
        a, b, p = self._spans[name]
        return dequantize(row[a:b], p.ggml_type, p.shape, dtype)

    def weights(self, row: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """gate_up [2I, H] (halves) and down [H, I], dequantised on the row's device.

        Where gate and up have one type and sit back to back (no padding between them: the usual case),
        gate_up is one dequantisation of both byte ranges, with no concatenation copy.
        """
        (g0, g1, gate), (u0, u1, up) = self._spans["gate"], self._spans["up"]
        if gate.ggml_type == up.ggml_type and g1 == u0:
            gate_up = dequantize(row[g0:u1], gate.ggml_type, (2 * gate.shape[0], gate.shape[1]), dtype)  # [2I, H]
        else:
            gate_up = torch.cat([self.part(row, "gate", dtype), self.part(row, "up", dtype)])  # [2I, H]
        return {"gate_up": gate_up, "down": self.part(row, "down", dtype)}

    def linear_weights(self, row: torch.Tensor) -> None:
        """None: the host pool runs :meth:`forward`, which dequantises the GGUF blocks in the input's
        dtype (the CPU kernels of moespec/kernels read moespec's own low-bit rows, not GGUF blocks)."""
        return None

    def unpack(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.weights(row, torch.float32)
        return w["gate_up"], w["down"]

    def forward(self, x: torch.Tensor, row: torch.Tensor, act) -> torch.Tensor:
        """Raw output [t, H] for tokens x [t, H], dequantised and computed where ``row`` is."""
        w = self.weights(row, x.dtype)
        xr = x.to(row.device)  # no-op when both are on the same device
        gate, up = F.linear(xr, w["gate_up"]).chunk(2, dim=-1)  # [t, I] each
        return F.linear(act(gate) * up, w["down"]).to(x.device)  # [t, H]


@dataclass(frozen=True)
class GgufGptOssLayout(GgufLayout):
    """GPT-OSS expert: gate, up [I, H] (usually MXFP4) with biases [I], down [H, I] with bias [H].

    Differs from :class:`GgufLayout` by biases and the clamped SwiGLU (config.swiglu_alpha / _limit);
    llama.cpp's converter already split GPT-OSS's interleaved gate/up into two tensors.
    """

    alpha: float = 1.702
    limit: float = 7.0

    def weights(self, row: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """gate, up [I, H], down [H, I] and their biases, dequantised on the row's device."""
        return {p.name: self.part(row, p.name, dtype) for p in self.parts}

    def unpack(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.weights(row, torch.float32)
        return torch.cat([w["gate"], w["up"]]), w["down"]

    def forward(self, x: torch.Tensor, row: torch.Tensor, act=None) -> torch.Tensor:
        """Raw output [t, H]; ``act`` is unused (the activation is GPT-OSS's own)."""
        w = self.weights(row, x.dtype)
        xr = x.to(row.device)
        gate = F.linear(xr, w["gate"], w["gate_bias"])  # [t, I]
        up = F.linear(xr, w["up"], w["up_bias"])  # [t, I]
        return F.linear(clamped_swiglu(gate, up, self.alpha, self.limit), w["down"], w["down_bias"]).to(x.device)


@dataclass(frozen=True)
class LayeredLayout(ExpertLayout):
    """Rows whose parts' GGUF types differ between layers: each layer's layout, rows of the largest size.

    Attributes:
        layers: (decoder layer, its GgufLayout) for every MoE layer.
    """

    layers: tuple[tuple[int, GgufLayout], ...] = ()

    @functools.cached_property
    def _by_layer(self) -> dict[int, GgufLayout]:
        return dict(self.layers)

    def for_layer(self, layer: int) -> GgufLayout:
        return self._by_layer[layer]

    def part_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"row": (max(lay.numel for _, lay in self.layers),)}

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    @property
    def disk_parts(self) -> tuple[str, ...]:
        return self.layers[0][1].disk_parts

    def forward(self, x: torch.Tensor, row: torch.Tensor, act) -> torch.Tensor:
        raise TypeError("a LayeredLayout row is computed through for_layer(layer)")


def expert_format_of(layout: ExpertLayout) -> str | None:
    """"gguf Q4_K/Q4_K/Q6_K" (gate/up/down; several per part when layers differ), or None for other layouts."""
    layouts = [lay for _, lay in layout.layers] if isinstance(layout, LayeredLayout) else [layout]
    if not all(isinstance(lay, GgufLayout) for lay in layouts):
        return None
    per = ["+".join(dict.fromkeys(lay.types()[p] for lay in layouts)) for p in ("gate", "up", "down")]
    return "gguf " + "/".join(per)


def row_format(layout: ExpertLayout, dtype: torch.dtype) -> str:
    """How a store's rows hold experts, for reports: "gguf Q4_K/Q4_K/Q6_K", "int4-g64", "mxfp4", "float32"."""
    from moespec.models.quant_layout import expert_format

    return expert_format_of(layout) or expert_format(layout, dtype)
