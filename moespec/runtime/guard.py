"""The `guarded` miss policy: fetch only the misses that matter, substitute the rest.

Shapes: K top-k, E experts (one decode token).

For each true top-K expert that is not resident, its renormalised weight w_k = g_k / Σ g decides:
w_k >= τ fetches it (as `exact` would); w_k < τ replaces it by the best-scoring resident expert of
the layer not already chosen. Weights are then recomputed from the router softmax over what runs
and rescaled to the original top-K mass, so the output scale is kept. τ = 0 is `exact`.

:func:`guard_routing_device` is the decode path: the same decision as tensor ops on the device
(fixed [K] shapes, the number of experts that run returned as a 0-dim tensor), so the runner reads
it to the host together with the routing ids, in its one transfer of the layer.
:func:`guard_routing` (host lists, one ``.item()`` per candidate) is its slow reference. They can
differ only when two resident candidates have equal router logits (tie order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moespec.models.base import Routing


@dataclass(frozen=True)
class GuardResult:
    """routing: what runs; skipped: true experts not run; skipped_mass: their true weight;
    substituted: resident experts run in their place."""

    routing: Routing
    skipped: int
    skipped_mass: float
    substituted: int


def guard_routing(routing: Routing, resident: set[int], threshold: float) -> GuardResult:
    """Apply the guard to a one-token routing (slow reference of :func:`guard_routing_device`).

    Args:
        routing: true routing, ids/weights [1, K], logits [1, E] (required).
        resident: expert ids of this layer held (or in flight) in the device cache.
        threshold: τ, in renormalised gate weight.

    Returns:
        GuardResult; its routing is ``routing`` itself when nothing was skipped.
    """
    ids = routing.ids[0].tolist()
    w = routing.weights[0].float()
    w_norm = w / w.sum()
    keep = [e for k, e in enumerate(ids) if e in resident or w_norm[k].item() >= threshold]
    if len(keep) == len(ids):
        return GuardResult(routing, 0, 0.0, 0)
    skipped_mass = float(sum(w[k].item() for k, e in enumerate(ids) if e not in keep))
    logits = routing.logits[0].float()  # [E]
    chosen = set(ids)
    candidates = sorted((e for e in resident if e not in chosen), key=lambda e: -logits[e].item())
    subs = candidates[: len(ids) - len(keep)]
    run = keep + subs
    probs = torch.softmax(logits, dim=-1)[run]  # [k']
    new_w = probs / probs.sum() * w.sum()
    new = Routing(
        ids=torch.tensor([run], dtype=routing.ids.dtype, device=routing.ids.device),
        weights=new_w.to(routing.weights.dtype).unsqueeze(0),
        logits=routing.logits,
    )
    return GuardResult(new, len(ids) - len(keep), skipped_mass, len(subs))


@dataclass(frozen=True)
class DeviceGuard:
    """The guard's result as device tensors (nothing read to the host).

    Attributes:
        routing: ids/weights [1, K]: kept true experts (in top-k order), then substitutes (best
            logit first); positions from ``n_run`` on are padding (weight 0). logits as given.
        n_run: 0-dim int64, experts that run (K less the skipped ones without a substitute).
        skipped: 0-dim int64, true experts that do not run.
        skipped_mass: 0-dim float64, their true gate weight.
        substituted: 0-dim int64, resident experts run in their place.
    """

    routing: Routing
    n_run: torch.Tensor
    skipped: torch.Tensor
    skipped_mass: torch.Tensor
    substituted: torch.Tensor


def resident_mask(resident: set[int], num_experts: int, device: torch.device) -> torch.Tensor:
    """[E] bool on ``device``, True for the experts in ``resident``.

    Built on the host and copied without blocking (from pinned memory on CUDA), so no host sync.
    """
    mask = torch.zeros(num_experts, dtype=torch.bool)  # [E] host
    if resident:
        mask[list(resident)] = True
    if device.type == "cuda":
        return mask.pin_memory().to(device, non_blocking=True)
    return mask.to(device)


def guard_routing_device(routing: Routing, resident: torch.Tensor, threshold: float) -> DeviceGuard:
    """Apply the guard to a one-token routing with tensor ops only (no host sync).

    Args:
        routing: true routing, ids/weights [1, K], logits [1, E] (required).
        resident: [E] bool on the routing's device (see :func:`resident_mask`).
        threshold: τ, in renormalised gate weight.

    Returns:
        DeviceGuard; where nothing is skipped its ids and weights equal ``routing``'s bit for bit.
    """
    ids = routing.ids[0]  # [K]
    k, num_experts = ids.shape[0], resident.shape[0]
    dev = ids.device
    w = routing.weights[0].float()  # [K]
    w_norm = w / w.sum()
    # float64 comparison: the reference compares Python floats (a float32 τ could round up)
    keep = resident[ids] | (w_norm.double() >= threshold)  # [K]
    drop = ~keep
    logits = routing.logits[0].float()  # [E]
    chosen = torch.zeros_like(resident).index_fill_(0, ids, True)  # [E]
    candidate = resident & ~chosen  # [E]
    n = min(k, num_experts)
    cand = torch.topk(logits.masked_fill(~candidate, float("-inf")), n).indices  # [n] best logit first
    n_keep = keep.sum()  # 0-dim
    j = torch.arange(k, device=dev)  # [K] run position
    sub = j - n_keep  # [K] index into cand for the positions after the kept ones
    sub_c = sub.clamp(min=0, max=n - 1)
    kept_first = torch.argsort(drop.to(torch.uint8), stable=True)  # [K] kept positions, in top-k order
    is_kept = j < n_keep
    run_ids = torch.where(is_kept, ids[kept_first], cand[sub_c])  # [K]
    valid = is_kept | ((sub < n) & candidate[cand[sub_c]])  # [K]
    probs = torch.softmax(logits, dim=-1)[run_ids] * valid  # [K]
    new_w = probs / probs.sum() * w.sum()  # [K]
    any_drop = drop.any()
    weights = torch.where(any_drop, new_w.to(routing.weights.dtype), routing.weights[0])  # [K]
    n_run = valid.sum()
    skipped = drop.sum()
    return DeviceGuard(
        routing=Routing(ids=run_ids.unsqueeze(0), weights=weights.unsqueeze(0), logits=routing.logits),
        n_run=n_run,
        skipped=skipped,
        skipped_mass=(w.double() * drop).sum(),
        substituted=n_run - n_keep,
    )
