"""The `guarded` miss policy: fetch only the misses that matter, substitute the rest.

Shapes: K top-k, E experts (one decode token).

A true top-K expert that is resident always runs. For the misses, the renormalised weight
w_k = g_k / Σ g decides, by the rule (``GuardRule``, ``--guard-rule``) and τ (``--fetch-threshold``):

- ``threshold``: a miss with w_k < τ is skipped, every other miss is fetched (as `exact` would);
- ``budget``: misses are skipped lightest first while the token's skipped weight Σ w_k stays
  <= τ; the rest are fetched. So at most τ of a token's gate mass is lost per layer, however many
  of its experts miss (``threshold`` can lose up to K·τ).

A skipped expert is replaced by the resident expert of the layer with the highest router logit
that is not already chosen (``substitute``; without it the skipped expert is dropped). Weights
are then recomputed from the router softmax over what runs and rescaled to the original top-K
mass, so the output scale is kept. τ = 0 is `exact` under both rules.

The decode path never reads a device value per expert. :func:`guard_signals` packs what the
decision needs (ids, gate weights, the experts by descending logit) into one float64 vector that
the runner reads with the rest of the layer's ids in its one transfer; :func:`plan_guard` decides
on the host from that list and the cache's resident set; only when something is substituted does
:func:`substituted_routing` recompute weights on the device (a non-blocking copy of the new ids,
no sync). :func:`guard_routing` (one ``.item()`` per candidate) is the slow reference; both call
:func:`skipped_positions`, and differ only in the order of resident candidates with equal logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moespec.config import GuardRule
from moespec.models.base import Routing


@dataclass(frozen=True)
class GuardPlan:
    """The guard's decision for one token, on the host.

    Attributes:
        run: expert ids that run (kept true experts in top-k order, then substitutes, best logit
            first), or None when every true expert runs (the routing is unchanged).
        skipped: true experts that do not run; skipped_mass: their share of the token's top-K gate
            mass (renormalised weight, in [0, 1]); substituted: resident experts run in their place.
    """

    run: list[int] | None
    skipped: int
    skipped_mass: float
    substituted: int


def skipped_positions(ids: list[int], w: list[float], resident: set[int], threshold: float,
                      rule: GuardRule = GuardRule.BUDGET) -> list[int]:
    """Top-k positions whose expert is skipped (host floats; both paths decide here).

    Args:
        ids: the K true expert ids; w: their gate weights (any scale; renormalised here in double).
        resident: expert ids of the layer held (or in flight) in the device cache.
        threshold: τ in renormalised weight; rule: how τ is applied (module docstring).
    """
    if threshold <= 0:
        return []  # τ = 0 is exact, even for a zero weight
    total = sum(w)
    share = [x / total if total > 0 else 0.0 for x in w]
    misses = [k for k, e in enumerate(ids) if e not in resident]
    if rule == GuardRule.THRESHOLD:
        return [k for k in misses if share[k] < threshold]
    skipped, used = [], 0.0
    for k in sorted(misses, key=lambda k: (share[k], k)):  # lightest first; ties: top-k order
        if used + share[k] > threshold:
            break
        skipped.append(k)
        used += share[k]
    return sorted(skipped)


def guard_signals(routing: Routing) -> torch.Tensor:
    """What the guard decides from, as one float64 vector [2K + E] on the device (no sync).

    [ids (K) | gate weights (K, float32 values) | experts by descending logit (E)]; float64 holds all
    of them exactly. ``routing``: ids/weights [1, K], logits [1, E]. τ is applied on the host
    (:func:`plan_guard`).
    """
    w = routing.weights[0].float()  # [K]
    order = torch.argsort(routing.logits[0].float(), descending=True, stable=True)  # [E]
    return torch.cat([routing.ids[0].double(), w.double(), order.double()])


def signals_length(k: int, num_experts: int) -> int:
    """Length of :func:`guard_signals` for K = ``k`` and E = ``num_experts``."""
    return 2 * k + num_experts


def plan_guard(signals: list[float], k: int, resident: set[int], threshold: float,
               rule: GuardRule = GuardRule.BUDGET, substitute: bool = True) -> GuardPlan:
    """Decide on the host from ``guard_signals`` read as a list (K = ``k``) and the resident experts."""
    ids = [int(v) for v in signals[:k]]
    w = signals[k : 2 * k]
    skip = skipped_positions(ids, w, resident, threshold, rule)
    if not skip:
        return GuardPlan(None, 0, 0.0, 0)
    total = sum(w)
    keep = [e for i, e in enumerate(ids) if i not in skip]
    skipped_mass = float(sum(w[i] for i in skip) / total)
    subs: list[int] = []
    if substitute:
        chosen = set(ids)
        subs = [e for e in (int(v) for v in signals[2 * k :]) if e in resident and e not in chosen][: len(skip)]
    return GuardPlan(keep + subs, len(skip), skipped_mass, len(subs))


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
    """routing: what runs; skipped: true experts not run; skipped_mass: their share of the top-K
    gate mass; substituted: resident experts run in their place."""

    routing: Routing
    skipped: int
    skipped_mass: float
    substituted: int


def guard_routing(routing: Routing, resident: set[int], threshold: float,
                  rule: GuardRule = GuardRule.BUDGET, substitute: bool = True) -> GuardResult:
    """Apply the guard to a one-token routing (slow reference of guard_signals + plan_guard).

    Args:
        routing: true routing, ids/weights [1, K], logits [1, E] (required).
        resident: expert ids of this layer held (or in flight) in the device cache.
        threshold: τ, in renormalised gate weight; rule, substitute: as the module docstring says.

    Returns:
        GuardResult; its routing is ``routing`` itself when nothing was skipped.
    """
    ids = routing.ids[0].tolist()
    w = routing.weights[0].float()  # [K]
    w_host = [w[k].item() for k in range(len(ids))]
    skip = skipped_positions(ids, w_host, resident, threshold, rule)
    if not skip:
        return GuardResult(routing, 0, 0.0, 0)
    keep = [e for k, e in enumerate(ids) if k not in skip]
    skipped_mass = float(sum(w_host[k] for k in skip) / sum(w_host))
    logits = routing.logits[0].float()  # [E]
    subs: list[int] = []
    if substitute:
        chosen = set(ids)
        candidates = sorted((e for e in resident if e not in chosen), key=lambda e: -logits[e].item())
        subs = candidates[: len(skip)]
    run = keep + subs
    probs = torch.softmax(logits, dim=-1)[run]  # [k']
    new_w = probs / probs.sum() * w.sum()
    new = Routing(
        ids=torch.tensor([run], dtype=routing.ids.dtype, device=routing.ids.device),
        weights=new_w.to(routing.weights.dtype).unsqueeze(0),
        logits=routing.logits,
    )
    return GuardResult(new, len(skip), skipped_mass, len(subs))
