"""DeepSeek-V2/V3 and GLM-4.7-Flash (glm4_moe_lite): differ by their router and a resident shared expert.

Shapes: T tokens, E routed experts, K top-k, G groups (n_group), H hidden.

What differs from the Qwen/Mixtral default (transformers' DeepseekV3TopkRouter / DeepseekV2TopkRouter):
  - router logits in float32 (the router weight and e_score_correction_bias stay float32 even when
    the model runs in bf16: transformers' _keep_in_fp32_modules_strict);
  - V3/GLM: scores = sigmoid(logits); the correction bias is added for SELECTION only; a group's
    score is the sum of its top-2 biased scores; experts outside the topk_group best groups are
    masked with -inf (never 0: biased scores may all be negative); weights are the UNBIASED scores
    of the chosen experts, renormalised (norm_topk_prob), times routed_scaling_factor; float32;
  - V2: scores = softmax(logits); "greedy" top-K, or "group_limited_greedy" (a group's score is its
    max, masked with 0, harmless for softmax scores); times routed_scaling_factor, never renormalised
    (transformers ignores norm_topk_prob for V2);
  - shared experts (mlp.shared_experts) run on every token and stay on the device;
  - the first layers are dense MLPs (first_k_dense_replace, or GLM's mlp_layer_types): they have no
    `gate` and are not offloaded; predictors already skip them (next MoE layer is the target).
Experts are per-expert on disk (mlp.experts.N.{gate,up,down}_proj.weight), SwiGLU halves in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moespec.models.base import MoeAdapter, Routing


class DeepseekV3Adapter(MoeAdapter):
    """DeepSeek-V3 and GLM-4.7-Flash: sigmoid + correction bias + group-limited top-K."""

    model_types = ("deepseek_v3", "glm4_moe_lite")

    def num_experts(self) -> int:
        return int(self.config.n_routed_experts)

    def router_logits(self, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Differs: computed in float32."""
        return F.linear(hidden.float(), block.gate.weight.float())  # [T, E]

    def shared_output(self, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
        """[T, H] output of the shared experts (resident on the device)."""
        return block.shared_experts(hidden)

    def _groups(self) -> tuple[int, int]:
        return int(self.config.n_group or 1), int(self.config.topk_group or 1)

    def select(self, block: nn.Module, logits: torch.Tensor) -> Routing:
        scores = logits.float().sigmoid()  # [T, E]
        choice = scores + block.gate.e_score_correction_bias  # [T, E], selection only
        n_group, topk_group = self._groups()
        per_group = choice.view(-1, n_group, choice.shape[-1] // n_group)  # [T, G, E/G]
        group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]: sum of each group's top-2
        choice = _mask_groups(choice, group_scores, topk_group, float("-inf"))
        ids = torch.topk(choice, k=self.top_k(), dim=-1, sorted=False)[1]  # [T, K]
        weights = scores.gather(1, ids)  # [T, K] unbiased
        if self.config.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(ids=ids, weights=weights * self.config.routed_scaling_factor, logits=logits)


class DeepseekV2Adapter(DeepseekV3Adapter):
    """DeepSeek-V2 / V2-Lite: softmax scores, no correction bias, greedy or group-limited greedy."""

    model_types = ("deepseek_v2",)

    def select(self, block: nn.Module, logits: torch.Tensor) -> Routing:
        scores = logits.float().softmax(dim=-1)  # [T, E]
        if self.config.topk_method == "group_limited_greedy":
            n_group, topk_group = self._groups()
            group_scores = scores.view(-1, n_group, scores.shape[-1] // n_group).max(dim=-1).values  # [T, G]
            scores = _mask_groups(scores, group_scores, topk_group, 0.0)
        weights, ids = torch.topk(scores, k=self.top_k(), dim=-1, sorted=False)  # [T, K]
        return Routing(ids=ids, weights=weights * self.config.routed_scaling_factor, logits=logits)


def _mask_groups(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float) -> torch.Tensor:
    """scores [T, E] with the experts of all but the ``topk_group`` best groups (group_scores [T, G]) set to ``fill``."""
    n_group = group_scores.shape[-1]
    keep = torch.zeros_like(group_scores)  # [T, G]
    keep.scatter_(1, torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1], 1)
    mask = keep.unsqueeze(-1).expand(-1, n_group, scores.shape[-1] // n_group).reshape(scores.shape)  # [T, E]
    return scores.masked_fill(~mask.bool(), fill)
