"""The predictor interface and the two parameter-free baselines.

Shapes: T tokens, H hidden, E experts, K top-k.

A predictor runs inside MoE layer l as soon as r_l (the residual after attention, before the
MoE) exists, and returns the routing it expects at the next MoE layer l' (l' = l+1, or further
when dense layers sit between). Its cost is one norm and one H x E matmul per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moespec.models.base import MoeAdapter, Routing


@dataclass(frozen=True)
class LayerRef:
    """What a predictor needs of an MoE layer.

    Attributes:
        layer: decoder layer index.
        norm: the layer's post-attention norm (router input s_l = norm(r_l)).
        block: the layer's MoE block (its router is ``block.gate``).
    """

    layer: int
    norm: nn.Module
    block: nn.Module


class NextLayerPredictor:
    """Base class. ``targets`` maps an MoE layer to the next MoE layer it predicts for."""

    name = "base"

    def __init__(self, adapter: MoeAdapter, refs: list[LayerRef]) -> None:
        self.adapter = adapter
        self.refs = {r.layer: r for r in refs}
        self.targets = {a.layer: b for a, b in zip(refs, refs[1:])}
        self.aheads = {a.layer: c for a, c in zip(refs, refs[2:])}  # distance 2: the lookahead

    def target(self, layer: int) -> LayerRef | None:
        """The next MoE layer after ``layer`` (None for the last one)."""
        return self.targets.get(layer)

    def ahead(self, layer: int) -> LayerRef | None:
        """The MoE layer after the next one (distance 2; None for the last two)."""
        return self.aheads.get(layer)

    def predict_ahead(self, layer: int, residual: torch.Tensor) -> Routing | None:
        """Predicted routing [T, K] of the MoE layer after the next (``ahead(layer)``) from r_l [T, H],
        or None: this predictor has no lookahead (the default)."""
        return None

    @property
    def first(self) -> LayerRef | None:
        """The first MoE layer (None: no MoE layer)."""
        return self.refs[min(self.refs)] if self.refs else None

    def predict_first(self, state: torch.Tensor) -> Routing | None:
        """Predicted routing [T, K] of the first MoE layer of a new token, made before its first layer
        runs, from ``state`` [T, H]: the token's quasi-hidden state there (its embedding plus the default
        vector of what runs before that layer's MoE: runtime/layer/token_start.py). The first layer's
        router on it, for every predictor (the next token's routing is no layer's ``predict``)."""
        ref = self.first
        if ref is None:
            return None
        logits = self.adapter.router_logits(ref.block, ref.norm(state))  # [T, E]
        return self.adapter.select(ref.block, logits)

    def predict(self, layer: int, residual: torch.Tensor, used: Routing) -> Routing | None:
        """Predicted routing of the next MoE layer.

        Args:
            layer: the running MoE layer l.
            residual: r_l [T, H], the residual stream after attention at layer l.
            used: the routing layer l runs with (true in exact/guarded, speculated in speculative).

        Returns:
            Routing with ids [T, K] and weights [T, K] for layer target(l), or None (no prediction).
        """
        raise NotImplementedError


class NoPredictor(NextLayerPredictor):
    """`none`: no prefetch, experts load on demand (the paper's baseline)."""

    name = "none"

    def predict(self, layer: int, residual: torch.Tensor, used: Routing) -> Routing | None:
        return None


class RouterPredictor(NextLayerPredictor):
    """`router`: router_{l+1}(LN_{l+1}(r_l)) — the next layer's gate on the current state.

    Source: Eliseev & Mazur 2023 (mixtral-offloading); the paper's "router-based speculation".
    """

    name = "router"

    def signal(self, layer: int, residual: torch.Tensor, used: Routing) -> torch.Tensor:
        """The state fed to the next norm: r_l here; the quasi predictor adds d_l."""
        return residual

    def predict(self, layer: int, residual: torch.Tensor, used: Routing) -> Routing | None:
        nxt = self.target(layer)
        if nxt is None:
            return None
        state = nxt.norm(self.signal(layer, residual, used))  # [T, H]
        logits = self.adapter.router_logits(nxt.block, state)  # [T, E]
        return self.adapter.select(nxt.block, logits)

    def predict_ahead(self, layer: int, residual: torch.Tensor) -> Routing | None:
        """router_{l+2}(LN_{l+2}(r_l)): the lookahead (lower recall than l+1's; runtime/layer/ahead.py)."""
        far = self.ahead(layer)
        if far is None:
            return None
        logits = self.adapter.router_logits(far.block, far.norm(residual))  # [T, E]
        return self.adapter.select(far.block, logits)
