"""Qwen3-MoE and OLMoE: the default rule (softmax -> top-k -> optional renormalise by norm_topk_prob)."""

from __future__ import annotations

from moespec.models.base import MoeAdapter


class Qwen3MoeAdapter(MoeAdapter):
    """Qwen3-MoE (Qwen3-30B-A3B): experts on disk as mlp.experts.N.{gate,up,down}_proj."""

    model_types = ("qwen3_moe",)


class OlmoeAdapter(MoeAdapter):
    """OLMoE: as Qwen3-MoE; norm_topk_prob=False keeps the full-softmax weights (sum < 1)."""

    model_types = ("olmoe",)
