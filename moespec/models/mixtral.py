"""Mixtral: differs by its disk names (block_sparse_moe, w1/w3/w2) and fp32 gate weights."""

from __future__ import annotations

import torch

from moespec.models.base import MoeAdapter


class MixtralAdapter(MoeAdapter):
    """Mixtral-8x7B family: `block_sparse_moe.experts.N.w1` (gate), `w3` (up), `w2` (down) on disk."""

    model_types = ("mixtral",)
    disk_part_names = {"w1": "gate", "w3": "up", "w2": "down"}
    disk_block_pattern = r"(?:block_sparse_moe|mlp)"

    def cast_weights(self, weights: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Mixtral's router keeps the renormalised top-k weights in float32."""
        return weights

    def dense_name(self, name: str) -> str:
        """transformers 5 names the block `mlp` in memory (its conversion mapping renames it)."""
        return name.replace(".block_sparse_moe.", ".mlp.")
