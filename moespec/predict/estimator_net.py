"""The router estimator: a small network from a layer's state to the next router's logits.

Shapes: T tokens, H hidden, D = H/m bottleneck, E experts, S served layers.

    q [T, H] --down--> [T, D] + emb[layer] --SiLU MLP (D -> n*D -> D), residual--> norm --head--> z [T, E]

q is what the parameter-free predictors feed the next router: LN_{l+1}(r_l + d_l) with a calibration
(the quasi-hidden state) or LN_{l+1}(r_l) without one. The shape follows the paper's estimator
(Madan et al., arXiv 2603.19289); m and n are options. An ``EstimatorBank`` holds either one
network per served layer or one network shared by every served layer, told apart by the layer
embedding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class EstimatorShape:
    """Sizes of the estimators of one model.

    Attributes:
        hidden: H, the state size.
        experts: E, the next router's output size.
        down: m, the down-projection factor (bottleneck D = H / m, at least 8).
        expand: n, the MLP's expansion (D -> n*D -> D).
        shared: one network for every served layer (True) or one per layer (False).
    """

    hidden: int
    experts: int
    down: int = 8
    expand: int = 2
    shared: bool = False

    @property
    def bottleneck(self) -> int:
        """D = H / m (at least 8)."""
        return max(8, self.hidden // self.down)

    def to_dict(self) -> dict:
        return asdict(self)


class RouterEstimator(nn.Module):
    """One estimator network; ``num_layers`` rows of layer embedding (1 for a per-layer network).

    Args:
        shape: the sizes.
        num_layers: how many served layers this network tells apart.
    """

    def __init__(self, shape: EstimatorShape, num_layers: int = 1) -> None:
        super().__init__()
        d = shape.bottleneck
        self.down = nn.Linear(shape.hidden, d)
        self.layer_emb = nn.Embedding(num_layers, d)
        self.up = nn.Linear(d, shape.expand * d)
        self.proj = nn.Linear(shape.expand * d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, shape.experts)
        nn.init.normal_(self.layer_emb.weight, std=0.02)

    def forward(self, q: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """q [T, H] -> logits z [T, E] for the served layer at embedding row ``slot``."""
        h = self.down(q) + self.layer_emb.weight[slot]  # [T, D]
        h = h + self.proj(nn.functional.silu(self.up(h)))  # [T, D], residual MLP
        return self.head(self.norm(h))  # [T, E]


class EstimatorBank(nn.Module):
    """The estimators of the served layers (decoder-layer indices ``layers``, in order).

    Args:
        shape: the sizes.
        layers: the MoE layers l whose state predicts the next MoE layer.
    """

    def __init__(self, shape: EstimatorShape, layers: list[int]) -> None:
        super().__init__()
        self.shape = shape
        self.layers = list(layers)
        self.slot = {layer: i for i, layer in enumerate(self.layers)}
        if shape.shared:
            self.nets = nn.ModuleList([RouterEstimator(shape, len(self.layers))])
        else:
            self.nets = nn.ModuleList([RouterEstimator(shape, 1) for _ in self.layers])

    def net(self, layer: int) -> tuple[RouterEstimator, int]:
        """(network, embedding row) serving ``layer``."""
        i = self.slot[layer]
        return (self.nets[0], i) if self.shape.shared else (self.nets[i], 0)

    def forward(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """q [T, H] at served layer ``layer`` -> logits [T, E] of the next MoE layer."""
        net, slot = self.net(layer)
        return net(q, slot)

    def num_parameters(self, layer: int | None = None) -> int:
        """Parameters of the whole bank, or of what serves ``layer`` (a shared net counts once per bank)."""
        if layer is None:
            return sum(p.numel() for p in self.parameters())
        net, _ = self.net(layer)
        return sum(p.numel() for p in net.parameters())

    def layer_state(self, layer: int) -> dict[str, torch.Tensor]:
        """A copy of the weights that serve ``layer`` (for keeping the best checkpoint per layer)."""
        net, _ = self.net(layer)
        return {k: v.detach().clone() for k, v in net.state_dict().items()}

    def load_layer_state(self, layer: int, state: dict[str, torch.Tensor]) -> None:
        net, _ = self.net(layer)
        net.load_state_dict(state)
