"""ExpertStore: every expert of every MoE layer packed into ONE contiguous host buffer.

Shapes: M MoE layers, E experts, P packed elements per expert (ExpertLayout.numel; 3*H*I for SwiGLU).

buffer [M, E, P]: one expert is one contiguous row, so one copy moves one expert. Its element dtype
is the layout's storage dtype (the model dtype, or uint8 for packed formats such as MXFP4). The buffer is
pinned (page-locked) when the device is CUDA, so copies are asynchronous and run at full link
speed: exactly its size, registered under that device (host_memory.PinnedBuffer), not through the
caching host allocator, which would round it up to a power of two. On CPU it stays pageable.
"""

from __future__ import annotations

import torch

from moespec.errors import CheckpointError
from moespec.models.base import ExpertLayout
from moespec.runtime.host.memory import PinnedBuffer, huge_page_bytes


class ExpertStore:
    """Host-side packed experts.

    Args:
        moe_layers: decoder-layer indices of the MoE layers, in order (position m <-> layer index).
        num_experts: E.
        layout: packed layout of one expert.
        dtype: the model's compute dtype (the row dtype is ``layout.storage_dtype(dtype)``).
        pin: page-lock the buffer (only when a CUDA device is used).
        device: the CUDA device to pin for (default: the current one); ignored without ``pin``.
        buffer: an existing [M, E, P] tensor of the row dtype to write into (the disk store's file
            mapping, disk_store.py); None allocates one.

    Raises:
        BudgetError: the CUDA runtime refused to page-lock the buffer.
    """

    def __init__(self, moe_layers: list[int], num_experts: int, layout: ExpertLayout,
                 dtype: torch.dtype, pin: bool = False, device: torch.device | None = None,
                 buffer: torch.Tensor | None = None) -> None:
        self.moe_layers = list(moe_layers)
        self.position = {layer: m for m, layer in enumerate(self.moe_layers)}
        self.num_experts = num_experts
        self.layout = layout
        self.dtype = layout.storage_dtype(dtype)
        shape = (len(self.moe_layers), num_experts, layout.numel)
        self._pinned: PinnedBuffer | None = None
        if buffer is not None:
            assert tuple(buffer.shape) == shape and buffer.dtype == self.dtype and not pin
            self.buffer = buffer  # [M, E, P]
        elif pin:
            dev = device if device is not None and device.index is not None else \
                torch.device("cuda", torch.cuda.current_device())
            self._pinned = PinnedBuffer(self.bytes_needed(len(self.moe_layers), num_experts, layout, dtype), dev)
            self.buffer = self._pinned.tensor.view(self.dtype).view(shape)  # [M, E, P]
        else:  # 2 MiB pages where the kernel gives them (memory.huge_page_bytes)
            nbytes = self.bytes_needed(len(self.moe_layers), num_experts, layout, dtype)
            self.buffer = huge_page_bytes(nbytes).view(self.dtype).view(shape)  # [M, E, P]
        self.pinned = pin
        # Which parts of which expert have been written: loading checks nothing is missing.
        self._written: set[tuple[int, int, str]] = set()

    @staticmethod
    def bytes_needed(moe_layers: int, num_experts: int, layout: ExpertLayout, dtype: torch.dtype) -> int:
        """Host bytes of a store of ``moe_layers`` x ``num_experts`` experts (before allocating it)."""
        itemsize = torch.empty((), dtype=layout.storage_dtype(dtype)).element_size()
        return moe_layers * num_experts * layout.numel * itemsize

    def close(self) -> None:
        """Unpin the buffer (after every copy from it finished); it stays readable."""
        if self._pinned is not None:
            self._pinned.close()

    @property
    def expert_bytes(self) -> int:
        """Bytes of one packed expert (what one H2D copy moves)."""
        return self.layout.numel * self.buffer.element_size()

    def row_numel(self, layer: int) -> int:
        """Storage elements of decoder layer ``layer``'s rows that hold data: ``layout.numel`` except
        where a GGUF file's layers differ in quant type (the rest of the row is padding, never copied)."""
        return self.layout.for_layer(layer).numel

    def copy_bytes(self, layer: int) -> int:
        """Bytes one H2D copy of a layer-``layer`` expert moves (its row's data, without the padding
        up to the largest layer's row)."""
        return self.row_numel(layer) * self.buffer.element_size()

    def slot_rows(self, num_slots: int, device: torch.device) -> torch.Tensor:
        """The device cache's slots [S, P] for rows of this store (the disk store's are aligned for O_DIRECT)."""
        return torch.empty(num_slots, self.layout.numel, dtype=self.dtype, device=device)

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
            part: a part the layout places (``layout.disk_view``), e.g. "gate" / "up" [I, H], "down" [H, I],
                "gate_up" [2I, H]; with expert None each has a leading E dimension.
            tensor: the checkpoint tensor (float parts are cast to the store dtype; packed parts are copied).
            name: the checkpoint name, for error messages.

        Raises:
            CheckpointError: unknown layer/expert/part, a shape that does not match (names both shapes),
                or float data for a packed part (and the reverse).
        """
        if layer not in self.position:
            raise CheckpointError(f"tensor {name} belongs to layer {layer}, which is not an MoE layer")
        layout = self.layout.for_layer(layer)
        probe = layout.disk_view(self.expert(layer, 0), part)
        if probe is None:
            raise CheckpointError(f"tensor {name} ({part}) has no place in the {type(self.layout).__name__} layout",
                                  "the checkpoint's expert format does not match its config.json")
        experts = range(self.num_experts) if expert is None else [expert]
        want = tuple(probe.shape)
        if expert is None:
            want = (self.num_experts, *want)
        elif not 0 <= expert < self.num_experts:
            raise CheckpointError(f"tensor {name} names expert {expert}, but the model has {self.num_experts}")
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {want}")
        if tensor.is_floating_point() != probe.is_floating_point():
            raise CheckpointError(f"tensor {name} has dtype {tensor.dtype}, expected {probe.dtype}",
                                  "the checkpoint's expert format does not match its config.json")
        for k, e in enumerate(experts):
            src = tensor[k] if expert is None else tensor
            layout.disk_view(self.expert(layer, e), part).copy_(src)
            self._written.update((layer, e, p) for p in layout.covers(part))

    def missing(self) -> list[str]:
        """Human-readable list of expert parts never written (empty when loading was complete)."""
        out = []
        for layer in self.moe_layers:
            for e in range(self.num_experts):
                for p in self.layout.for_layer(layer).disk_parts:
                    if (layer, e, p) not in self._written:
                        out.append(f"layer {layer} expert {e} {p}")
        return out
