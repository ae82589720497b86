"""Fit one MoE layer's router: a bias-free linear map H->E trained to pick the oracle's experts.

The converted layer routes like Qwen2-MoE (softmax over z = W s -> top-K -> renormalise). Routed
expert e's output o_e(s) is split from the dense FFN, so the dense routed part is R = sum_e o_e.
1. oracle: per token, the K experts whose output alone removes the most error from R,
   gain_e = 2<o_e, R> - ||o_e||^2 (from the Gram matrix <o_e, o_f>; exact for orthogonal outputs);
2. router: least-squares start (logits regress the centred oracle indicator), then full-batch
   Adam on the cross-entropy of softmax(z) against the uniform distribution on the oracle set
   (a multi-label softmax loss; e.g. Mixtral-style routers are trained through this same softmax).
The router has no bias (Qwen2-MoE's gate has none), so none is fitted. How much each chosen expert
counts is settled afterwards by refitting the down projections with these weights (refit.py).

Shapes: T tokens, H hidden, E routed experts, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RouterFit:
    """A fitted router and its recall on held-back tokens.

    Attributes:
        weight: [E, H] router weight in the dtype of the inputs (logits z = s @ weight.T).
        recall: mean |router top-K ∩ oracle top-K| / K on the held-back tokens.
    """

    weight: torch.Tensor
    recall: float


def oracle_topk(outputs: torch.Tensor, k: int) -> torch.Tensor:
    """Per token, the K experts whose output alone removes the most routed-output error.

    Args:
        outputs: [T, E, H] floating-point routed expert outputs o_e.
        k: experts per token.

    Returns:
        [T, K] int64 expert ids, best first (gain 2<o_e, R> - ||o_e||^2, R = sum_f o_f).
    """
    total = outputs.sum(dim=1, keepdim=True)  # [T, 1, H]
    gain = 2 * (outputs * total).sum(-1) - outputs.pow(2).sum(-1)  # [T, E]
    return torch.topk(gain, k, dim=-1).indices  # [T, K]


def topk_weights(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-MoE routing: softmax over E, top-K, renormalise. logits [T, E] -> ([T, K] weights, [T, K] ids).

    The softmax runs in float32 at least (float64 logits stay float64), as transformers' router does.
    """
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # [T, E]
    top_w, top_ids = torch.topk(probs, k, dim=-1)  # [T, K]
    return top_w / top_w.sum(dim=-1, keepdim=True), top_ids


def fit_router(s: torch.Tensor, outputs: torch.Tensor, k: int, steps: int = 200, lr: float = 3e-3,
               holdout_frac: float = 0.1) -> RouterFit:
    """Fit the router of one layer (see the module docstring).

    Args:
        s: [T, H] float32 router inputs (post-attention-norm hidden states).
        outputs: [T, E, H] float32 routed expert outputs o_e on the same tokens.
        k: experts per token.
        steps: full-batch Adam steps.
        lr: Adam learning rate.
        holdout_frac: share of tokens (the last ones) held back to report recall.

    Returns:
        The :class:`RouterFit`.
    """
    n_tokens, n_experts, _ = outputs.shape
    n_fit = n_tokens - max(1, int(n_tokens * holdout_frac))
    oracle = oracle_topk(outputs, k)  # [T, K]
    target = torch.zeros(n_tokens, n_experts, dtype=s.dtype).scatter_(1, oracle, 1.0 / k)  # [T, E]
    s_fit, t_fit = s[:n_fit], target[:n_fit]
    init = torch.linalg.lstsq(s_fit, (t_fit - 1.0 / n_experts) * n_experts).solution.T  # [E, H]
    weight = init.clone().requires_grad_(True)
    opt = torch.optim.Adam([weight], lr=lr)
    with torch.enable_grad():  # callers may run under no_grad
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = -(t_fit * torch.log_softmax(s_fit @ weight.T, dim=-1)).sum(-1).mean()
            loss.backward()
            opt.step()
    weight = weight.detach()
    with torch.no_grad():
        mine = torch.topk(s[n_fit:] @ weight.T, k, dim=-1).indices  # [T', K]
        hits = (mine[:, :, None] == oracle[n_fit:, None, :]).any(-1).float()  # [T', K]
    return RouterFit(weight=weight, recall=float(hits.mean()))
