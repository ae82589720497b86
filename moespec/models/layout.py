"""ExpertLayout: how one expert is packed into one host row, and how it is computed from it.

Shapes: t tokens routed to one expert, H hidden, I expert intermediate, P packed elements per row.

The expert store keeps every expert as one contiguous row [P] of the layout's storage dtype, so one
copy moves one expert. A layout knows its parts (name -> shape, in packing order), where each
checkpoint part lands in a row, and how to run the expert straight from a row on the device (so a
packed format such as MXFP4 is moved packed and expanded only after the copy). The default is
transformers 5's fused SwiGLU: [gate_up (2I*H, "halves": gate rows then up rows) | down (H*I)].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    def forward(self, x: torch.Tensor, row: torch.Tensor, act) -> torch.Tensor:
        """Raw output [t, H] of the expert in ``row`` for its tokens ``x`` [t, H]: down(act(gate(x)) * up(x))."""
        gate_up, down = self.unpack(row)
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # [t, I] each
        return F.linear(act(gate) * up, down)  # [t, H]
