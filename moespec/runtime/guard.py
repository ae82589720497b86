"""The `guarded` miss policy: fetch only the misses that matter, substitute the rest.

Shapes: K top-k, E experts (one decode token).

For each true top-K expert that is not resident, its renormalised weight w_k = g_k / Σ g decides:
w_k >= τ fetches it (as `exact` would); w_k < τ replaces it by the best-scoring resident expert of
the layer not already chosen. Weights are then recomputed from the router softmax over what runs
and rescaled to the original top-K mass, so the output scale is kept. τ = 0 is `exact`.

The decode path never reads a device value per expert. :func:`guard_signals` packs what the
decision needs (ids, the w_k >= τ flags, the gate weights, the experts by descending logit) into
one float64 vector that the runner reads with the rest of the layer's ids in its one transfer;
:func:`plan_guard` decides on the host from those lists and the cache's resident set; only when
something is substituted does :func:`substituted_routing` recompute weights on the device (a
non-blocking copy of the new ids, no sync). :func:`guard_routing` (one ``.item()`` per candidate)
is the slow reference; the two differ only in the order of resident candidates with equal logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moespec.models.base import Routing


@dataclass(frozen=True)
class GuardPlan:
    """The guard's decision for one token, on the host.

    Attributes:
        run: expert ids that run (kept true experts in top-k order, then substitutes, best logit
            first), or None when every true expert runs (the routing is unchanged).
        skipped: true experts that do not run; skipped_mass: their true gate weight;
        substituted: resident experts run in their place.
    """

    run: list[int] | None
    skipped: int
    skipped_mass: float
    substituted: int


def guard_signals(routing: Routing, threshold: float) -> torch.Tensor:
    """What the guard decides from, as one float64 vector [3K + E] on the device (no sync).

    [ids (K) | w_k >= τ flags (K) | gate weights (K, float32 values) | experts by descending logit (E)];
    float64 holds all of them exactly. ``routing``: ids/weights [1, K], logits [1, E].
    """
    w = routing.weights[0].float()  # [K]
    # the flag is taken as the reference takes it: float32 w / Σw, compared in double precision
    heavy = (w / w.sum()).double() >= threshold  # [K]
    order = torch.argsort(routing.logits[0].float(), descending=True, stable=True)  # [E]
    return torch.cat([routing.ids[0].double(), heavy.double(), w.double(), order.double()])


def plan_guard(signals: list[float], k: int, resident: set[int]) -> GuardPlan:
    """Decide on the host from ``guard_signals`` read as a list (K = ``k``) and the resident experts."""
    ids = [int(v) for v in signals[:k]]
    heavy, w = signals[k : 2 * k], signals[2 * k : 3 * k]
    keep = [e for i, e in enumerate(ids) if e in resident or heavy[i]]
    if len(keep) == k:
        return GuardPlan(None, 0, 0.0, 0)
    kept = set(keep)
    skipped_mass = float(sum(w[i] for i, e in enumerate(ids) if e not in kept))
    chosen = set(ids)
    subs = [e for e in (int(v) for v in signals[3 * k :]) if e in resident and e not in chosen][: k - len(keep)]
    return GuardPlan(keep + subs, k - len(keep), skipped_mass, len(subs))


def substituted_routing(routing: Routing, run: list[int]) -> Routing:
    """The routing that runs ``run`` (host ids): weights from the router softmax over ``run``,
    rescaled to the true top-K mass, in the routing's weight dtype; ids/weights [1, len(run)]."""
    device = routing.ids.device
    run_ids = torch.tensor([run], dtype=routing.ids.dtype)  # [1, k'] host
    run_ids = run_ids.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else run_ids.to(device)
    probs = torch.softmax(routing.logits[0].float(), dim=-1)[run_ids[0]]  # [k']
    new_w = probs / probs.sum() * routing.weights[0].float().sum()
    return Routing(ids=run_ids, weights=new_w.to(routing.weights.dtype).unsqueeze(0), logits=routing.logits)


@dataclass(frozen=True)
class GuardResult:
    """routing: what runs; skipped: true experts not run; skipped_mass: their true weight;
    substituted: resident experts run in their place."""

    routing: Routing
    skipped: int
    skipped_mass: float
    substituted: int


def guard_routing(routing: Routing, resident: set[int], threshold: float) -> GuardResult:
    """Apply the guard to a one-token routing (slow reference of guard_signals + plan_guard).

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
