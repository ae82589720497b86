"""QuantLayout: one SwiGLU expert quantised to int8 / int4 in ONE uint8 row, and the load-time converter.

Shapes: t tokens, H hidden, I expert intermediate, g group size, Gh = ceil(H/g), Gi = ceil(I/g).

Row (bytes): [gate_up scales (2I*Gh float16) | down scales (H*Gi float16) | gate_up zeros (2I*Gh) |
down zeros (H*Gi) | gate_up codes (2I*H*bits/8) | down codes (H*I*bits/8) | pad to 16]. Every
projection is grouped along its input dimension, row by row (moespec.kernels.lowbit): gate_up
[2I, H] in groups of H's columns, down [H, I] in groups of I's. Scales come first so their float16
views stay aligned in every row. gate_up is transformers' [2I, H] "halves" (gate rows, then up
rows), so each of its parts is the gate projection's in its first half, and per-expert checkpoints
(gate, up, down) and fused ones land in the same places.

The row is what moves: a copy moves codes, scales and zeros together. :meth:`QuantLayout.forward`
computes where the row is: on the CPU (a host row, or a CPU slot) by the fused low-bit kernels,
which read each code once (moespec.kernels.linear); on a GPU slot by dequantising after the copy
(plain torch) and F.linear, as MXFP4 does for GPT-OSS.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moespec.errors import CheckpointError
from moespec.kernels import native
from moespec.kernels.lowbit import LowBitWeight, dequantize
from moespec.models.layout import ExpertKey, ExpertLayout
from moespec.models.quant import (DEFAULT_GROUP_SIZE, SCALE_DTYPE, QuantSpec, Quantized, dequantize_reference,
                                  quantize)

_KINDS = ("scales", "zeros", "codes")
_PROJ = ("gate", "up", "down")


@dataclass(frozen=True)
class QuantLayout(ExpertLayout):
    """SwiGLU expert with group-wise int8/int4 weights (Mixtral, Qwen, OLMoE, DeepSeek, GLM).

    Attributes:
        bits: 8 or 4.
        group_size: g, columns per scale/zero (one of moespec.kernels.lowbit.SUPPORTED_GROUPS).
        act_int8: the CPU kernels quantise activations to int8 (``--expert-dtype w8a8|w4a8``; not exact).

    Raises:
        OptionError: bits not 4/8, g not a supported size, or H / I not multiples of 16 (names the flag).
    """

    bits: int = 4
    group_size: int = DEFAULT_GROUP_SIZE
    act_int8: bool = False

    def __post_init__(self) -> None:
        spec = self.spec
        spec.check_cols(self.hidden, "the hidden size H")
        spec.check_cols(self.intermediate, "the expert intermediate size I")

    @property
    def spec(self) -> QuantSpec:
        """The quantisation settings (validated on construction)."""
        return QuantSpec(self.bits, self.group_size)

    def _shapes(self) -> dict[str, tuple[int, int]]:
        h, i = self.hidden, self.intermediate
        return {"gate_up": (2 * i, h), "down": (h, i)}

    # --- parts ---------------------------------------------------------------------------
    def part_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parts in bytes, in packing order (see the module docstring)."""
        spec, shapes = self.spec, self._shapes()
        groups = {n: spec.groups(*rc) for n, rc in shapes.items()}
        parts = {f"{n}_scales": (groups[n] * SCALE_DTYPE.itemsize,) for n in shapes}
        parts.update({f"{n}_zeros": (groups[n],) for n in shapes})
        parts.update({f"{n}_codes": (rc[0] * rc[1] * spec.bits // 8,) for n, rc in shapes.items()})
        used = sum(s[0] for s in parts.values())
        if used % 16:  # every row starts 16-byte aligned, so every row's float16 scale views are aligned
            parts["pad"] = (16 - used % 16,)
        return parts

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def views(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        v = self.views_with_pad(row)
        v.pop("pad", None)
        return v

    def views_with_pad(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every part's view, the padding included (the converter zeroes it: cached files are deterministic)."""
        return super().views(row)

    def linear_weights(self, row: torch.Tensor) -> tuple[LowBitWeight, LowBitWeight]:
        """gate_up [2I, H] and down [H, I] as low-bit weights viewing ``row`` (no copy)."""
        return tuple(self._weight(row, name) for name in ("gate_up", "down"))

    def _weight(self, row: torch.Tensor, name: str) -> LowBitWeight:
        (a, b), (c, d), (e, f) = self._ranges[name]
        rows, cols = self._shapes()[name]
        return LowBitWeight(self.bits, rows, cols, self.group_size, row[e:f], row[a:b].view(SCALE_DTYPE), row[c:d])

    def native_parts(self, row_dtype: torch.dtype, x_dtype: torch.dtype):
        """(kernel kind, byte offsets (codes, scales, zeros) of gate_up then down, group size) for the
        one-call CPU kernel (moespec.kernels.swiglu)."""
        (s1, _), (z1, _), (w1, _) = self._ranges["gate_up"]
        (s2, _), (z2, _), (w2, _) = self._ranges["down"]
        kind = native.KIND_Q4 if self.bits == 4 else native.KIND_Q8
        return kind, (w1, s1, z1, w2, s2, z2), self.group_size

    def unpack(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up [2I, H] and down [H, I] dequantised to float32 (new tensors, not views)."""
        w = self.weights(row, torch.float32)
        return w["gate_up"], w["down"]

    def weights(self, row: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Dequantised on the row's device: gate_up [2I, H] and down [H, I] in ``dtype``."""
        gate_up, down = self.linear_weights(row)
        return {"gate_up": dequantize(gate_up, dtype), "down": dequantize(down, dtype)}

    def weights_reference(self, row: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Slow reference of :meth:`weights`: each projection on its own through :func:`dequantize_reference`."""
        v, spec = self.views(row), self.spec
        out = {}
        for name, (rows, cols) in self._shapes().items():
            n = 2 if name == "gate_up" else 1  # gate and up were quantised (and packed) separately
            codes, scales, zeros = (v[f"{name}_{k}"].chunk(n) for k in ("codes", "scales", "zeros"))
            out[name] = torch.cat([dequantize_reference(Quantized(c, s.view(SCALE_DTYPE), z), spec, rows // n, cols, dtype)
                                   for c, s, z in zip(codes, scales, zeros)])
        return out

    @functools.cached_property
    def _ranges(self) -> dict[str, tuple[tuple[int, int], ...]]:
        # projection -> (start, end) bytes of its scales, zeros, codes.
        at, spans = 0, {}
        for name, shape in self.part_shapes().items():
            spans[name] = (at, at + shape[0])
            at += shape[0]
        return {n: tuple(spans[f"{n}_{k}"] for k in _KINDS) for n in ("gate_up", "down")}

    # --- checkpoint parts -------------------------------------------------------------------
    @property
    def disk_parts(self) -> tuple[str, ...]:
        """Every projection's scales, zeros and codes ("gate.codes", ...): what the converter emits."""
        return tuple(f"{p}.{k}" for p in _PROJ for k in _KINDS)

    def disk_view(self, row: torch.Tensor, part: str) -> torch.Tensor | None:
        """Where a converted part ("gate.scales", "down.codes", ...) lands: a byte range of the row."""
        if part == "pad":
            return self.views_with_pad(row).get("pad")
        proj, _, kind = part.partition(".")
        if proj not in _PROJ or kind not in _KINDS:
            return None
        v = self.views(row)
        if proj == "down":
            return v[f"down_{kind}"]
        whole = v[f"gate_up_{kind}"]
        half = whole.numel() // 2
        return whole[:half] if proj == "gate" else whole[half:]

    def covers(self, part: str) -> tuple[str, ...]:
        return (part,)

    def converter(self):
        """A callable (key, tensor, name) -> [(key, tensor, name), ...] that quantises float expert parts.

        Each checkpoint tensor (per expert [I, H] / [H, I], or fused [E, ...]) is quantised as it
        streams in and leaves as uint8 parts; the float tensor is dropped right after, so the whole
        model is never held in full precision.

        Raises:
            CheckpointError: a tensor whose shape does not match the config (names both shapes), or
                one whose quantisation scales are not finite (NaN/Inf weights, or weights beyond
                float16's range): refused, since NaN scales give NaN experts and the store could
                never be cached (its check refuses non-finite scales, so every start would quantise
                again, silently).
        """
        h, i = self.hidden, self.intermediate

        def emit(layer: int, expert: int, proj: str, w: torch.Tensor, name: str):
            q = quantize(w, self.spec)
            if not bool(torch.isfinite(q.scales).all()):
                raise nonfinite_weights(name, layer, expert, w, self.bits)
            parts = {"scales": q.scales.view(torch.uint8), "zeros": q.zeros, "codes": q.codes}
            return [(ExpertKey(layer, expert, f"{proj}.{k}"), t, name) for k, t in parts.items()]

        def convert(key, tensor: torch.Tensor, name: str):
            if not tensor.is_floating_point() or key.part not in ("gate", "up", "down", "gate_up"):
                return [(key, tensor, name)]  # the store names what has no place in this layout
            experts = [(key.expert, tensor)] if key.expert is not None else list(enumerate(tensor))
            want = {"gate_up": (2 * i, h), "down": (h, i)}.get(key.part, (i, h))
            out = []
            for e, w in experts:
                if tuple(w.shape) != want:
                    shape = want if key.expert is not None else ("E", *want)
                    raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {shape}",
                                          "the config does not match the weights")
                if key.part == "gate_up":
                    out += emit(key.layer, e, "gate", w[:i], name) + emit(key.layer, e, "up", w[i:], name)
                else:
                    out += emit(key.layer, e, key.part, w, name)
                pad = self.part_shapes().get("pad")
                if key.part == "down" and pad:  # the store buffer is uninitialised memory
                    out.append((ExpertKey(key.layer, e, "pad"), torch.zeros(pad, dtype=torch.uint8), name))
            return out

        return convert


def nonfinite_weights(name: str, layer: int, expert: int, weight: torch.Tensor, bits: int) -> CheckpointError:
    """The one-line refusal of an expert weight whose int scales are not finite (QuantLayout.converter)."""
    finite = torch.isfinite(weight)
    if bool(finite.all()):
        why = f"values up to {float(weight.abs().max()):.3g} overflow its float16 int{bits} scales"
    else:
        why = f"{int((~finite).sum()):,} of its {weight.numel():,} values are NaN or Inf"
    return CheckpointError(f"tensor {name} (layer {layer}, expert {expert}) cannot be quantised: {why}",
                           "repair or download the checkpoint again, or run with --expert-dtype auto")


def expert_format(layout: ExpertLayout, dtype: torch.dtype) -> str:
    """How a layout stores experts, for reports: "int4-g64", "int8-g64", "w4a8-g64", "mxfp4" or the dtype name."""
    if isinstance(layout, QuantLayout):
        kind = f"w{layout.bits}a8" if layout.act_int8 else f"int{layout.bits}"
        return f"{kind}-g{layout.group_size}"
    if layout.storage_dtype(dtype) == torch.uint8:
        return "mxfp4"  # the only other packed layout (GPT-OSS)
    return str(dtype).removeprefix("torch.")


@torch.no_grad()
def fake_quantize_experts_(model: torch.nn.Module, layout: QuantLayout) -> int:
    """Reference for ``exact`` with int8/int4 experts: replace, in place, every fused expert weight of a
    plain transformers model (gate_up_proj [E, 2I, H], down_proj [E, H, I]) by its quantised-then-
    dequantised value, projection by projection as the converter does (gate and up separately).

    Returns the number of expert projections changed. The model then computes what moespec's
    QuantLayout rows compute, so its logits are what `exact` must reproduce.
    """
    from moespec.models.quant import fake_quantize

    spec, i, changed = layout.spec, layout.intermediate, 0
    for module in model.modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 3:
            continue
        for e in range(gate_up.shape[0]):
            gate_up[e, :i] = fake_quantize(gate_up[e, :i], spec)  # [I, H], groups along H
            gate_up[e, i:] = fake_quantize(gate_up[e, i:], spec)  # [I, H]
            down[e] = fake_quantize(down[e], spec)  # [H, I], groups along I
            changed += 3
    return changed
