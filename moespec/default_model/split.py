"""Split one dense SwiGLU FFN's neurons into a shared expert and E equal routed experts.

A dense FFN y = W_d (silu(W_g s) * W_u s) is a sum over its I neurons, so any partition of
the neurons into groups writes y exactly as a sum of smaller SwiGLU "experts" (MoEfication:
Zhang et al., "MoEfication: Transformer Feed-forward Layers are Mixtures of Experts", ACL
Findings 2022). Here:

- the shared expert takes the ``n_shared`` most important neurons, importance being
  mean |activation| over calibration tokens times the neuron's down-projection norm
  (its mean contribution to the output);
- the remaining n neurons (the routed pool) form E routed experts in one of two ways:
  * ``split_neurons``: a partition into equal groups by balanced spherical k-means on their
    co-activation profiles (neurons that fire on the same tokens share an expert);
  * ``cluster_experts`` (the default model's recipe 5): token clusters first, neurons second.
    The calibration tokens' router inputs are clustered into E balanced groups (directions,
    so a linear router can tell them apart), each token joins its K nearest clusters, and
    expert e takes the I_e pool neurons whose mean contribution on its tokens is highest
    *relative to* their mean over all tokens (lift). Experts may share neurons (each keeps
    its own copy and, after the refit, its own down projection), as upcycled MoEs start from
    copies of one FFN (Komatsuzaki et al., "Sparse Upcycling", ICLR 2023). Measured on SmolLM2
    layers 3 / 11 (16 experts, top-4, shared 1088, held-back tokens): the partition gave
    relative error 0.091 / 0.079 with random routing 1.34 / 1.30x worse; 56-neuron clustered
    experts 0.083 / 0.072 and 1.59 / 1.55x; 80 neurons 0.071 / 0.062 and 1.78 / 1.72x: the
    experts specialise, so routing matters more while the layer gets better.

Shapes: T calibration tokens, H hidden, I dense intermediate, E routed experts,
n = I - n_shared routed neurons, I_e neurons per expert (n / E for the partition).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NeuronSplit:
    """Neuron indices of one layer's shared expert and routed experts.

    Attributes:
        shared: [n_shared] int64, indices into the dense intermediate dimension, ascending.
        experts: [E, I_e] int64, each row one routed expert's neurons, ascending (a partition of
            the pool from split_neurons; rows may share neurons from cluster_experts).
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
    assign = torch.full((n,), -1, dtype=torch.int64)
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
        previous, assign = assign, torch.tensor(chosen, dtype=torch.int64)
        if torch.equal(assign, previous):
            break  # converged: the centroids would not change, nor would any later round
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
    shared, routed = shared_and_pool(act, w_down, n_shared)  # [n_shared], [n]
    # Co-activation profile of a routed neuron: its contribution magnitude on each token.
    profile = (act[:max_profile_tokens, routed].abs() * w_down[:, routed].norm(dim=0)).T  # [n, T']
    profile = profile - profile.mean(dim=1, keepdim=True)
    groups = balanced_kmeans(profile, n_experts)  # [E, n / E] indices into `routed`
    return NeuronSplit(shared=shared, experts=routed[groups])


def shared_and_pool(act: torch.Tensor, w_down: torch.Tensor, n_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n_shared`` most important neurons and the rest (the routed pool), each ascending.

    Args:
        act: [T, I] SwiGLU activations on calibration tokens.
        w_down: [H, I] down projection.
        n_shared: neurons kept in the shared expert.

    Returns:
        ([n_shared], [I - n_shared]) int64 neuron indices.
    """
    order = torch.argsort(neuron_importance(act, w_down), descending=True, stable=True)
    return torch.sort(order[:n_shared]).values, torch.sort(order[n_shared:]).values


def cluster_experts(s: torch.Tensor, act: torch.Tensor, w_down: torch.Tensor, n_shared: int, n_experts: int,
                    top_k: int, expert_neurons: int, max_cluster_tokens: int = 4096, seed: int = 0) -> NeuronSplit:
    """Routed experts specialised to token clusters (see the module docstring; experts may overlap).

    Args:
        s: [T, H] floating-point FFN inputs (router inputs) of the calibration tokens.
        act: [T, I] SwiGLU activations of the same tokens.
        w_down: [H, I] down projection.
        n_shared: neurons of the shared expert (the most important ones, as in split_neurons).
        n_experts: routed experts E (= token clusters).
        top_k: clusters each token joins (the K of the layer, so experts see what routing gives them).
        expert_neurons: I_e, neurons per routed expert (at most the pool size I - n_shared).
        max_cluster_tokens: tokens clustered (evenly strided over all of them); every token then
            joins its K nearest clusters.
        seed: seed of the clustering start.

    Returns:
        The :class:`NeuronSplit`; ``experts`` is [E, I_e], rows ascending, rows may share neurons.

    Raises:
        ValueError: ``expert_neurons`` exceeds the pool, or fewer than E tokens are given.
    """
    shared, pool = shared_and_pool(act, w_down, n_shared)
    if not 0 < expert_neurons <= pool.numel():
        raise ValueError(f"experts of {expert_neurons} neurons cannot come from a pool of {pool.numel()}")
    n_tokens = min(s.shape[0], max_cluster_tokens) // n_experts * n_experts
    if n_tokens == 0:
        raise ValueError(f"{s.shape[0]} tokens cannot form {n_experts} clusters")
    directions = torch.nn.functional.normalize(s - s.mean(dim=0), dim=1)  # [T, H]
    sample = torch.arange(n_tokens) * (s.shape[0] // n_tokens)  # strided: every kind of calibration text
    groups = sample[balanced_kmeans(directions[sample], n_experts, seed=seed)]  # [E, n_tokens / E] token ids
    centroids = torch.nn.functional.normalize(directions[groups].mean(dim=1), dim=1)  # [E, H]
    joined = torch.topk(directions @ centroids.T, top_k, dim=-1).indices  # [T, K]
    member = torch.zeros(s.shape[0], n_experts, dtype=act.dtype).scatter_(1, joined, 1.0)  # [T, E]
    contribution = act[:, pool].abs() * w_down[:, pool].norm(dim=0)  # [T, n]
    per_cluster = (member.T @ contribution) / member.sum(dim=0).clamp_min(1.0)[:, None]  # [E, n]
    lift = per_cluster / contribution.mean(dim=0).clamp_min(torch.finfo(act.dtype).tiny)  # [E, n]
    chosen = torch.topk(lift, expert_neurons, dim=1).indices  # [E, I_e] into the pool
    return NeuronSplit(shared=shared, experts=pool[torch.sort(chosen, dim=1).values])
