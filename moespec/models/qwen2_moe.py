"""Qwen2-MoE: differs from Qwen3-MoE by a resident shared expert with a sigmoid gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moespec.models.base import MoeAdapter


class Qwen2MoeAdapter(MoeAdapter):
    """Qwen2-MoE: out = routed + sigmoid(shared_expert_gate(x)) * shared_expert(x).

    The shared expert and its gate are dense parts: they stay on the device.
    """

    model_types = ("qwen2_moe",)

    def shared_output(self, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
        """[T, H] gated shared-expert output (as transformers' Qwen2MoeSparseMoeBlock computes it)."""
        return F.sigmoid(block.shared_expert_gate(hidden)) * block.shared_expert(hidden)
