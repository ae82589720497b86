"""Default vectors and expert frequencies, accumulated from the MoE runner's observer hook.

Shapes: M MoE layers, E experts, H hidden, T tokens, K top-k, t tokens routed to one expert.

d_{l,e} (moespec/predict/quasi.py) is the mean raw output of expert e at layer l (before its gate weight) over
the calibration tokens routed to e. The gate-weighted variant weighs each token's raw output by
its gate g: sum(g * raw) / sum(g); which one predicts better is decided on held-out tokens.
Sums are kept in float64 so the result does not depend on chunking to float32 precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moespec.models.base import Routing

VARIANTS = ("mean", "gate_weighted")  # default-vector variants, in tie-break order


@dataclass(frozen=True)
class DefaultVectors:
    """What calibration collected.

    Attributes:
        layers: decoder-layer index of each of the M MoE layers.
        vectors: variant name -> [M, E, H] float32 default vectors (unrouted experts filled).
        frequencies: [M, E] int64, how often each expert was in the true top-K (sums to T*K per layer).
        unrouted: [M] int64, experts never routed to at each layer (filled with the layer mean).
        tokens: T, calibration tokens seen.
    """

    layers: list[int]
    vectors: dict[str, torch.Tensor]
    frequencies: torch.Tensor
    unrouted: torch.Tensor
    tokens: int


class DefaultVectorCollector:
    """Observer for ``MoeLayerRunner.observer``: sums raw expert outputs per (layer, expert).

    Args:
        layers: decoder-layer indices of the MoE layers, in order.
        num_experts: E.
        hidden: H.
        device: where the sums live (the model's device: no host sync per expert on CUDA).
    """

    def __init__(self, layers: list[int], num_experts: int, hidden: int, device: torch.device | str = "cpu") -> None:
        self.layers = list(layers)
        self.position = {layer: m for m, layer in enumerate(self.layers)}
        m, e = len(self.layers), num_experts
        f64, i64 = dict(dtype=torch.float64, device=device), dict(dtype=torch.int64, device=device)
        self.raw_sum = torch.zeros(m, e, hidden, **f64)  # [M, E, H] sum of raw outputs
        self.weighted_sum = torch.zeros(m, e, hidden, **f64)  # [M, E, H] sum of g * raw
        self.count = torch.zeros(m, e, **i64)  # [M, E] tokens whose output was seen
        self.gate_mass = torch.zeros(m, e, **f64)  # [M, E] sum of g
        self.frequencies = torch.zeros(m, e, **i64)  # [M, E] top-K memberships
        self.tokens = 0
        self._routing: dict[int, Routing] = {}  # layer -> routing of the running forward pass

    # --- observer interface ------------------------------------------------------------------
    def routing(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None, routing: Routing) -> None:
        """Called once per MoE layer and forward pass, before its experts run."""
        m = self.position[layer]
        ids = routing.ids.reshape(-1)  # [T*K]
        self.frequencies[m] += torch.bincount(ids, minlength=self.frequencies.shape[1])
        if m == 0:
            self.tokens += routing.ids.shape[0]
        self._routing[layer] = routing

    def expert_output(self, layer: int, expert: int, token_idx: torch.Tensor, raw_output: torch.Tensor) -> None:
        """Raw output [t, H] of ``expert`` for the tokens ``token_idx`` [t] routed to it."""
        m = self.position[layer]
        ids = self._routing[layer].ids
        tok, kpos = torch.where(ids == expert)  # same order as the runner's token_idx
        gate = self._routing[layer].weights[tok, kpos].double()  # [t]
        raw = raw_output.double()  # [t, H]
        self.raw_sum[m, expert] += raw.sum(dim=0)
        self.weighted_sum[m, expert] += (gate[:, None] * raw).sum(dim=0)
        self.count[m, expert] += raw.shape[0]
        self.gate_mass[m, expert] += gate.sum()

    # --- result --------------------------------------------------------------------------------
    def result(self) -> DefaultVectors:
        """Default vectors of both variants; experts never routed get their layer's mean vector."""
        seen = self.count > 0  # [M, E]
        mean = self.raw_sum / self.count.clamp(min=1).unsqueeze(-1)  # [M, E, H]
        weighted = self.weighted_sum / self.gate_mass.clamp(min=1e-30).unsqueeze(-1)  # [M, E, H]
        vectors = {"mean": _fill_unrouted(mean, seen), "gate_weighted": _fill_unrouted(weighted, seen)}
        return DefaultVectors(
            layers=list(self.layers),
            vectors={k: v.float().cpu().contiguous() for k, v in vectors.items()},
            frequencies=self.frequencies.cpu(),
            unrouted=(~seen).sum(dim=1).cpu(),
            tokens=self.tokens,
        )


def _fill_unrouted(vectors: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Replace the vectors [M, E, H] of unseen experts by the mean over that layer's seen experts."""
    out = vectors.clone()
    for m in range(vectors.shape[0]):
        if seen[m].all() or not seen[m].any():
            continue
        out[m, ~seen[m]] = vectors[m, seen[m]].mean(dim=0)
    return out
