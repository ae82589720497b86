"""ExpertLayout: how one expert is packed into one host row, and how it is computed from it.

Shapes: t tokens routed to one expert, H hidden, I expert intermediate, P packed elements per row.

The expert store keeps every expert as one contiguous row [P] of the layout's storage dtype, so one
copy moves one expert. A layout knows its parts (name -> shape, in packing order), where each
checkpoint part lands in a row, and how to run the expert straight from a row on the device (so a
packed format such as MXFP4 is moved packed and expanded only after the copy). The default is
transformers 5's fused SwiGLU: [gate_up (2I*H, "halves": gate rows then up rows) | down (H*I)].

Compute: a SwiGLU layout names its two Linear-shaped weights (:meth:`ExpertLayout.linear_weights`,
views of the row: float tensors or low-bit weights) around :meth:`ExpertLayout.act_and_mul`.
:meth:`ExpertLayout.forward` runs a CPU row (a host row, a CPU slot) through the CPU kernels, the
whole expert in one call where it can (moespec.kernels.swiglu), else both products through
moespec.kernels.linear (F.linear on other devices); the host pool splits the same two products by
output rows across its threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moespec.kernels import native
from moespec.kernels.linear import linear
from moespec.kernels.swiglu import is_silu, silu_and_mul, swiglu_expert, swiglu_experts


@dataclass(frozen=True)
class ExpertKey:
    """Where a checkpoint tensor belongs in the expert store.

    Attributes:
        layer: decoder layer index.
        expert: expert id, or None for a fused [E, ...] tensor.
        part: a part the layout places (``ExpertLayout.disk_view``: "gate", "up", "down", "gate_up",
            or a family's own parts such as MXFP4 blocks/scales or quantised codes).
    """

    layer: int
    expert: int | None
    part: str


@dataclass(frozen=True)
class ExpertLayout:
    """SwiGLU expert [gate_up (2I*H) | down (H*I)] in the model dtype (Mixtral, Qwen, OLMoE, DeepSeek, GLM).

    Attributes:
        hidden: H.
        intermediate: I (per expert).
    """

    hidden: int
    intermediate: int

    def for_layer(self, layer: int) -> ExpertLayout:
        """The layout of decoder layer ``layer``'s rows: this one, except where a GGUF file stores
        layers in different quant types (moespec.gguf.layout.LayeredLayout)."""
        return self

    # --- parts ---------------------------------------------------------------------------
    def part_shapes(self) -> dict[str, tuple[int, ...]]:
        """Stored parts of one expert, in packing order, with their shapes in storage elements."""
        h, i = self.hidden, self.intermediate
        return {"gate_up": (2 * i, h), "down": (h, i)}

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Element dtype of a packed row when the model computes in ``dtype``."""
        return dtype

    @property
    def numel(self) -> int:
        """Elements of one packed row (2*I*H + H*I for SwiGLU)."""
        return sum(math.prod(s) for s in self.part_shapes().values())

    def views(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views (no copy) of every stored part of a packed row [P]."""
        out, at = {}, 0
        for name, shape in self.part_shapes().items():
            n = math.prod(shape)
            out[name] = row[at : at + n].view(shape)
            at += n
        return out

    def unpack(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up [2I, H] and down [H, I] views of a packed row."""
        v = self.views(row)
        return v["gate_up"], v["down"]

    # --- checkpoint parts -------------------------------------------------------------------
    @property
    def disk_parts(self) -> tuple[str, ...]:
        """Parts every expert must receive from the checkpoint (loading reports the missing ones)."""
        return ("gate", "up", "down")

    def disk_view(self, row: torch.Tensor, part: str) -> torch.Tensor | None:
        """Where checkpoint ``part`` of one expert lands in ``row`` (its shape is the expected one), or None."""
        i = self.intermediate
        gate_up, down = self.unpack(row)
        return {"gate": gate_up[:i], "up": gate_up[i:], "down": down, "gate_up": gate_up}.get(part)

    def covers(self, part: str) -> tuple[str, ...]:
        """The disk_parts a checkpoint ``part`` provides (a fused gate_up gives gate and up)."""
        return ("gate", "up") if part == "gate_up" else (part,)

    # --- compute ---------------------------------------------------------------------------
    act_int8 = False  # the CPU kernels keep activations in the compute dtype (QuantLayout may not)

    def linear_weights(self, row: torch.Tensor) -> tuple | None:
        """The two Linear-shaped weights of a row: gate_up [2I, H] and down [H, I] (views, no copy);
        None where :meth:`forward` is not two Linear products around :meth:`act_and_mul` (GPT-OSS)."""
        return self.unpack(row)

    @staticmethod
    def act_and_mul(gate_up: torch.Tensor, act) -> torch.Tensor:
        """[t, 2I] (gate, up halves) -> [t, I]: act(gate) * up (SiLU on the CPU: the one-call
        kernel's own C code, so both paths agree bit for bit)."""
        if is_silu(act):
            h = silu_and_mul(gate_up)
            if h is not None:
                return h
        gate, up = gate_up.chunk(2, dim=-1)  # [t, I] each
        return act(gate) * up

    def native_parts(self, row_dtype: torch.dtype, x_dtype: torch.dtype):
        """(kernel kind, byte offsets (w1, s1, z1, w2, s2, z2) in a row, group size) for the one-call
        CPU kernel (moespec.kernels.swiglu), or None where it does not apply (rows of another dtype
        than the activations', float16)."""
        kind = {torch.float32: native.KIND_F32, torch.bfloat16: native.KIND_BF16}.get(row_dtype)
        if kind is None or row_dtype != x_dtype:
            return None
        down = 2 * self.intermediate * self.hidden * row_dtype.itemsize  # bytes before the down part
        return kind, (0, 0, 0, down, 0, 0), 0

    def forward(self, x: torch.Tensor, row: torch.Tensor, act) -> torch.Tensor:
        """Raw output [t, H] of the expert in ``row`` for its tokens ``x`` [t, H]: down(act(gate(x)) * up(x)).

        Computed where ``row`` is: tokens on another device (device tokens, a host row) go to the
        row's device, and only the [t, H] output comes back. A CPU row takes the one-call kernel
        where it applies (moespec.kernels.swiglu), else the two products below (its reference).
        """
        xr = x if x.device == row.device else x.to(row.device)
        y = swiglu_expert(xr, row, self, act)
        if y is not None:
            return y if y.device == x.device else y.to(x.device)
        gate_up, down = self.linear_weights(row)
        h = self.act_and_mul(linear(xr, gate_up, self.act_int8), act)  # [t, I]
        return linear(h, down, self.act_int8).to(x.device)  # [t, H]

    def forward_many(self, x: torch.Tensor, slots: torch.Tensor, rows: list[int], act) -> list[torch.Tensor]:
        """Raw outputs [t, H] of the experts in ``slots[r]`` (slots [S, P]) for r in ``rows``, all for
        the same tokens x [t, H]: one decode layer's resident experts.

        CPU slots of a layout computed by this class's :meth:`forward` take ONE native call for all of
        them (moespec.kernels.swiglu.swiglu_experts, equal bit for bit); anything else (a GPU slot, a
        family's own forward, no native kernels) runs :meth:`forward` per row, which is the reference.
        """
        y = self.forward_stacked(x, slots, rows, act)
        return list(y.unbind(0)) if y is not None else [self.forward(x, slots[r], act) for r in rows]

    def forward_stacked(self, x: torch.Tensor, slots: torch.Tensor, rows: list[int], act) -> torch.Tensor | None:
        """:meth:`forward_many`'s outputs as one tensor [n, t, H] (the one native call's own buffer, no
        copy: a decode layer sums its experts from it, experts.sum_stacked), or None where that call
        does not apply (then :meth:`forward_many` runs :meth:`forward` per row, its reference)."""
        if not rows or type(self).forward is not ExpertLayout.forward:
            return None
        xr = x if x.device == slots.device else x.to(slots.device)
        y = swiglu_experts(xr, slots, rows, self, act)  # [n, t, H]
        return y if y is None or y.device == x.device else y.to(x.device)

