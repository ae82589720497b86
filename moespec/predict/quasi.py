"""`quasi`: the paper's quasi-hidden state, router_{l+1}(LN_{l+1}(r_l + d_l)).

Shapes: T tokens, H hidden, E experts, K top-k.

d_l = sum over the routing used at layer l of g_e * d_{l,e}, where d_{l,e} is the calibrated
default vector of expert e (moespec calibrate). It stands in for the MoE output of layer l, which
does not exist yet when the prediction is made (before layer l's experts run), so the copy of
layer l+1's experts overlaps layer l's expert compute. Layer l+1's attention is ignored.
Source: Madan et al., arXiv 2603.19289 (2026).
"""

from __future__ import annotations

import torch

from moespec.models.base import MoeAdapter, Routing
from moespec.predict.base import LayerRef, RouterPredictor


def quasi_delta(vectors: torch.Tensor, used: Routing) -> torch.Tensor:
    """d_l [T, H] float32 from a layer's default vectors [E, H] and the routing used (ids/weights [T, K])."""
    d = vectors[used.ids]  # [T, K, H]
    return (used.weights.to(d.dtype).unsqueeze(-1) * d).sum(dim=1)  # [T, H]


class QuasiPredictor(RouterPredictor):
    """`quasi`: RouterPredictor whose signal is r_l + d_l.

    Args:
        adapter, refs: as RouterPredictor.
        vectors: decoder layer -> default vectors [E, H] (float32, on the device of the residual).
    """

    name = "quasi"

    def __init__(self, adapter: MoeAdapter, refs: list[LayerRef], vectors: dict[int, torch.Tensor]) -> None:
        super().__init__(adapter, refs)
        self.vectors = vectors

    def signal(self, layer: int, residual: torch.Tensor, used: Routing) -> torch.Tensor:
        """r_l + d_l [T, H], in the residual's dtype (added in float32)."""
        d = quasi_delta(self.vectors[layer], used)  # [T, H] float32
        return (residual.float() + d).to(residual.dtype)
