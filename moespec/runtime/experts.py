"""Expert compute: experts read from device slots (packed rows), and the slow reference beside it.

Shapes: T tokens, H hidden, K top-k, E experts, P packed elements per expert.

How one expert is computed from its packed row is the adapter's ExpertLayout (SwiGLU, GPT-OSS's
clamped SwiGLU with biases, MXFP4 dequantised on the device). Contributions are accumulated in
ascending expert id, as transformers' eager experts loop does, so `exact` mode reproduces the
reference model bit for bit on the same device.
"""

from __future__ import annotations

import torch

from moespec.models.base import ExpertLayout, Routing


def token_positions(ids: torch.Tensor, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and top-k positions routed to ``expert``: (token_idx [t], k_idx [t]) from ids [T, K]."""
    return torch.where(ids == expert)


def weighted_contribution(x: torch.Tensor, routing: Routing, expert: int, row: torch.Tensor,
                          layout: ExpertLayout, act) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_idx [t], raw output [t, H], gated output [t, H]) of one expert for its tokens.

    Args:
        x: [T, H] router input s_l.
        routing: ids/weights [T, K].
        expert: expert id.
        row: [P] the expert's packed row (a device slot or a host row).
        layout: how the row is packed and computed.
        act: the block's activation (None where the layout has its own, e.g. GPT-OSS).
    """
    tok, kpos = token_positions(routing.ids, expert)
    y = layout.forward(x[tok], row, act)  # [t, H]
    return tok, y, y * routing.weights[tok, kpos, None]


def decode_contribution(x: torch.Tensor, routing: Routing, k: int, row: torch.Tensor, layout: ExpertLayout,
                        act) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fast path of :func:`weighted_contribution` for one token whose k-th expert is known on the host.

    Avoids the data-dependent ``torch.where`` (a device sync on CUDA) per expert.

    Args:
        x: [1, H]; k: position of the expert in routing.ids[0]; row, layout, act: as weighted_contribution.

    Returns:
        (token_idx [1], raw output [1, H], gated output [1, H]).
    """
    y = layout.forward(x, row, act)  # [1, H]
    tok = torch.zeros(1, dtype=torch.long, device=x.device)
    return tok, y, y * routing.weights[0, k]


def reference_moe(x: torch.Tensor, routing: Routing, store_rows: torch.Tensor, layout: ExpertLayout,
                  act) -> torch.Tensor:
    """Slow reference: the routed MoE output straight from a layer's host rows, no cache.

    Args:
        x: [T, H] router input s_l.
        routing: ids/weights [T, K].
        store_rows: [E, P] packed experts of the layer (ExpertStore.buffer[m]).
        layout: the packed layout.

    Returns:
        [T, H] sum over the top-k of weight * expert(x), in x's dtype.
    """
    out = torch.zeros_like(x)
    for e in sorted(set(routing.ids.flatten().tolist())):
        tok, _, y = weighted_contribution(x, routing, e, store_rows[e].to(x.device), layout, act)
        out.index_add_(0, tok, y.to(out.dtype))
    return out
