"""Expert compute from packed rows, summed as transformers' default experts implementation sums.

Shapes: T tokens, H hidden, K top-k, E experts, P packed elements per expert, S = T*K pairs.

How one expert is computed from its packed row is the adapter's ExpertLayout (SwiGLU, GPT-OSS's
clamped SwiGLU with biases, MXFP4 dequantised on the device).

Accumulation. transformers 5's default experts implementation (``grouped_mm``, also ``batched_mm``;
integrations/moe.py) multiplies each (token, k) pair's expert output by its gate weight in the
promoted dtype (bf16 output x float32 weight -> float32 for Mixtral, DeepSeek, GLM), lays the
products out as [T, K, H], sums over K (torch's sum accumulates bf16 in float32) and rounds ONCE to
the hidden dtype. Its ``eager`` loop instead adds experts in ascending id into a tensor of the
hidden dtype, rounding after every expert. :class:`TopkSum` does what the default does, so `exact`
mode equals ``from_pretrained`` with no ``experts_implementation``; :func:`reference_moe_eager`
keeps the eager sum as a second reference. In float32 both agree to ~1e-7.

Grouping. :func:`group_by_expert` finds the pairs of every expert with one stable argsort and one
count vector read to the host (one sync per layer); :func:`token_positions` (``torch.where`` per
expert, one sync each on CUDA) is its slow reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moespec.models.base import ExpertLayout, Routing


@dataclass(frozen=True)
class ExpertGroups:
    """The (token, top-k position) pairs of a routing, grouped by expert.

    Attributes:
        pairs: [S] flat pair indices t*K + k, sorted by expert, then ascending token (device).
        top_k: K.
        spans: expert -> (start, end) of its pairs in ``pairs`` (host ints; experts with no pair absent).
    """

    pairs: torch.Tensor
    top_k: int
    spans: dict[int, tuple[int, int]]

    @property
    def experts(self) -> list[int]:
        """Experts with at least one pair, ascending."""
        return sorted(self.spans)

    def positions(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token_idx [t], k_idx [t], flat pair index [t]) of ``expert``; no host sync."""
        start, end = self.spans[expert]
        flat = self.pairs[start:end]  # [t]
        return flat // self.top_k, flat % self.top_k, flat


def group_by_expert(ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Group the pairs of ids [T, K] by expert: one argsort, counts read to the host once.

    The counts use scatter_add (``torch.bincount`` reads its max to the host on CUDA).

    Args:
        ids: [T, K] expert ids (int64) on any device.
        num_experts: E (ids must lie in [0, E)).

    Returns:
        ExpertGroups whose per-expert token order equals :func:`token_positions`.
    """
    flat = ids.reshape(-1).long()  # [S] (scatter_add needs int64 indices)
    pairs = torch.argsort(flat, stable=True)  # [S] by expert, ties (same expert) by pair index
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)  # [E]
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    spans, at = {}, 0
    for e, n in enumerate(counts.tolist()):  # the one host read of the layer
        if n:
            spans[e] = (at, at + n)
            at += n
    return ExpertGroups(pairs=pairs, top_k=ids.shape[-1], spans=spans)


def token_positions(ids: torch.Tensor, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow reference of ExpertGroups.positions: (token_idx [t], k_idx [t]) of ``expert`` in ids [T, K].

    ``torch.where`` with one argument: a host sync per expert on CUDA.
    """
    return torch.where(ids == expert)


def gated(raw: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """raw [t, H] x gate weights [t, 1] in the promoted dtype (as transformers: bf16 x fp32 -> fp32).

    ``weights`` must keep a dimension: a 0-dim float32 weight would not promote a bf16 product.
    """
    return raw * weights  # [t, H]


class TopkSum:
    """Sums weighted expert outputs as transformers' default experts implementation does.

    Each (token, k) pair's weighted output is stored in ``buf`` [T, K, H] of the product dtype
    (hidden dtype promoted with the gate weights' dtype); :meth:`result` sums over K and rounds once.

    Args:
        x: [T, H] router input (its dtype is the output dtype).
        weights: [T, K] gate weights of the routing that runs.
    """

    def __init__(self, x: torch.Tensor, weights: torch.Tensor) -> None:
        t, k = weights.shape
        dtype = torch.promote_types(x.dtype, weights.dtype)
        self.buf = torch.zeros(t, k, x.shape[-1], dtype=dtype, device=x.device)  # [T, K, H]
        self.out_dtype = x.dtype

    def put_pairs(self, flat: torch.Tensor, weighted: torch.Tensor) -> None:
        """Store weighted outputs [t, H] at flat pair indices [t] (t*K + k)."""
        self.buf.view(-1, self.buf.shape[-1]).index_copy_(0, flat, weighted.to(self.buf.dtype))

    def result(self) -> torch.Tensor:
        """[T, H]: sum over K (float32 accumulation for bf16/fp16), one rounding to the hidden dtype."""
        return self.buf.sum(dim=1).to(self.out_dtype)


def sum_one_token(raws: list[torch.Tensor], weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """TopkSum for one token from its raw expert outputs [1, H] in top-k order and their gate weights
    weights [1, K]: [1, H] in x's dtype.

    One stack [1, K, H], one multiply by weights [1, K, 1] (the products :func:`gated` makes, in the
    promoted dtype) and one reduction over K, instead of one slice and one multiply per expert; the
    same values in the same contiguous [1, K, H] as TopkSum's. An empty list (nothing ran) gives zeros.
    """
    if not raws:
        return torch.zeros_like(x)
    return (torch.stack(raws, dim=1) * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)  # [1, K, H] -> [1, H]


def sum_stacked(y: torch.Tensor, weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """:func:`sum_one_token` from the raw outputs already in one tensor y [K, 1, H] (top-k order: the
    one native call's buffer, ExpertLayout.forward_stacked): [1, H] in x's dtype.

    y [K, 1, H] contiguous is the [1, K, H] that sum_one_token stacks, in the same memory: the same
    multiply and reduction on the same values, so equal bit for bit (tests/test_topk_sum.py), without
    the K views, the stack and its copy.
    """
    k = y.shape[0]
    return (y.reshape(1, k, y.shape[-1]) * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)  # [1, K, H] -> [1, H]


def weighted_contribution(x: torch.Tensor, routing: Routing, expert: int, row: torch.Tensor,
                          layout: ExpertLayout, act) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slow reference: (token_idx [t], raw output [t, H], weighted output [t, H]) of one expert.

    Args:
        x: [T, H] router input s_l.
        routing: ids/weights [T, K].
        expert: expert id.
        row: [P] the expert's packed row (a device slot or a host row).
        layout: how the row is packed and computed.
        act: the block's activation (None where the layout has its own, e.g. GPT-OSS).

    Returns:
        The weighted output is in the promoted dtype (see :func:`gated`).
    """
    tok, kpos = token_positions(routing.ids, expert)
    y = layout.forward(x[tok], row, act)  # [t, H]
    return tok, y, gated(y, routing.weights[tok, kpos, None])


def decode_contribution(x: torch.Tensor, routing: Routing, k: int, row: torch.Tensor, layout: ExpertLayout,
                        act) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast path of :func:`weighted_contribution` for one token whose k-th expert is known on the host.

    No data-dependent ``torch.where`` (a device sync on CUDA).

    Args:
        x: [1, H]; k: position of the expert in routing.ids[0]; row, layout, act: as weighted_contribution.

    Returns:
        (raw output [1, H], weighted output [1, H] in the promoted dtype).
    """
    y = layout.forward(x, row, act)  # [1, H]
    return y, gated(y, routing.weights[:, k : k + 1])


def reference_moe(x: torch.Tensor, routing: Routing, store_rows: torch.Tensor, layout: ExpertLayout,
                  act) -> torch.Tensor:
    """Slow reference of the runner's sum: the routed MoE output straight from host rows, no cache.

    Equals transformers' default experts implementation (see the module docstring).

    Args:
        x: [T, H] router input s_l.
        routing: ids/weights [T, K].
        store_rows: [E, P] packed experts of the layer (ExpertStore.buffer[m]).
        layout: the packed layout.
        act: the block's activation (None where the layout has its own).

    Returns:
        [T, H] in x's dtype.
    """
    acc = TopkSum(x, routing.weights)
    for e in sorted(set(routing.ids.flatten().tolist())):
        tok, kpos = token_positions(routing.ids, e)
        _, _, y = weighted_contribution(x, routing, e, store_rows[e].to(x.device), layout, act)
        acc.put_pairs(tok * routing.ids.shape[1] + kpos, y)
    return acc.result()


def reference_moe_eager(x: torch.Tensor, routing: Routing, store_rows: torch.Tensor, layout: ExpertLayout,
                        act) -> torch.Tensor:
    """The sum of transformers' ``experts_implementation="eager"``: experts in ascending id, each
    added into x's dtype (one rounding per expert). Arguments as :func:`reference_moe`; returns [T, H]."""
    out = torch.zeros_like(x)
    for e in sorted(set(routing.ids.flatten().tolist())):
        tok, _, y = weighted_contribution(x, routing, e, store_rows[e].to(x.device), layout, act)
        out.index_add_(0, tok, y.to(out.dtype))
    return out
