"""Expert compute: SwiGLU experts read from device slots, and the slow reference beside it.

Shapes: T tokens, H hidden, I expert intermediate, K top-k, E experts.

Contributions are accumulated in ascending expert id, as transformers' eager experts loop does,
so `exact` mode reproduces the reference model bit for bit on the same device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moespec.models.base import ExpertLayout, Routing


def expert_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act) -> torch.Tensor:
    """One SwiGLU expert: down(act(gate(x)) * up(x)).

    Args:
        x: [t, H] tokens routed to this expert.
        gate_up: [2I, H] (halves: gate rows, then up rows).
        down: [H, I].
        act: activation (SiLU for every supported family).

    Returns:
        [t, H] raw expert output, before the gate weight.
    """
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # [t, I] each
    return F.linear(act(gate) * up, down)  # [t, H]


def token_positions(ids: torch.Tensor, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and top-k positions routed to ``expert``: (token_idx [t], k_idx [t]) from ids [T, K]."""
    return torch.where(ids == expert)


def weighted_contribution(x: torch.Tensor, routing: Routing, expert: int, gate_up: torch.Tensor,
                          down: torch.Tensor, act) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_idx [t], raw output [t, H], gated output [t, H]) of one expert for its tokens."""
    tok, kpos = token_positions(routing.ids, expert)
    y = expert_forward(x[tok], gate_up, down, act)  # [t, H]
    return tok, y, y * routing.weights[tok, kpos, None]


def decode_contribution(x: torch.Tensor, routing: Routing, k: int, gate_up: torch.Tensor, down: torch.Tensor,
                        act) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fast path of :func:`weighted_contribution` for one token whose k-th expert is known on the host.

    Avoids the data-dependent ``torch.where`` (a device sync on CUDA) per expert.

    Args:
        x: [1, H]; k: position of the expert in routing.ids[0].

    Returns:
        (token_idx [1], raw output [1, H], gated output [1, H]).
    """
    y = expert_forward(x, gate_up, down, act)  # [1, H]
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
        gate_up, down = layout.unpack(store_rows[e].to(x.device))
        tok, _, y = weighted_contribution(x, routing, e, gate_up, down, act)
        out.index_add_(0, tok, y.to(out.dtype))
    return out
