"""Split one dense SwiGLU FFN's neurons into a shared expert and E equal routed experts.

A dense FFN y = W_d (silu(W_g s) * W_u s) is a sum over its I neurons, so any partition of
the neurons into groups writes y exactly as a sum of smaller SwiGLU "experts" (MoEfication:
Zhang et al., "MoEfication: Transformer Feed-forward Layers are Mixtures of Experts", ACL
Findings 2022). Here:

- the shared expert takes the ``n_shared`` most important neurons, importance being
  mean |activation| over calibration tokens times the neuron's down-projection norm
  (its mean contribution to the output);
- the remaining neurons are grouped into E equal-size routed experts by balanced spherical
  k-means on their co-activation profiles (neurons that fire on the same tokens share an
  expert, so a token's routed output concentrates in few experts).

Shapes: T calibration tokens, H hidden, I dense intermediate, E routed experts,
n = I - n_shared routed neurons, n / E neurons per expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NeuronSplit:
    """Neuron indices of one layer's shared expert and routed experts.

    Attributes:
        shared: [n_shared] int64, indices into the dense intermediate dimension, ascending.
        experts: [E, n / E] int64, each row one routed expert's neurons, ascending.
    """

    shared: torch.Tensor
    experts: torch.Tensor


def neuron_importance(act: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Mean absolute contribution of each neuron to the FFN output.

    Args:
        act: [T, I] floating point (float64 in the conversion), silu(W_g s) * W_u s on calibration tokens.
        w_down: [H, I] floating point (float64 in the conversion), the dense down projection.

    Returns:
        [I] floating point (float64 in the conversion): mean_t |act[t, j]| * ||w_down[:, j]||_2.
    """
    return act.abs().mean(dim=0) * w_down.norm(dim=0)  # [I]


def balanced_kmeans(features: torch.Tensor, n_groups: int, iters: int = 12, seed: int = 0) -> torch.Tensor:
    """Cluster rows into ``n_groups`` groups of exactly equal size (spherical k-means).

    Each iteration assigns rows greedily, most confident (row, centroid) pairs first, to
    centroids that still have room, then recomputes centroids as normalised group means.
    Deterministic for a given seed.

    Args:
        features: [n, D] floating-point rows to cluster; n must be divisible by n_groups.
        n_groups: number of groups (E).
        iters: assignment / update rounds.
        seed: initial centroids are rows drawn with this seed.

    Returns:
        [n_groups, n / n_groups] int64 row indices, each row ascending.
    """
    n = features.shape[0]
    if n % n_groups:
        raise ValueError(f"{n} rows cannot be split into {n_groups} equal groups")
    size = n // n_groups
    x = torch.nn.functional.normalize(features, dim=1)  # [n, D]
    gen = torch.Generator().manual_seed(seed)
    centroids = x[torch.randperm(n, generator=gen)[:n_groups]].clone()  # [G, D]
    assign = torch.empty(n, dtype=torch.int64)
    for _ in range(iters):
        sim = x @ centroids.T  # [n, G]
        order = torch.argsort(sim.flatten(), descending=True, stable=True)  # best pairs first
        room = [size] * n_groups
        placed = [False] * n  # plain Python lists: this greedy loop runs n * G times per round
        chosen = [0] * n
        left = n
        for flat in order.tolist():
            row, group = divmod(flat, n_groups)
            if placed[row] or room[group] == 0:
                continue
            chosen[row] = group
            placed[row] = True
            room[group] -= 1
            left -= 1
            if left == 0:
                break
        assign = torch.tensor(chosen, dtype=torch.int64)
        for g in range(n_groups):
            centroids[g] = torch.nn.functional.normalize(x[assign == g].mean(dim=0), dim=0)
    groups = [torch.nonzero(assign == g).flatten() for g in range(n_groups)]
    return torch.stack(groups)  # [G, size], nonzero() returns ascending indices


def split_neurons(act: torch.Tensor, w_down: torch.Tensor, n_shared: int, n_experts: int,
                  max_profile_tokens: int = 4096) -> NeuronSplit:
    """Choose the shared neurons and group the rest into ``n_experts`` routed experts.

    Args:
        act: [T, I] floating-point SwiGLU activations on calibration tokens.
        w_down: [H, I] floating-point down projection.
        n_shared: neurons kept in the shared expert; (I - n_shared) % n_experts must be 0.
        n_experts: routed experts E.
        max_profile_tokens: tokens used for co-activation profiles (the first ones).

    Returns:
        The :class:`NeuronSplit`.
    """
    importance = neuron_importance(act, w_down)  # [I]
    order = torch.argsort(importance, descending=True, stable=True)
    shared = torch.sort(order[:n_shared]).values  # [n_shared]
    routed = torch.sort(order[n_shared:]).values  # [n]
    # Co-activation profile of a routed neuron: its contribution magnitude on each token.
    profile = (act[:max_profile_tokens, routed].abs() * w_down[:, routed].norm(dim=0)).T  # [n, T']
    profile = profile - profile.mean(dim=1, keepdim=True)
    groups = balanced_kmeans(profile, n_experts)  # [E, n / E] indices into `routed`
    return NeuronSplit(shared=shared, experts=routed[groups])
