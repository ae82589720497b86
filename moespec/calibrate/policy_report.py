"""Hit rate of each cache policy on held-out routing, for `moespec calibrate`'s recall report.

Shapes: M MoE layers, E experts, K top-k, N held-out tokens.

The held-out pass records the true expert ids of every token at every MoE layer; token by token
they form a decode-like trace that is replayed through the runtime's ExpertCache
(runtime/cache/replay.py) on-demand, at 12.5 / 25 / 50 % of all experts, with each policy seeded
from the frequencies just measured on the calibration tokens (never from the held-out ones).
"""

from __future__ import annotations

from functools import partial

import torch

from moespec.config import CachePolicy
from moespec.runtime.cache.eviction import make_rule, seed_from_frequencies
from moespec.runtime.cache.replay import replay

FRACTIONS = (0.125, 0.25, 0.5)
MAX_TOKENS = 512  # replay cost grows with tokens x slots; 512 tokens settle the rates to ~0.01


def held_out_trace(ids: dict[int, list[torch.Tensor]], max_tokens: int = MAX_TOKENS) -> list[dict[int, list[int]]]:
    """Per-token trace from layer -> list of [T, K] id chunks (in order), first ``max_tokens`` tokens."""
    layers = sorted(ids)
    if not layers:
        return []
    per_layer = {layer: torch.cat(ids[layer])[:max_tokens].tolist() for layer in layers}  # [N, K]
    n = min(len(v) for v in per_layer.values())
    return [{layer: per_layer[layer][t] for layer in layers} for t in range(n)]


def policy_hit_rates(trace: list[dict[int, list[int]]], layers: list[int], frequencies: torch.Tensor, top_k: int,
                     policies: list[CachePolicy], fractions: tuple[float, ...] = FRACTIONS) -> dict[str, list[float]]:
    """policy -> hit rate at each fraction of the M x E experts (on-demand replay of ``trace``).

    Args:
        frequencies: [M, E] top-K memberships on the calibration tokens (the seed).
    """
    seed = seed_from_frequencies(layers, frequencies, top_k)
    total = frequencies.numel()
    out = {}
    for policy in policies:
        rates = []
        for frac in fractions:
            slots = max(top_k, int(total * frac))
            rates.append(replay(trace, slots, partial(make_rule, policy, seed, slots, top_k), prefetch_slots=0)
                         .hit_rate())
        out[policy.value] = rates
    return out
