"""Observer: what a job may watch inside the MoE layers (routings, expert outputs); no-op by default.

Shapes: T tokens, t tokens routed to one expert, H hidden, K top-k.

The layer runner calls an observer at every MoE layer of every forward: ``routing`` once, with the
routing that runs, before any cache slot is acquired (so an observer may end a prefill there:
runtime.chunks.StopForward); ``expert_output`` once per expert that ran. The base class does
nothing, so the runner never asks whether one is attached. Calibration collects default vectors
and recall this way, train-estimator its states, profile the trace of routings (RoutingLog).
"""

from __future__ import annotations

import torch

from moespec.models.base import Routing


class Observer:
    """Watches the MoE layers; every method is a no-op here (override what you need)."""

    def routing(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None, routing: Routing) -> None:
        """Decoder layer ``layer`` runs with ``routing`` (ids/weights [T, K]) on router input x [T, H];
        ``residual``: r_l [.., H] (None when the norm hook did not see it)."""

    def expert_output(self, layer: int, expert: int, token_idx: torch.Tensor, raw_output: torch.Tensor) -> None:
        """``expert`` of ``layer`` produced ``raw_output`` [t, H] (before its gate weight) for the
        tokens ``token_idx`` [t] (read-only; in a decode step the same [1] zeros each call)."""


class RoutingLog(Observer):
    """Keeps the routing every MoE layer ran with in the last forward: ``routings`` (layer -> Routing)."""

    def __init__(self) -> None:
        self.routings: dict[int, Routing] = {}

    def routing(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None, routing: Routing) -> None:
        self.routings[layer] = routing
