"""One MoE layer through the expert cache: routing, prefetch of the next layer, streamed compute.

Shapes: T tokens, H hidden, K top-k, E experts.

Order inside MoE layer l (the copy of l+1 overlaps l's expert compute):
  1. routing of l: the true router (exact, guarded), or the prediction made at l-1 (speculative);
  2. prefetch pins of l that the routing does not use are released (counted as wasted);
  3. l's experts are acquired: hits pinned, misses copied on demand (as many as slots allow);
  4. the predictor turns r_l into the routing of l+1, and those experts are prefetched;
  5. l's experts run in the order their copies land; each slot is released after use and the
     freed slot takes the next missing expert (so a prefill touching every expert streams the
     whole layer through a small cache in one pass).
Prediction and approximate modes apply to decode steps (T == 1); prefill is always exact.
"""

from __future__ import annotations

from collections import deque

import torch

from moespec.config import ExecuteMode
from moespec.errors import BudgetError
from moespec.models.base import MoeAdapter, Routing
from moespec.predict.base import NextLayerPredictor
from moespec.runtime.cache import ExpertCache
from moespec.runtime.experts import decode_contribution, weighted_contribution
from moespec.runtime.guard import guard_routing
from moespec.runtime.stats import LayerStats, StatsRecorder
from moespec.runtime.transfer import Span


class MoeLayerRunner:
    """Runs MoE layers of one model instance; holds the cross-layer state of one forward pass.

    Args:
        adapter: the architecture adapter.
        cache: the device expert cache.
        predictor: next-layer predictor (NoPredictor for `none`).
        execute: execution mode on wrong predictions.
        fetch_threshold: τ of the guarded mode.
        recorder: stats recorder (NullRecorder when nobody listens).
    """

    def __init__(self, adapter: MoeAdapter, cache: ExpertCache, predictor: NextLayerPredictor,
                 execute: ExecuteMode, fetch_threshold: float, recorder: StatsRecorder) -> None:
        self.adapter = adapter
        self.cache = cache
        self.predictor = predictor
        self.execute = execute
        self.fetch_threshold = fetch_threshold
        self.recorder = recorder
        self.expert_bytes = cache.store.expert_bytes
        self.residual: dict[int, torch.Tensor] = {}  # layer -> r_l [.., H], set by a norm pre-hook
        self.predicted: dict[int, Routing] = {}  # target layer -> predicted routing
        self.prefetch_pins: dict[int, list[int]] = {}  # target layer -> slots pinned by prefetch
        self.routings: dict[int, Routing] = {}  # layer -> routing that ran (for oracle/calibration)
        self.record_routing = False
        # Optional observer (calibration, estimator data collection): gets .routing(layer, x,
        # residual, routing) and .expert_output(layer, expert, token_idx, raw_output); None = free.
        self.observer = None

    def reset_step(self) -> None:
        """Drop per-forward state; release prefetch pins a previous forward left behind."""
        for slots in self.prefetch_pins.values():
            for slot in slots:
                self.cache.unused_prefetch(slot)
                self.cache.release(slot)
        self.prefetch_pins.clear()
        self.predicted.clear()
        self.residual.clear()
        self.routings.clear()

    def abort(self) -> None:
        """Recover from a forward that ended in an exception (Ctrl-C between or inside layers).

        Cancels the queued copies, drops every cache pin (running layer and prefetch alike) and
        the per-forward state, so the next forward starts as after a finished one.
        """
        self.cache.abort()
        self.prefetch_pins.clear()
        self.predicted.clear()
        self.residual.clear()
        self.routings.clear()

    # ------------------------------------------------------------------------------------
    def run(self, block, x: torch.Tensor) -> torch.Tensor:
        """Routed (+ shared) MoE output [T, H] of ``block`` for router input ``x`` [T, H]."""
        layer = block.layer
        stats = self.recorder.layer(layer)
        decode = x.shape[0] == 1
        predicted = self.predicted.pop(layer, None)
        routing = self._routing(block, x, predicted, stats, decode)
        if self.record_routing:
            self.routings[layer] = routing
        if self.observer is not None:
            self.observer.routing(layer, x, self.residual.get(layer), routing)
        out = self._compute(block, x, routing, stats, decode)
        shared = self.adapter.shared_output(block, x)
        return out if shared is None else out + shared

    def _routing(self, block, x: torch.Tensor, predicted: Routing | None, stats: LayerStats,
                 decode: bool) -> Routing:
        speculate = decode and predicted is not None and self.execute == ExecuteMode.SPECULATIVE
        true = None
        if not speculate or self.recorder.enabled:
            true = self.adapter.route(block, x)  # in speculative mode only to measure recall
        if predicted is not None and self.recorder.enabled:
            _record_recall(stats, predicted, true)
        if speculate:
            if true is not None:
                _record_skipped(stats, predicted, true)
            return predicted
        if decode and self.execute == ExecuteMode.GUARDED:
            g = guard_routing(true, self.cache.resident_experts(block.layer), self.fetch_threshold)
            stats.skipped += g.skipped
            stats.skipped_mass += g.skipped_mass
            stats.substituted += g.substituted
            return g.routing
        return true

    def _release_unused_prefetch(self, layer: int, needed: set[int], stats: LayerStats) -> list[int]:
        keep = []
        for slot in self.prefetch_pins.pop(layer, []):
            key = self.cache.key_of(slot)
            if key is not None and key[1] in needed:
                keep.append(slot)
                continue
            if self.cache.cancel_prefetch(slot):
                # The copy never started: no bytes moved, the slot is free again.
                stats.prefetched -= 1
                stats.prefetch_cancelled += 1
                stats.h2d_bytes -= self.expert_bytes
            elif self.cache.unused_prefetch(slot):
                stats.prefetch_wasted += 1
            self.cache.release(slot)
        return keep

    def _prefetch_next(self, layer: int, residual: torch.Tensor, routing: Routing) -> None:
        pred = self.predictor.predict(layer, residual, routing)
        if pred is None:
            return
        target = self.predictor.target(layer).layer
        self.predicted[target] = pred
        tstats = self.recorder.layer(target)
        pins = []
        for e in sorted(set(pred.ids.flatten().tolist())):
            got = self.cache.prefetch((target, e))
            if got is None:
                break  # no free slot: prefetch is best effort
            slot, copied = got
            pins.append(slot)
            if copied:
                tstats.prefetched += 1
                tstats.h2d_bytes += self.expert_bytes
        self.prefetch_pins[target] = pins

    def _compute(self, block, x: torch.Tensor, routing: Routing, stats: LayerStats,
                 decode: bool) -> torch.Tensor:
        layer = block.layer
        cache, rec = self.cache, self.recorder
        host_ids = routing.ids.tolist()  # [T][K] on the host: one sync per layer
        experts = sorted({e for row in host_ids for e in row})
        k_of = {e: k for k, e in enumerate(host_ids[0])} if len(host_ids) == 1 else None
        kept_prefetch = self._release_unused_prefetch(layer, set(experts), stats)
        # Resident experts first (no wait), then misses in id order.
        resident = cache.resident_experts(layer)
        pending = deque([e for e in experts if e in resident] + [e for e in experts if e not in resident])
        in_flight: deque = deque()

        def fill() -> None:
            while pending:
                got = cache.acquire((layer, pending[0]))
                if got is None:
                    return
                in_flight.append((pending.popleft(), got.slot))
                if got.hit:
                    stats.hits += 1
                    stats.prefetch_used += got.prefetched
                else:
                    stats.misses += 1
                    stats.h2d_bytes += self.expert_bytes

        fill()
        for slot in kept_prefetch:  # now pinned by acquire as well
            cache.release(slot)
        if decode:
            residual = self.residual.pop(layer, None)
            if residual is not None:
                self._prefetch_next(layer, residual.reshape(-1, residual.shape[-1]), routing)
        parts = []
        while in_flight:
            e, slot = in_flight.popleft()
            rec.span(stats, "stall_ms", cache.wait(slot))
            t0 = self.cache.engine.mark() if rec.enabled else None
            row, layout = cache.row(slot), cache.store.layout  # [P] packed expert, computed by its layout
            if k_of is not None:  # one token: its top-k position is known on the host
                tok, raw, y = decode_contribution(x, routing, k_of[e], row, layout, block.act_fn)
            else:
                tok, raw, y = weighted_contribution(x, routing, e, row, layout, block.act_fn)
            if self.observer is not None:
                self.observer.expert_output(layer, e, tok, raw)
            parts.append((e, tok, y))
            if rec.enabled:
                rec.span(stats, "compute_ms", Span(t0, self.cache.engine.mark()))
            cache.release(slot)
            fill()
            if pending and not in_flight:
                raise BudgetError(
                    f"layer {layer} needs an expert but all {cache.num_slots} cache slots are pinned",
                    "raise --cache-experts / --gpu-memory",
                )
        out = torch.zeros_like(x)
        for _, tok, y in sorted(parts, key=lambda p: p[0]):  # ascending expert id, as transformers
            out.index_add_(0, tok, y.to(out.dtype))
        return out


def _record_recall(stats: LayerStats, predicted: Routing, true: Routing) -> None:
    """recall@K and weighted recall of ``predicted`` against ``true`` (ids/weights [T, K])."""
    hit = (predicted.ids.unsqueeze(-1) == true.ids.unsqueeze(-2)).any(dim=-2)  # [T, K] true k predicted?
    w = true.weights.float()
    stats.recall_hits += int(hit.sum())
    stats.recall_total += hit.numel()
    stats.weighted_hit += float((w * hit).sum())
    stats.weighted_total += float(w.sum())


def _record_skipped(stats: LayerStats, ran: Routing, true: Routing) -> None:
    """True top-K experts that did not run, and their true gate mass."""
    ran_hit = (true.ids.unsqueeze(-1) == ran.ids.unsqueeze(-2)).any(dim=-1)  # [T, K]
    stats.skipped += int((~ran_hit).sum())
    stats.skipped_mass += float((true.weights.float() * ~ran_hit).sum())
