"""ExpertStore: every expert of every MoE layer packed into ONE contiguous host buffer.

Shapes: M MoE layers, E experts, P packed elements per expert (ExpertLayout.numel = 3*H*I).

buffer [M, E, P]: one expert is one contiguous row, so one copy moves one expert. The buffer is
pinned (page-locked) when the device is CUDA, so copies are asynchronous and run at full link
speed; on a machine without an accelerator pin_memory raises, so it stays pageable there.
"""

from __future__ import annotations

import torch

from moespec.errors import CheckpointError
from moespec.models.base import ExpertLayout


class ExpertStore:
    """Host-side packed experts.

    Args:
        moe_layers: decoder-layer indices of the MoE layers, in order (position m <-> layer index).
        num_experts: E.
        layout: packed layout of one expert.
        dtype: element dtype of the store (the model's dtype).
        pin: page-lock the buffer (only when a CUDA device is used).
    """

    def __init__(self, moe_layers: list[int], num_experts: int, layout: ExpertLayout,
                 dtype: torch.dtype, pin: bool) -> None:
        self.moe_layers = list(moe_layers)
        self.position = {layer: m for m, layer in enumerate(self.moe_layers)}
        self.num_experts = num_experts
        self.layout = layout
        self.dtype = dtype
        shape = (len(self.moe_layers), num_experts, layout.numel)
        # Pinned allocation needs a CUDA context; torch raises without one, hence the flag.
        self.buffer = torch.empty(shape, dtype=dtype, pin_memory=pin)  # [M, E, P]
        self.pinned = pin
        # Which parts of which expert have been written: loading checks nothing is missing.
        self._written: set[tuple[int, int, str]] = set()

    @property
    def expert_bytes(self) -> int:
        """Bytes of one packed expert (what one H2D copy moves)."""
        return self.layout.numel * self.buffer.element_size()

    @property
    def total_bytes(self) -> int:
        """Bytes of all experts in the store."""
        return self.buffer.numel() * self.buffer.element_size()

    def expert(self, layer: int, expert: int) -> torch.Tensor:
        """The packed row [P] of ``expert`` at decoder layer ``layer`` (a view)."""
        return self.buffer[self.position[layer], expert]

    def write(self, layer: int, expert: int | None, part: str, tensor: torch.Tensor, name: str) -> None:
        """Copy one checkpoint tensor into the store.

        Args:
            layer, expert: destination; expert None means a fused tensor over all experts.
            part: "gate" / "up" [I, H], "down" [H, I], "gate_up" [2I, H] (halves: gate rows first);
                with expert None each has a leading E dimension.
            tensor: the checkpoint tensor (any float dtype; cast to the store dtype).
            name: the checkpoint name, for error messages.

        Raises:
            CheckpointError: unknown layer/expert or a shape that does not match (names both shapes).
        """
        if layer not in self.position:
            raise CheckpointError(f"tensor {name} belongs to layer {layer}, which is not an MoE layer")
        experts = range(self.num_experts) if expert is None else [expert]
        h, i = self.layout.hidden, self.layout.intermediate
        want = {"gate": (i, h), "up": (i, h), "down": (h, i), "gate_up": (2 * i, h)}[part]
        if expert is None:
            want = (self.num_experts, *want)
        elif not 0 <= expert < self.num_experts:
            raise CheckpointError(f"tensor {name} names expert {expert}, but the model has {self.num_experts}")
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {want}")
        for k, e in enumerate(experts):
            src = tensor[k] if expert is None else tensor
            gate_up, down = self.layout.unpack(self.expert(layer, e))
            dst = {"gate": gate_up[:i], "up": gate_up[i:], "down": down, "gate_up": gate_up}[part]
            dst.copy_(src)
            covered = ("gate", "up") if part == "gate_up" else (part,)
            self._written.update((layer, e, p) for p in covered)

    def missing(self) -> list[str]:
        """Human-readable list of expert parts never written (empty when loading was complete)."""
        out = []
        for layer in self.moe_layers:
            for e in range(self.num_experts):
                for p in ("gate", "up", "down"):
                    if (layer, e, p) not in self._written:
                        out.append(f"layer {layer} expert {e} {p}")
        return out
