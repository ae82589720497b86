"""The `guarded` miss policy: fetch only the misses that matter, substitute the rest.

Shapes: K top-k, E experts (one decode token).

For each true top-K expert that is not resident, its renormalised weight w_k = g_k / Σ g decides:
w_k >= τ fetches it (as `exact` would); w_k < τ replaces it by the best-scoring resident expert of
the layer not already chosen. Weights are then recomputed from the router softmax over what runs
and rescaled to the original top-K mass, so the output scale is kept. τ = 0 is `exact`.
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
    """Apply the guard to a one-token routing.

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
